"""The step-N folder, its one home: every checkpoint a run writes, reads, verifies, prunes and exports passes here.

    path = checkpoint.save(out_dir, step, model, optimizer, train_state, run_config, tokenizer_files, keep_last,
                           env=par.env, masters=par.masters, adapters=None)
    for ckpt in reversed(checkpoint.checkpoints(out_dir)):      # step-N folders, oldest first
        checkpoint.verify(ckpt.path, env=par.env)               # CheckpointDamaged: fall back to the previous one
        state = checkpoint.load(ckpt.path, model, optimizer, env=par.env, masters=par.masters, verified=True)
    ckpt = checkpoint.latest(out_dir)                           # the newest complete one, or None
    checkpoint.export(run_or_step, out)                         # a Hugging Face folder (LoRA merged, shards gathered)
    folder = checkpoint.model_folder(path)                      # what `anyseek generate PATH` loads, verified
    saver = checkpoint.BackgroundSaver(env=par.env)             # the same folders, written while training goes on:
    saver.start(out_dir, step, model, optimizer, ...)           #   returns once the state is copied to host memory
    path = saver.wait()                                         #   complete (or the write's OSError, raised here)

The face picks the form itself: a run of several processes (`env.active`, torchrun) writes a sharded folder
(`sharded.py`: torch.distributed.checkpoint's safetensors, every rank its shards); one process writes a Hugging Face
model folder plus the training state (`folder.py`), or for a LoRA run only its adapters over the recorded base
(`adapters.py`). Loading takes either form into either kind of run (a sharded checkpoint into one process, a
one-process checkpoint into N ranks). Every folder ends with checkpoint.json (each file's size and sha256), written
last inside a staging folder that is renamed into place (`anyseek.storage.atomic_folder`).

    folder.py     one-process step-N: save (a snapshot, then its files), load, verify, list, prune
    background.py a save in the background: the snapshot into host buffers (host.py), the files by a thread
    sharded.py    sharded step-N (DCP): save, load (any world size), consolidate for export
    dcp_writer.py DCP's Hugging Face files, each streamed to disk by safetensors (no in-memory copy, GIL released)
    optimizer.py  the optimizer's state: optimizer.safetensors + optimizer.json
    adapters.py   a LoRA checkpoint's adapters.safetensors + lora.json
    rng.py        the random streams (torch CPU/GPU, Python) of one process or of every rank
    identity.py   a model folder's path and content hash (--init, LoRA bases)
    find.py       which folder a path means (a step-N, a run's newest, a model folder to generate with), checked
    exporter.py   Hugging Face and PEFT folders from any checkpoint; cli.py: `anyseek export`
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from anyseek.checkpoint.adapters import Adapters, is_lora
from anyseek.checkpoint.background import BackgroundSaver
from anyseek.checkpoint.exporter import export
from anyseek.checkpoint.find import find_checkpoint, model_folder
from anyseek.checkpoint.folder import (
    STEP_DIR,
    Checkpoint,
    CheckpointDamaged,
    is_sharded,
    latest_checkpoint,
    list_checkpoints,
    load_training_state,
    records,
    run_config,
    save_checkpoint,
)
from anyseek.checkpoint.folder import verify as verify_folder
from anyseek.checkpoint.identity import reference
from anyseek.distributed.env import DistEnv
from anyseek.storage import CheckpointError

__all__ = ["STEP_DIR", "Adapters", "BackgroundSaver", "Checkpoint", "CheckpointDamaged", "CheckpointError",
           "checkpoints", "export", "find_checkpoint", "is_lora", "is_sharded", "latest", "load", "model_folder",
           "records", "reference", "run_config", "save", "verify"]

checkpoints = list_checkpoints
latest = latest_checkpoint


def save(out_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], run_config: dict[str, Any], tokenizer_files: list[Path], keep_last: int, *,
         env=None, masters=None, adapters: Adapters | None = None) -> Path:
    """Write `out_dir/step-{step}` atomically, then prune to the newest `keep_last` complete checkpoints.

    env (`anyseek.distributed.env.DistEnv`): with several processes (env.active) every rank calls this and a sharded
    folder is written (`train_state["loader"]`: this rank's loader state; all are kept), the fp32 weights of bf16
    shards from `masters` (`ShardMasters`). One process: a Hugging Face folder plus the training state; `adapters`
    (a LoRA run): the adapters in place of the model. A failure (full disk, read-only folder) raises OSError (on
    every rank alike) and leaves no trace of the new checkpoint."""
    if env is not None and env.active:
        if adapters is not None:
            raise ValueError("LoRA checkpoints are written by one process (their adapters), not sharded")
        from anyseek.checkpoint.sharded import save_sharded  # (torch.distributed.checkpoint, only where sharded)

        return save_sharded(out_dir, step, model, optimizer, train_state, run_config, tokenizer_files, keep_last, env,
                            masters)
    return save_checkpoint(out_dir, step, model, optimizer, train_state, run_config, tokenizer_files, keep_last,
                           adapters)


def verify(ckpt: Path, env=None) -> None:
    """Raise CheckpointDamaged unless every file checkpoint.json lists is there with its size and sha256. With
    several processes every rank hashes a share and all reach the same verdict."""
    if env is not None and env.active:
        from anyseek.checkpoint.sharded import verify_agreed

        verify_agreed(ckpt, env)
        return

    verify_folder(ckpt)


def load(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, env=None, masters=None,
         adapters: Adapters | None = None, verified: bool = False) -> dict[str, Any]:
    """Load `ckpt` into the live model and optimizer (resharded as needed) and return its train_state.json, with
    `loader` set to this process's loader state, or None where the number of processes changed (`saved_loaders`
    then holds every saved rank's, for the caller to remap). verified: the caller has verified the files (a resume
    verifies first, to fall back past a damaged checkpoint).
    Raises CheckpointDamaged for files that fail verification, CheckpointError for any other failure."""
    env = env or DistEnv()
    if not verified:
        verify(ckpt, env)
    if is_sharded(ckpt) or env.active:  # (torch.distributed.checkpoint: imported only here)
        from anyseek.checkpoint.sharded import load_full, load_sharded

        if adapters is not None:
            raise CheckpointError(f"{ckpt}: LoRA checkpoints are read by one process, not into sharded models")
        load_into_shards = load_sharded if is_sharded(ckpt) else load_full
        return load_into_shards(ckpt, model, optimizer, env, masters)
    state = load_training_state(ckpt, model, optimizer, adapters, verified=True)
    state["saved_loaders"] = [state["loader"]]
    return state
