"""`anyseek train [--config FLAVOR_OR_TOML] [--init PATH] [--out DIR] [--resume [--resume-override KEY]]
[--nproc-per-node N] [--section.key=value ...]`"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

ACCEPTS_EXTRA = True  # --section.key=value overrides arrive as unknown arguments


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="tiny",
                        help="a built-in config (tiny, small) or model flavor (16B, 671B), or a .toml/.json file")
    parser.add_argument("--out", default=None, help="output folder for checkpoints and logs (default: runs/<config>; "
                                                    "with --init runs/<the init folder's name>)")
    parser.add_argument("--init", default=None, metavar="PATH",
                        help="start from a pretrained model: a Hugging Face DeepSeek-V2/V3 folder or a step-N folder "
                             "(its config and tokenizer are used; add --train.lora_rank=16 for LoRA)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest intact checkpoint in --out (its config and data must match)")
    parser.add_argument("--resume-override", action="append", default=[], metavar="KEY",
                        help="with --resume: allow KEY (e.g. train.lr) to differ from the checkpoint's config "
                             "(repeatable)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                        help="train on N processes of this machine (one per GPU): launches torchrun for you")
    parser.epilog = _config_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def _config_help() -> str:
    """The config sections and their keys, for --help (the TOML sections / --section.key=value overrides)."""
    import dataclasses

    from anyseek.train.config import DataConfig, ParallelConfig, TrainConfig, named_configs

    def keys(cls) -> str:
        return ", ".join(f.name for f in dataclasses.fields(cls))

    return ("Config: --config NAME (" + ", ".join(named_configs()) + ", or a model flavor) or a .toml/.json file, "
            "then overrides --section.key=value (values parse as TOML).\n"
            "  [model]     flavor, and any ModelConfig field (hidden_size, num_hidden_layers, vocab_size, ...)\n"
            f"  [data]      {keys(DataConfig)}\n"
            f"  [train]     {keys(TrainConfig)}\n"
            f"  [parallel]  {keys(ParallelConfig)}  (under torchrun; docs/distributed.md)\n"
            "--print-config shows the resolved config.")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.train.config import ConfigError, load_run_config

    try:
        if args.init:
            if any(e.startswith("--model.flavor") for e in extra):
                raise ConfigError("--model.flavor cannot be combined with --init: the model comes from the folder")
            extra = [*extra, f"--train.init={json.dumps(args.init)}"]
        cfg = load_run_config(args.config, extra)
    except ConfigError as e:
        print(f"anyseek train: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    if args.resume_override and not args.resume:
        print("anyseek train: error: --resume-override needs --resume", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(args.config, args.init)
    if args.nproc_per_node:
        if cfg.train.lora_rank:
            print("anyseek train: error: LoRA (train.lora_rank) runs in one process for now; drop --nproc-per-node",
                  file=sys.stderr)
            return 2
        from anyseek.distributed.launch import relaunch_with_torchrun

        resume = ["--resume"] if args.resume else []
        resume += [f"--resume-override={key}" for key in args.resume_override]
        return relaunch_with_torchrun(args.nproc_per_node, ["--config", args.config, "--out", str(out), *resume,
                                                            *extra])
    from anyseek.distributed.env import shutdown_process_group
    from anyseek.train.trainer import Trainer, TrainingDiverged

    trainer, code = None, 1
    try:
        trainer = Trainer(cfg, out, resume=args.resume, resume_overrides=tuple(args.resume_override))
        summary = trainer.run()
        if "val_loss" in summary and os.environ.get("RANK", "0") == "0":
            val = summary["val_loss"]
            tail = (f"validation loss {val:.4f} (perplexity {summary['val_perplexity']:.2f})" if not math.isnan(val)
                    else "no validation data")
            print(f"done: {summary['step']} steps, {summary['tokens_seen']:,} tokens in "
                  f"{summary['wall_s'] / 60:.1f} min; {tail}; checkpoint {summary['checkpoint']}")
        code = 0
    except TrainingDiverged:
        code = 3
    finally:
        if trainer is not None:
            try:  # the CUDA graphs go before the process group they captured collectives of
                trainer.close()
            except Exception as e:  # noqa: BLE001 - say it, and let the run's own error (if any) be the one raised
                print(f"anyseek train: warning: could not release the CUDA graphs: {e}", file=sys.stderr)
        if not shutdown_process_group():
            _leave_without_process_group(code)
    return code


def default_out(config: str, init: str | None) -> Path:
    """runs/<config name>; with --init runs/<the folder's name> (the model comes from it, not from --config), and
    runs/<run>-step-N for a run's step-N folder."""
    if not init:
        return Path("runs") / Path(config).stem
    folder = Path(init).expanduser().resolve()
    if re.fullmatch(r"step-\d+", folder.name) and folder.parent.name:
        return Path("runs") / f"{folder.parent.name}-{folder.name}"
    return Path("runs") / folder.name


def _leave_without_process_group(code: int) -> None:
    """The process group's teardown did not return (`shutdown_process_group`): everything the run writes is written;
    say so and end the process now (a normal exit would wait on the same teardown in its destructors)."""
    import traceback

    from anyseek.distributed.env import SHUTDOWN_TIMEOUT_S

    if sys.exc_info()[0] is not None:  # an error on its way out: show it before leaving
        traceback.print_exc()
    print(f"anyseek train: warning: the process group did not shut down within {SHUTDOWN_TIMEOUT_S:.0f} s (NCCL's "
          f"teardown, pytorch/pytorch#115388); the run's outputs are complete; leaving without it", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
