"""Which folder a path means: the step-N folder to export or resume from, or the model folder to generate with.

A path may name a step-N folder, a run folder (its newest complete checkpoint) or, for generating and evaluating, any
Hugging Face model folder. Whatever has a checkpoint.json is checked against it (sizes and sha256) before use: flipped
bytes in a weight file are an error, never a model that quietly computes something else.
"""

from __future__ import annotations

import sys
from pathlib import Path

from anyseek.checkpoint.adapters import is_lora
from anyseek.checkpoint.folder import MARKER, STEP_DIR, is_sharded, latest_checkpoint, list_checkpoints, verify
from anyseek.storage import CheckpointError


def find_checkpoint(run_or_step: str | Path) -> tuple[Path, bool]:
    """(the step-N folder, whether it was verified): `run_or_step` itself when it is a step-N folder, else the newest
    complete checkpoint in that run folder (verified on the way)."""
    path = Path(run_or_step).expanduser()
    if STEP_DIR.match(path.name) and path.is_dir():
        return path, False
    ckpt = latest_checkpoint(path, log=lambda s: print(s, file=sys.stderr))
    if ckpt is None:
        raise CheckpointError(f"{path}: no complete checkpoint to export (a step-N folder, or a run folder with one)")
    return ckpt.path, True


def model_folder(path: str | Path) -> Path:
    """The Hugging Face model folder `path` means, checked: itself when it holds config.json (verified against its
    checkpoint.json when it is a training checkpoint: CheckpointDamaged naming the file), else the newest complete
    step-N of a run folder (newer damaged ones are named on stderr and skipped). A LoRA or sharded checkpoint holds no
    model folder: CheckpointError saying how to export one."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    if not (folder / "config.json").is_file():
        _refuse_unexported(folder)
        if not list_checkpoints(folder):
            raise CheckpointError(f"{folder} is not a checkpoint: no config.json, and no step-N checkpoint folders "
                                  "inside")
        # verified (sizes and sha256); a damaged newer one is skipped with a warning naming its file, never silently
        ckpt = latest_checkpoint(folder, log=lambda s: print(s, file=sys.stderr))
        if ckpt is None:
            raise CheckpointError(f"{folder}: no complete checkpoint (every step-N folder is unfinished or damaged)")
        _refuse_unexported(ckpt.path)
        return ckpt.path
    _refuse_unexported(folder)
    if (folder / MARKER).is_file():
        verify(folder)
    return folder


def _refuse_unexported(folder: Path) -> None:
    """A LoRA run's step-N holds adapters only, a multi-process run's its shards: say how to get a model folder."""
    if is_lora(folder):
        raise CheckpointError(f"{folder} is a LoRA checkpoint (adapters only); write the model with "
                              f"`anyseek export --merge {folder} --out DIR` and use DIR")
    if is_sharded(folder):
        raise CheckpointError(f"{folder} is a sharded checkpoint of a multi-process run; write one model folder with "
                              f"`anyseek export {folder} --out DIR` and use DIR")
