"""Sharded training checkpoints (torch.distributed.checkpoint), written by every rank at once, read back by any
number of ranks (one process without torchrun included), and exported to a Hugging Face folder.

    step-N/
      dcp/shard-*.safetensors      model + optimizer state: each rank writes its own shards (DCP's Hugging Face
                                   storage: safetensors whose headers carry the sharding; nothing is pickled;
                                   streamed to disk by `dcp_writer.StreamingWriter`)
      config.json                  the model config (Hugging Face form), for `export_sharded` (`anyseek export`)
      tokenizer files, run_config.json
      train_state.json             step, tokens, data fingerprint, every rank's loader position and random
                                   streams (torch CPU/GPU, Python), world size
      checkpoint.json              written last by rank 0: every file with its size and sha256 (the ranks share the
                                   hashing), as for one-process checkpoints; `verify_agreed` checks it on resume

Atomic as one-process checkpoints: all ranks write into rank 0's staging folder (`anyseek.storage.atomic_folder`),
which rank 0 renames into place only after every rank has finished; a crash leaves the previous checkpoint intact.
Loading reshards: DCP reads each rank's slices from whatever shards the writers held. A checkpoint written by one
process (a Hugging Face folder) loads on N ranks through the full state dict.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from anyseek.checkpoint import rng
from anyseek.checkpoint.dcp_writer import StreamingWriter
from anyseek.checkpoint.folder import DCP_DIR, MARKER, CheckpointDamaged, file_sha256, pause_for_tests, prune, verify
from anyseek.checkpoint.host import HostBuffers
from anyseek.checkpoint.optimizer import load_optimizer
from anyseek.distributed.env import DistEnv, agree, all_gather_json, broadcast_json
from anyseek.hf import load_pretrained, read_config_json, write_config_json
from anyseek.model.transformer import DeepSeekV3
from anyseek.storage import CheckpointError, atomic_folder, fsync_tree, os_error


def save_sharded(
    out_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    run_config: dict[str, Any],
    tokenizer_files: list[Path],
    keep_last: int,
    env: DistEnv,
    masters=None,
) -> Path:
    """Collective: every rank calls it. `train_state["loader"]` is this rank's loader state; all are kept.
    masters (`ShardMasters`, with bf16 shards): their fp32 weights are saved under the weights' names.
    A failure on any rank (full disk, read-only folder) raises on every rank, an OSError with the failing rank's
    errno (the trainer's periodic-save logic then takes the same decision everywhere); the staging folder is gone."""
    snap = snapshot_sharded(step, model, optimizer, train_state, run_config, tokenizer_files, env, masters)
    return write_sharded(out_dir, snap, keep_last, env)


@dataclass
class ShardedSnapshot:
    """What a sharded step-N folder holds of this rank, taken at one step (`write_sharded` writes it): its shards
    of the model and the optimizer (DTensors, over host buffers when taken for a save in the background), and on
    rank 0 the records of every rank."""

    step: int
    state: dict[str, Any]  # {"model": ..., "optim": ...}, as torch.distributed.checkpoint saves it
    config: Any  # the model's ModelConfig (config.json)
    texts: dict[str, str]  # run_config.json, train_state.json (rank 0's; the others' hold none)
    tokenizer_files: list[Path]


def state_tree(model: nn.Module, optimizer: torch.optim.Optimizer, masters=None) -> dict[str, Any]:
    """The tensors of a sharded checkpoint, as torch.distributed.checkpoint writes them: this rank's shards of the
    weights (their fp32 masters where FSDP2 holds bf16 shards) and of the optimizer's state."""
    model_sd = get_model_state_dict(model)
    return {"model": masters.state_dict(model_sd) if masters is not None else model_sd,
            "optim": get_optimizer_state_dict(model, optimizer)["state"]}


def snapshot_sharded(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
                     run_config: dict[str, Any], tokenizer_files: list[Path], env: DistEnv, masters=None,
                     host: HostBuffers | None = None) -> ShardedSnapshot:
    """Collective (every rank's loader state and random streams go to rank 0). host: this rank's shards copied into
    it (the caller synchronizes it), else the live ones (written at once)."""
    loaders = all_gather_json(train_state["loader"], env)
    rngs = all_gather_json(rng.rank_state(), env)
    state = state_tree(model, optimizer, masters)
    if host is not None:
        state = host.copy_tree(state)
    texts = {}
    if env.is_main:
        saved = {**train_state, "loader": loaders, "rng": rngs, "world_size": env.world_size, "step": step,
                 "saved_at": time.time()}
        texts = {"run_config.json": json.dumps(run_config, indent=2), "train_state.json": json.dumps(saved, indent=1)}
    return ShardedSnapshot(step, state, model.config, texts, list(tokenizer_files))


def write_sharded(out_dir: Path, snap: ShardedSnapshot, keep_last: int, env: DistEnv) -> Path:
    """Collective over `env` (its group: the default one, or a side group from a thread of its own): every rank
    writes its shards into rank 0's staging folder, the ranks share the hashing, rank 0 writes the records and
    checkpoint.json and renames the folder into place once all are done, then prunes. A failure on any rank raises
    on every rank (see `save_sharded`)."""
    final = Path(out_dir) / f"step-{snap.step}"
    with contextlib.ExitStack() as staging:  # rank 0's atomic_folder: left with an exception, it removes the staging
        error = None
        if env.is_main:
            try:
                tmp = staging.enter_context(atomic_folder(final))
                (tmp / DCP_DIR).mkdir()
            except OSError as e:
                error = e
        agree(error, env)
        tmp = Path(broadcast_json(str(tmp) if env.is_main else None, env))
        writer = StreamingWriter(str(tmp / DCP_DIR), save_distributed=True)  # (DCP's files, written GIL-free)
        agree(_run(lambda: dcp.save(snap.state, storage_writer=writer, process_group=env.group)), env)
        # every rank's shards are on disk (fsynced by DCP's writer); the ranks share the hashing
        shards = broadcast_json(sorted(str(p.relative_to(tmp)) for p in (tmp / DCP_DIR).rglob("*") if p.is_file())
                                if env.is_main else None, env)
        mine: dict[str, Any] = {}
        error = _run(lambda: mine.update({name: {"size": (tmp / name).stat().st_size,
                                                 "sha256": file_sha256(tmp / name)}
                                          for name in shards[env.rank::env.world_size]}))
        agree(error, env)
        hashed = all_gather_json(mine, env)
        error = None
        if env.is_main:
            try:
                _write_records(tmp, snap, hashed)
            except OSError as e:
                error = e
        agree(error, env)
        if env.is_main:
            try:
                staging.close()  # fsync, rename into place
            except OSError as e:
                error = e
    agree(error, env)  # the rename is done (or failed everywhere) before anyone looks for the checkpoint
    if env.is_main:
        prune(Path(out_dir), keep_last)
    return final


def _write_records(tmp: Path, snap: ShardedSnapshot, hashed: list[dict]) -> None:
    """Rank 0, once every rank's shards are written and hashed (`hashed`): config.json, the tokenizer, the records,
    then checkpoint.json."""
    fsync_tree(tmp / DCP_DIR)
    write_config_json(snap.config, tmp / "config.json")
    for f in snap.tokenizer_files:
        shutil.copy2(f, tmp / f.name)
    for name, text in snap.texts.items():
        (tmp / name).write_text(text)
    pause_for_tests("ANYSEEK_TEST_SLOW_SAVE")  # tests kill the process here
    files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir())
             if p.is_file()}
    for part in hashed:
        files.update(part)
    (tmp / MARKER).write_text(json.dumps({"step": snap.step, "files": dict(sorted(files.items()))}, indent=1))


