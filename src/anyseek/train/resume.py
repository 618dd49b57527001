"""What `--resume` checks before it touches anything: the run config and the data must be the checkpoint's.

A resumed run that silently trained another model (one forgotten `--model...` flag) or on other data (re-prepared
with another vocabulary) would look like a continuation and be none. So the resolved config is compared key by key
with the checkpoint's `run_config.json`, and the prepared data's fingerprint with the one the checkpoint recorded;
any difference is a `ResumeMismatch` naming the keys, unless the key is one a resumed run may change freely
(`FREE_KEYS`: length of the run, logging and checkpoint cadence, kernels, threads, how the model is laid out over
the ranks) or the user allows it with `--resume-override KEY` (e.g. a new `train.lr`).

Distributed runs: sharded checkpoints reshard on load, so the layout keys (`parallel.ep`, the backend, FSDP's
resharding, activation checkpointing, the timeout) may change freely, and so may the number of ranks (recorded in
train_state.json as `world_size`, 1 for one-process checkpoints; `parallel.world_size` below). What may not change
silently is the maths: `parallel.param_dtype` / `parallel.reduce_dtype` (like `train.dtype`) and the global batch,
ranks x `train.grad_accum` micro-batches per step. A new number of ranks with `train.grad_accum` scaled to keep that
product (2 ranks x 1 -> 1 process x 2) is the same run; any other change of it needs
`--resume-override parallel.world_size` (or `train.grad_accum`).

A run started from a pretrained model (`train.init`) records that folder's identity (path and content hash,
`anyseek.train.init`); the resumed run's must be the same. `train.init` and every `train.lora_*` key are therefore not
free: another base, rank, alpha, dropout, target set or base dtype makes another run (`--resume-override
train.init` allows a moved or deliberately different base; a LoRA checkpoint still refuses a base whose content hash
differs from the one its adapters were trained on).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from anyseek import checkpoint
from anyseek.checkpoint.identity import same_content
from anyseek.storage import CheckpointError
from anyseek.train.config import DataConfig, ParallelConfig, TrainConfig

# Keys whose change does not make the resumed run a different run.
FREE_KEYS = frozenset({
    "train.max_steps", "train.log_every", "train.eval_every", "train.eval_tokens", "train.save_every",
    "train.keep_last", "train.max_bad_steps", "train.sample_prompt", "train.sample_tokens", "train.tensorboard",
    "train.profile",
    "train.threads", "train.tune_allocator", "train.compile", "train.attention_backend", "train.moe_backend",
    "train.device", "data.num_workers",
    # the same steps, numbers and checkpoints either way (tests/test_train_overlap.py, tests/test_async_save.py)
    "train.overlap_steps", "train.async_save",
    # where the data comes from may change (a moved folder); what it is may not: the fingerprint check covers it
    "data.path", "data.source",
    # the layout over the ranks: sharded checkpoints reshard, the maths is the same (docs/distributed.md)
    "parallel.ep", "parallel.backend", "parallel.reshard_after_forward", "parallel.activation_checkpointing",
    "parallel.timeout_s",
    # how expert parallelism's rows travel: the same numbers either way (tests/test_distributed.py)
    "parallel.ep_dispatch", "parallel.ep_capacity_factor", "parallel.ep_overlap", "parallel.ep_capacity_growth", "parallel.ep_settle_steps",
})  # fmt: skip

WORLD_SIZE = "parallel.world_size"  # the number of ranks: not a config key, compared through the global batch


class ResumeMismatch(ValueError):
    """The run config or data differs from the checkpoint's; the message names every differing key."""


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; the model section's overrides become model.KEY."""
    return {f"{section}.{key}": value for section, body in config.items() for key, value in body.items()}


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (checkpoint's value, this run's value)} for every key that differs (absent shows as '<unset>')."""
    a, b = flatten(saved), flatten(now)
    return {k: (a.get(k, "<unset>"), b.get(k, "<unset>")) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_resume(ckpt: Path, run_config: dict[str, Any], data_identity: dict[str, Any],
                 overrides: tuple[str, ...] = (), world_size: int = 1,
                 init_identity: dict[str, Any] | None = None) -> list[str]:
    """Raise ResumeMismatch unless `ckpt` was written by this run's config on this data (modulo FREE_KEYS and
    `overrides`) with the same global batch (`world_size`: this run's number of ranks), starting from the same
    pretrained model (`init_identity`: {"path", "sha256"} of --init, None without); return lines describing the
    allowed changes, for the log."""
    try:
        saved, state = checkpoint.records(ckpt)
    except CheckpointError as e:
        raise ResumeMismatch(str(e)) from e
    # keys added since the checkpoint was written ([parallel], train.init, train.lora_*, ...) count as their defaults
    # (for [parallel]: one process)
    for section, cls in (("data", DataConfig), ("train", TrainConfig), ("parallel", ParallelConfig)):
        saved[section] = {**dataclasses.asdict(cls()), **(saved.get(section) or {})}
    allowed = set(FREE_KEYS) | set(overrides)
    unknown = [k for k in overrides if k not in flatten(run_config) and k not in flatten(saved) and k != WORLD_SIZE]
    if unknown:
        raise ResumeMismatch(f"--resume-override names unknown key(s) {', '.join(unknown)}; keys look like train.lr")
    diffs = config_differences(saved, run_config)
    saved_world = int(state.get("world_size", 1))
    if saved_world != world_size:  # the global batch (ranks x micro-batches) decides whether that is a new run
        accum = "train.grad_accum"
        then = saved_world * flatten(saved).get(accum, 1)
        now = world_size * flatten(run_config).get(accum, 1)
        diffs[WORLD_SIZE] = (saved_world, world_size)
        if then == now or allowed & {WORLD_SIZE, accum}:
            allowed |= {WORLD_SIZE, accum}
        else:
            diffs.pop(accum, None)
            diffs[f"{WORLD_SIZE} x {accum} (micro-batches per step)"] = (then, now)
            allowed.add(WORLD_SIZE)
    blocking = {k: v for k, v in diffs.items() if k not in allowed}
    saved_data = state.get("data")
    if saved_data is not None:
        for key in sorted(set(saved_data) | set(data_identity)):
            if saved_data.get(key) != data_identity.get(key) and f"data.{key}" not in allowed:
                blocking[f"data {key}"] = (saved_data.get(key), data_identity.get(key))
    saved_init, now_init = state.get("init"), init_identity
    if not same_content(saved_init, now_init) and "train.init" not in allowed:  # (older checkpoints: sampled hashes)
        blocking["init content (sha256)"] = ((saved_init or {}).get("sha256"), (now_init or {}).get("sha256"))
    if blocking:
        lines = [f"  {k}: checkpoint {old!r}, this run {new!r}" for k, (old, new) in blocking.items()]
        raise ResumeMismatch(
            f"{ckpt} was written by a different run; nothing was loaded or changed.\n" + "\n".join(lines) +
            "\nResume with the checkpoint's settings, pass --out NEW_DIR for a new run, or allow a deliberate change "
            "with --resume-override KEY (e.g. --resume-override train.lr)." + (
                f"\nAnother number of ranks: scale train.grad_accum to keep ranks x grad_accum, or allow a new global "
                f"batch with --resume-override {WORLD_SIZE}." if any(k.startswith(WORLD_SIZE) for k in blocking) else "")
        )
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in diffs.items()]
