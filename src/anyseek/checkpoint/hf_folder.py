"""A Hugging Face folder (consolidated safetensors, config, tokenizer) from a sharded (DCP) training checkpoint; the
command is `anyseek export RUN_OR_STEP --out DIR` (`anyseek.checkpoint.export`), which comes here for sharded
checkpoints.

The work is `export_sharded(checkpoint_dir, out_dir)`: the checkpoint gathered in one process on the CPU and written
by `write_hf_folder`: anyseek.hf's writer (`write_model_files` inside `anyseek.storage.atomic_folder`, as
`anyseek.save_pretrained` does), tokenizer files copied. `anyseek export` writes one-process and merged LoRA
checkpoints through the same `write_hf_folder`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_PREFIXES = ("tokenizer", "special_tokens")


def export_sharded(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                   max_shard_size: int | str = "5GB") -> Path:
    """A sharded checkpoint folder (step-N with dcp/) -> the Hugging Face folder `out_dir` (replaced atomically).
    dtype: of the floating weights (default: as trained, fp32). Raises CheckpointError for a damaged or unloadable
    checkpoint, ValueError for a folder that is not a sharded checkpoint."""
    from anyseek.checkpoint.sharded import is_sharded, load_consolidated

    src = Path(checkpoint_dir)
    if not is_sharded(src):
        raise ValueError(f"{src}: not a sharded checkpoint (no dcp/ folder)")
    return write_hf_folder(load_consolidated(src), src, Path(out_dir), dtype, max_shard_size)


def write_hf_folder(model, src: Path, out: Path, dtype: torch.dtype | None = None,
                    max_shard_size: int | str = "5GB") -> Path:
    """`model` as the Hugging Face folder `out`, with the tokenizer files of the checkpoint folder `src`; atomic: an
    existing `out` is replaced only once the new folder is complete."""
    from anyseek.hf import write_model_files
    from anyseek.storage import atomic_folder

    with atomic_folder(out) as tmp:
        write_model_files(model, tmp, dtype, max_shard_size)
        for f in sorted(Path(src).iterdir()):
            if f.is_file() and f.name.startswith(TOKENIZER_PREFIXES):
                shutil.copy2(f, tmp / f.name)
    return out
