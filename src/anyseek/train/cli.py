"""`anyseek train [--config FLAVOR_OR_TOML] [--out DIR] [--resume] [--section.key=value ...]`"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ACCEPTS_EXTRA = True  # --section.key=value overrides arrive as unknown arguments


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="tiny",
                        help="a built-in config (tiny, small) or model flavor (16B, 671B), or a .toml/.json file")
    parser.add_argument("--out", default=None, help="output folder for checkpoints and logs (default: runs/<config>)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="train on N processes of this machine (one per GPU): launches torchrun for you")
    parser.epilog = ("Overrides: --section.key=value for any field of [model], [data] or [train], "
                     "e.g. --train.max_steps=200 --train.lr=3e-4 --data.tokens_per_batch=8192.")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.train.config import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config, extra)
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        cfg.model_config()  # validate the model section before touching data
    except ConfigError as e:
        print(f"anyseek train: config error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    if args.nproc_per_node:
        from anyseek.distributed.launch import relaunch_with_torchrun

        return relaunch_with_torchrun(args.nproc_per_node, ["--config", args.config, "--out", str(out),
                                                            *(["--resume"] if args.resume else []), *extra])
    from anyseek.distributed.env import shutdown_process_group
    from anyseek.train.trainer import Trainer, TrainingDiverged

    try:
        summary = Trainer(cfg, out, resume=args.resume).run()
    except (FileExistsError, FileNotFoundError) as e:
        print(f"anyseek train: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged:
        return 3
    finally:
        shutdown_process_group()
    if "val_loss" in summary and os.environ.get("RANK", "0") == "0":
        print(f"done: {summary['step']} steps, {summary['tokens_seen']:,} tokens in {summary['wall_s'] / 60:.1f} min; "
              f"validation loss {summary['val_loss']:.4f} (perplexity {summary['val_perplexity']:.2f}); "
              f"checkpoint {summary['checkpoint']}")
    return 0
