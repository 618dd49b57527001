"""`anyseek export RUN_OR_STEP --out DIR`: a Hugging Face folder (consolidated safetensors, config, tokenizer) from
a sharded checkpoint written by a distributed run. RUN_OR_STEP: a step-N folder, or a run folder (its newest
complete checkpoint). One-process runs write Hugging Face folders directly; exporting one copies its model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step-N checkpoint folder, or a run folder (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.distributed.checkpoint import export, is_sharded
    from anyseek.storage import CheckpointError
    from anyseek.train.checkpoint import STEP_DIR, latest_checkpoint

    src = Path(args.checkpoint)
    if not STEP_DIR.match(src.name):
        found = latest_checkpoint(src)
        if found is None:
            print(f"anyseek export: no complete checkpoint in {src}", file=sys.stderr)
            return 2
        src = found.path
    try:
        if is_sharded(src):
            out = export(src, Path(args.out))
        else:
            import anyseek

            import shutil

            out = Path(args.out)
            anyseek.save_pretrained(anyseek.load_pretrained(src), out)
            for f in src.iterdir():
                if f.name.startswith(("tokenizer", "special_tokens")):
                    shutil.copy2(f, out / f.name)
    except CheckpointError as e:
        print(f"anyseek export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