def _run(fn) -> BaseException | None:
    """fn() -> None, or the OSError it raised (one inside DCP's CheckpointException included, which DCP raises on
    every rank when any rank fails; safetensors' error for a failed write counts as one: `os_error`); other
    exceptions propagate."""
    try:
        fn()
    except OSError as e:
        return e
    except CheckpointException as e:
        for exc, _trace in e.failures.values():
            if (failed := os_error(exc)) is not None:
                return failed
        raise
    return None


def verify_agreed(ckpt: Path, env: DistEnv) -> None:
    """`anyseek.checkpoint.folder.verify` shared out: each rank hashes every world_size-th file, and all raise the same
    CheckpointDamaged when any file is damaged (the ranks must fall back to the same previous checkpoint)."""
    try:
        verify(ckpt, part=(env.rank, env.world_size))
        message = None
    except CheckpointDamaged as e:
        message = str(e)
    found = [m for m in all_gather_json(message, env) if m is not None]
    if found:
        raise CheckpointDamaged(found[0])


def load_sharded(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, env: DistEnv,
                 masters=None) -> dict:  # fmt: skip
    """Load model (and optimizer) state into the live, possibly sharded, objects from a checkpoint of any world
    size; returns train_state.json with `loader` set to this rank's state (or None when the world size changed).
    masters (`ShardMasters`): the saved weights go into the fp32 masters, then into the bf16 shards.
    The caller has verified the files (`verify_agreed`)."""
    ckpt = Path(ckpt)
    try:
        model_sd = get_model_state_dict(model)
        if masters is not None:
            model_sd = masters.state_dict(model_sd)
        state: dict[str, Any] = {"model": model_sd}
        if optimizer is not None:
            optim_sd = get_optimizer_state_dict(model, optimizer)  # creates the AdamW state to load into
            state["optim"] = optim_sd["state"]
        with warnings.catch_warnings():  # one process without a process group is a supported reader
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=HuggingFaceStorageReader(str(ckpt / DCP_DIR)))
        if masters is None:
            set_model_state_dict(model, state["model"])
        else:
            masters.refresh()
            rest = {k: v for k, v in state["model"].items() if k not in masters.masters}  # buffers
            set_model_state_dict(model, rest, options=StateDictOptions(strict=False))
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, {"state": state["optim"],
                                                        "param_groups": optim_sd["param_groups"]})
        train_state = json.loads((ckpt / "train_state.json").read_text())
    except Exception as e:
        raise CheckpointError(f"{ckpt}: cannot be loaded: {type(e).__name__}: {e}") from e
    loaders = train_state["loader"]
    train_state["loader"] = loaders[env.rank] if len(loaders) == env.world_size else None
    train_state["saved_loaders"] = loaders
    rngs = train_state.get("rng") or []
    if len(rngs) == env.world_size:  # same world size: every rank continues its own random streams
        rng.set_rank_state(rngs[env.rank])
    return train_state


