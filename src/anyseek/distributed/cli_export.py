"""`anyseek export RUN_OR_STEP --out DIR`: a Hugging Face folder (consolidated safetensors, config, tokenizer) from a
training checkpoint. RUN_OR_STEP: a step-N folder, or a run folder (its newest complete checkpoint).

The work is `export_sharded(checkpoint_dir, out_dir)`: a sharded (DCP) checkpoint of a distributed run, gathered in
one process on the CPU and written by anyseek.hf's writer (`write_model_files` inside `anyseek.storage.atomic_folder`,
as `anyseek.save_pretrained` does), tokenizer files copied. One-process checkpoints already are Hugging Face folders;
exporting one rewrites its model through the same writer.

NOTE: the `pretrained` branch adds its own `anyseek export` (train/export.py: Hugging Face export with LoRA
--merge/--peft). When the two meet, that command is the one `anyseek export`: it dispatches to `export_sharded` when
the source is a DCP checkpoint (`anyseek.distributed.checkpoint.is_sharded`), and this module keeps only
`export_sharded`; the command registered here is the stand-in until then.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

TOKENIZER_PREFIXES = ("tokenizer", "special_tokens")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_sharded(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                   max_shard_size: int | str = "5GB") -> Path:
    """A sharded checkpoint folder (step-N with dcp/) -> the Hugging Face folder `out_dir` (replaced atomically).
    dtype: of the floating weights (default: as trained, fp32). Raises CheckpointError for a damaged or unloadable
    checkpoint, ValueError for a folder that is not a sharded checkpoint."""
    from anyseek.distributed.checkpoint import is_sharded, load_consolidated

    src = Path(checkpoint_dir)
    if not is_sharded(src):
        raise ValueError(f"{src}: not a sharded checkpoint (no dcp/ folder)")
    return _write(load_consolidated(src), src, Path(out_dir), dtype, max_shard_size)


def _write(model, src: Path, out: Path, dtype: torch.dtype | None, max_shard_size: int | str) -> Path:
    from anyseek.hf import write_model_files
    from anyseek.storage import atomic_folder

    with atomic_folder(out) as tmp:
        write_model_files(model, tmp, dtype, max_shard_size)
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES):
                shutil.copy2(f, tmp / f.name)
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a step-N checkpoint folder, or a run folder (its newest checkpoint)")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="dtype of the written weights (default: as trained)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from anyseek.distributed.checkpoint import is_sharded
    from anyseek.storage import CheckpointError
    from anyseek.train.checkpoint import STEP_DIR, latest_checkpoint, verify

    src = Path(args.checkpoint)
    if not STEP_DIR.match(src.name):
        found = latest_checkpoint(src, log=lambda s: print(s, file=sys.stderr))
        if found is None:
            raise CheckpointError(f"{src}: no complete checkpoint (step-N folder) to export")
        src = found.path
    dtype = DTYPES.get(args.dtype)
    if is_sharded(src):
        out = export_sharded(src, args.out, dtype)
    else:
        from anyseek.hf import load_pretrained

        verify(src)
        out = _write(load_pretrained(src, device="cpu"), src, Path(args.out), dtype, "5GB")
    print(f"wrote {out}")
    return 0
