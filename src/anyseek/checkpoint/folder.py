"""Training checkpoints: `DIR/step-N/` is a complete Hugging Face model folder plus the training state.

    step-N/
      config.json  model.safetensors  generation_config.json      the model (transformers loads it)
      tokenizer.json  tokenizer_config.json  special_tokens_map.json
      run_config.json                                              the resolved anyseek config
      optimizer.safetensors  optimizer.json  rng.safetensors  train_state.json
      checkpoint.json                                              written last: every file, its size and sha256

A LoRA run (`train.lora_rank` > 0) writes adapters.safetensors + lora.json (the adapters and the base they sit on,
`anyseek.checkpoint.adapters`) in place of the model files; `anyseek export` turns it into a full model folder.

A checkpoint is assembled in a hidden temporary folder and renamed into place (`anyseek.storage.atomic_folder`, the
same writer `anyseek.save_pretrained` uses), so a crash or `kill -9` at any moment leaves either the complete new
checkpoint or none; the previous ones are untouched. Nothing here is a pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from anyseek.checkpoint import rng
from anyseek.checkpoint.adapters import Adapters, read_adapters, write_adapters
from anyseek.checkpoint.host import HostBuffers
from anyseek.checkpoint.optimizer import load_optimizer, optimizer_state, write_optimizer
from anyseek.hf import load_pretrained, write_model_files
from anyseek.model.transformer import DeepSeekV3
from anyseek.storage import CheckpointError, atomic_folder, recover_staging
from anyseek.transforms.lora import adapter_state

__all__ = ["CheckpointDamaged", "CheckpointError", "Snapshot", "latest_checkpoint", "list_checkpoints",
           "load_training_state", "save_checkpoint", "snapshot", "verify", "write_snapshot"]

STEP_DIR = re.compile(r"^step-(\d+)$")
MARKER = "checkpoint.json"
DCP_DIR = "dcp"  # a sharded checkpoint's tensors (anyseek.checkpoint.sharded)
_HASH_CHUNK = 1 << 22


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are not what its checkpoint.json recorded (unfinished, truncated, flipped bytes):
    a resume falls back to the previous one. Any other load failure is an error, never a reason to start over."""

@dataclass
class Checkpoint:
    path: Path
    step: int


def is_sharded(ckpt: Path) -> bool:
    """Whether `ckpt` is a sharded checkpoint (written by several processes, `anyseek.checkpoint.sharded`)."""
    return (Path(ckpt) / DCP_DIR).is_dir()


def list_checkpoints(out_dir: Path) -> list[Checkpoint]:
    """Folders named step-N in `out_dir`, oldest first (complete or not)."""
    if not out_dir.is_dir():
        return []
    found = [Checkpoint(p, int(m.group(1))) for p in out_dir.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify(ckpt: Path, part: tuple[int, int] = (0, 1), hashes: bool = True) -> None:
    """Raise CheckpointDamaged unless every file listed in checkpoint.json is there with its recorded size and
    sha256 (checkpoints written before hashes were recorded are checked by size). `part=(i, n)` checks only every
    n-th listed file from the i-th (the ranks of a distributed run share the hashing: `anyseek.distributed`).
    hashes=False: marker, files and sizes only (a finished save), reading no tensor data."""
    marker = ckpt / MARKER
    if not marker.is_file():
        raise CheckpointDamaged(f"{ckpt}: no {MARKER} (the save did not finish)")
    try:
        files = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(f"{marker}: unreadable ({e})") from e
    index, count = part
    for name, rec in list(files.items())[index::count]:
        size, digest = (rec, None) if isinstance(rec, int) else (rec.get("size"), rec.get("sha256"))
        f = ckpt / name
        if not f.is_file():
            raise CheckpointDamaged(f"{ckpt}: missing {name}")
        if f.stat().st_size != size:
            raise CheckpointDamaged(f"{ckpt}: {name} has {f.stat().st_size} bytes, expected {size} (truncated?)")
        if hashes and digest is not None and file_sha256(f) != digest:
            raise CheckpointDamaged(f"{ckpt}: {name} does not match its recorded sha256 (damaged on disk)")


def save_checkpoint(
    out_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    run_config: dict[str, Any],
    tokenizer_files: list[Path],
    keep_last: int,
    adapters: Adapters | None = None,
) -> Path:
    """Write `out_dir/step-{step}` atomically, then delete all but the newest `keep_last` complete checkpoints.
    The model's files: the full Hugging Face model, or for a LoRA run (`adapters`) only its adapters."""
    snap = snapshot(step, model, optimizer, train_state, run_config, tokenizer_files, adapters)
    return write_snapshot(out_dir, snap, keep_last)


@dataclass
class Snapshot:
    """What a one-process step-N folder holds, taken at one step: `write_snapshot` writes it. Taken into host
    buffers (`snapshot(host=...)`), it stays as it was while training goes on."""

    step: int
    model: torch.nn.Module | None  # what the model files are written from (None: a LoRA run's adapters instead)
    adapters: tuple[dict[str, torch.Tensor], Adapters] | None
    optimizer: tuple[dict[str, torch.Tensor], list[dict]]  # `optimizer_state`
    rng: dict[str, torch.Tensor]
    texts: dict[str, str]  # run_config.json, train_state.json
    tokenizer_files: list[Path]


def snapshot(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
             run_config: dict[str, Any], tokenizer_files: list[Path], adapters: Adapters | None = None,
             host: HostBuffers | None = None) -> Snapshot:
    """The state of step-N, written at once (host None: the model's own tensors, copied as they are written) or
    later: every tensor copied into `host` (the caller synchronizes it), the records as text."""
    copy = host.copy if host is not None else (lambda name, t: t.detach().to("cpu").contiguous())
    if adapters is not None:
        lora = ({n: copy(f"model/{n}", t) for n, t in adapter_state(model).items()}, adapters)
        weights = None
    else:
        weights = model if host is None else host_model(model.config, host.copy_tree(model.state_dict(), "model"))
        lora = None
    state = {**train_state, "step": step, "python_rng": rng.python_state(), "saved_at": time.time()}
    return Snapshot(step, weights, lora, optimizer_state(optimizer, model, host.copy if host else None),
                    rng.torch_state(), {"run_config.json": json.dumps(run_config, indent=2),
                                        "train_state.json": json.dumps(state, indent=1)}, list(tokenizer_files))


def host_model(config, state: dict[str, torch.Tensor]) -> DeepSeekV3:
    """A DeepSeekV3 whose tensors are `state` (no copy; built on the meta device, which draws no random numbers):
    what `anyseek.hf.write_model_files` writes a model's files from."""
    model = DeepSeekV3(config, device="meta")
    model.load_state_dict(state, assign=True)
    return model


def write_snapshot(out_dir: Path, snap: Snapshot, keep_last: int) -> Path:
    """Write `snap` as `out_dir/step-{step}` atomically, then prune to the newest `keep_last` complete checkpoints.
    A failed write (full disk, read-only folder) raises OSError and leaves no trace."""
    final = out_dir / f"step-{snap.step}"
    with atomic_folder(final) as tmp:
        if snap.adapters is not None:
            tensors, adapters = snap.adapters
            write_adapters(tensors, tmp, adapters)
        else:  # the resume state: written even where transformers would compute another model (anyseek.hf)
            write_model_files(snap.model, tmp, for_transformers=False)  # config.json, model.safetensors, generation_...
        for f in snap.tokenizer_files:
            shutil.copy2(f, tmp / f.name)
        (tmp / "run_config.json").write_text(snap.texts["run_config.json"])
        write_optimizer(*snap.optimizer, tmp)
        save_file(snap.rng, str(tmp / "rng.safetensors"))
        (tmp / "train_state.json").write_text(snap.texts["train_state.json"])
        pause_for_tests("ANYSEEK_TEST_SLOW_SAVE")  # tests kill the process here
        files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir())
                 if p.is_file()}
        (tmp / MARKER).write_text(json.dumps({"step": snap.step, "files": files}, indent=1))
    prune(out_dir, keep_last)
    return final