def load_full(ckpt: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, masters=None) -> dict:
    """A one-process checkpoint (a Hugging Face folder plus optimizer.safetensors) into a sharded model: every rank
    reads the full tensors on the CPU and keeps its shards (with bf16 shards: the fp32 weights into their masters).
    The caller has verified the files (`verify_agreed`)."""
    ckpt = Path(ckpt)
    try:
        full = load_pretrained(ckpt, device="cpu")
        plain_optim = torch.optim.AdamW(_saved_groups(ckpt, full, model, optimizer))
        load_optimizer(plain_optim, full, ckpt)
        names = {id(p): n for n, p in full.named_parameters()}
        optim_sd = {"state": {names[id(p)]: s for p, s in plain_optim.state.items()},
                    "param_groups": get_optimizer_state_dict(model, optimizer)["param_groups"]}
        opts = StateDictOptions(full_state_dict=True)
        full_sd = full.state_dict()
        set_model_state_dict(model, full_sd, options=opts)
        if masters is not None:
            masters.load_full(full_sd)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
        train_state = json.loads((ckpt / "train_state.json").read_text())
        del full, plain_optim
    except Exception as e:
        raise CheckpointError(f"{ckpt}: cannot be loaded: {type(e).__name__}: {e}") from e
    loader = train_state["loader"]
    train_state["saved_loaders"] = [loader]
    train_state["loader"] = loader if env.world_size == 1 else None
    return train_state


def _saved_groups(ckpt: Path, full: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The parameter groups of the checkpoint's optimizer.json, in its order (the working copy's optimizer orders
    its parameters as its flat buffer does, not as the model lists them), with the same-named parameters of the
    unsharded `full` model; they must hold the live optimizer's parameters, group by group."""
    names = {id(p): n for n, p in model.named_parameters()}
    saved = [g["params"] for g in json.loads((ckpt / "optimizer.json").read_text())["param_groups"]]
    live = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if [sorted(g) for g in saved] != [sorted(g) for g in live]:
        raise ValueError(f"{ckpt / 'optimizer.json'}: its parameter groups hold other parameters than this run's "
                         f"optimizer ({[len(g) for g in saved]} against {[len(g) for g in live]} parameters)")
    params = dict(full.named_parameters())
    return [{"params": [params[n] for n in g]} for g in saved]


def load_consolidated(ckpt: Path) -> nn.Module:
    """The whole model of a sharded checkpoint, in one process on the CPU (fp32 master weights, every expert), in
    eval mode; `anyseek.checkpoint.exporter.export_sharded` writes it as a Hugging Face folder."""
    ckpt = Path(ckpt)
    verify(ckpt)
    try:
        config = read_config_json(ckpt / "config.json")
        model = DeepSeekV3(config, device="meta").to_empty(device="cpu")
        sd = model.state_dict()
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": yes
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": sd}, storage_reader=HuggingFaceStorageReader(str(ckpt / DCP_DIR)))
        model.load_state_dict(sd)
    except Exception as e:
        raise CheckpointError(f"{ckpt}: cannot be loaded: {type(e).__name__}: {e}") from e
    return model.eval()
