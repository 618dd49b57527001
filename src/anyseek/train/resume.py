"""What `--resume` checks before it touches anything: the run config and the data must be the checkpoint's.

A resumed run that silently trained another model (one forgotten `--model...` flag) or on other data (re-prepared
with another vocabulary) would look like a continuation and be none. So the resolved config is compared key by key
with the checkpoint's `run_config.json`, and the prepared data's fingerprint with the one the checkpoint recorded;
any difference is a `ResumeMismatch` naming the keys, unless the key is one a resumed run may change freely
(`FREE_KEYS`: length of the run, logging and checkpoint cadence, kernels, threads) or the user allows it with
`--resume-override KEY` (e.g. a new `train.lr`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Keys whose change does not make the resumed run a different run.
FREE_KEYS = frozenset({
    "train.max_steps", "train.log_every", "train.eval_every", "train.eval_tokens", "train.save_every",
    "train.keep_last", "train.max_bad_steps", "train.sample_prompt", "train.sample_tokens", "train.tensorboard",
    "train.threads", "train.tune_allocator", "train.compile", "train.attention_backend", "train.moe_backend",
    "train.device", "data.num_workers",
    # where the data comes from may change (a moved folder); what it is may not: the fingerprint check covers it
    "data.path", "data.source",
})  # fmt: skip


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
                 overrides: tuple[str, ...] = ()) -> list[str]:
    """Raise ResumeMismatch unless `ckpt` was written by this run's config on this data (modulo FREE_KEYS and
    `overrides`); return lines describing the allowed changes, for the log."""
    try:
        saved = json.loads((ckpt / "run_config.json").read_text())
        state = json.loads((ckpt / "train_state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResumeMismatch(f"{ckpt}: cannot read its run_config.json / train_state.json ({e})") from e
    allowed = set(FREE_KEYS) | set(overrides)
    unknown = [k for k in overrides if k not in flatten(run_config) and k not in flatten(saved)]
    if unknown:
        raise ResumeMismatch(f"--resume-override names unknown key(s) {', '.join(unknown)}; keys look like train.lr")
    diffs = config_differences(saved, run_config)
    blocking = {k: v for k, v in diffs.items() if k not in allowed}
    saved_data = state.get("data")
    if saved_data is not None:
        for key in sorted(set(saved_data) | set(data_identity)):
            if saved_data.get(key) != data_identity.get(key) and f"data.{key}" not in allowed:
                blocking[f"data {key}"] = (saved_data.get(key), data_identity.get(key))
    if blocking:
        lines = [f"  {k}: checkpoint {old!r}, this run {new!r}" for k, (old, new) in blocking.items()]
        raise ResumeMismatch(
            f"{ckpt} was written by a different run; nothing was loaded or changed.\n" + "\n".join(lines) +
            "\nResume with the checkpoint's settings, pass --out NEW_DIR for a new run, or allow a deliberate change "
            "with --resume-override KEY (e.g. --resume-override train.lr)."
        )
    return [f"{k}: {old!r} -> {new!r}" for k, (old, new) in diffs.items()]