def run_config(folder: Path) -> dict[str, Any]:
    """The run config a training checkpoint records (run_config.json); {} for a folder without a readable one (a
    model folder from elsewhere)."""
    try:
        return json.loads((Path(folder) / "run_config.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def records(ckpt: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run_config.json, train_state.json) of a checkpoint of either form: the config that wrote it and where it
    stopped (step, tokens, data identity, `--init` identity, world size); CheckpointError naming the file that is
    missing or unreadable."""
    out = []
    for name in ("run_config.json", "train_state.json"):
        try:
            out.append(json.loads((Path(ckpt) / name).read_text()))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{ckpt}: cannot read its {name} ({e})") from e
    return out[0], out[1]


def latest_checkpoint(out_dir: Path, log=print) -> Checkpoint | None:
    """The newest complete checkpoint; incomplete or corrupt ones are reported by name and skipped."""
    for ckpt in reversed(list_checkpoints(out_dir)):
        try:
            verify(ckpt.path)
            return ckpt
        except CheckpointError as e:
            log(f"warning: skipping checkpoint {ckpt.path}: {e}")
    return None


def load_training_state(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, adapters: Adapters | None = None,
    verified: bool = False,
) -> dict[str, Any]:
    """Load weights (a LoRA run's: its adapters, checked against the base `adapters.base`), optimizer state and RNG
    states from `ckpt` into the live objects; return train_state.json. verified: the caller has checked the files.
    Raises CheckpointDamaged when its files fail verification, CheckpointError for any other failure."""
    if not verified:
        verify(ckpt)
    try:
        if adapters is not None:
            read_adapters(ckpt, model, adapters.base)
        else:
            loaded = load_pretrained(ckpt, dtype=next(model.parameters()).dtype, device="cpu")
            with torch.no_grad():
                model.load_state_dict(loaded.state_dict(), strict=True)
            del loaded
        load_optimizer(optimizer, model, ckpt)
        state = json.loads((ckpt / "train_state.json").read_text())
        rng.set_torch_state(load_file(str(ckpt / "rng.safetensors")))
        rng.set_python_state(state["python_rng"])
    except CheckpointError:
        raise
    except Exception as e:  # verified files that still do not load (shape mismatch, another model): not damage
        raise CheckpointError(f"{ckpt}: cannot be loaded into this run: {type(e).__name__}: {e}") from e
    return state


def prune(out_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` finished checkpoints. "Finished" is the marker and the file sizes: the
    sha256 of every kept checkpoint is not re-read after every save (hundreds of GB for a large sharded run); loading
    and resuming check the hashes, and fall back past a damaged checkpoint."""
    complete = []
    for c in list_checkpoints(out_dir):
        try:
            verify(c.path, hashes=False)
            complete.append(c)
        except CheckpointError:
            pass
    for c in complete[:-keep_last]:
        shutil.rmtree(c.path, ignore_errors=True)
    recover_staging(out_dir)  # debris of saves killed half-way (never a live one: ours is renamed)


def pause_for_tests(var: str) -> None:
    """Test hook: sleep here when the variable is set, so a test can kill -9 the process in the middle of a save."""
    delay = os.environ.get(var)
    if delay:
        print(f"[{var}] sleeping {delay}s mid-save", flush=True)
        time.sleep(float(delay))
