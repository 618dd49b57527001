"""`anyseek train --init PATH`: start a run from a pretrained model instead of random weights.

PATH is a Hugging Face DeepSeek-V2/V3 folder (ours, the official layouts, Moonlight-style; FP8 weights are
dequantized on load) or a full-weight `step-N` checkpoint, checked against its checkpoint.json (sizes and sha256) like
everywhere else: a damaged one is an error naming the file. From the folder come:

- the model config. `[model]` overrides of the training knobs (aux_loss_alpha, bias_update_speed, mtp_loss_weight)
  apply; any other key that would change the model is an error naming it. The config's flavor is not used (the
  folder says what the model is); `--model.flavor` together with `--init` is an error (`train/cli.py`).
- the tokenizer: a `data.source` is prepared with it (into its own cache folder); a `data.path` prepared with another
  tokenizer is an error naming both.
- the weights, streamed into a model built on the meta device (`anyseek.hf.load_pretrained`): one copy in memory.

Optimizer, schedule and data order start fresh. `reference()` (path + sha256 of every byte of config.json and the
weights, `anyseek.checkpoint.identity`: a hub-cache download is checked against its blob names on the way) goes into
every checkpoint's train_state.json; LoRA checkpoints need it to find their base, and `--resume` compares it
(anyseek.train.resume).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from anyseek.checkpoint.adapters import is_lora
from anyseek.checkpoint.folder import MARKER, CheckpointDamaged, is_sharded, verify
from anyseek.checkpoint.identity import reference
from anyseek.data.prepare import default_out, ensure_prepared
from anyseek.data.tokenizer import sha256_file, tokenized_with, tokenizer_files
from anyseek.hf import load_pretrained
from anyseek.hf.config import read_config_json
from anyseek.model.config import TRAINING_KNOBS
from anyseek.storage import CheckpointError
from anyseek.train.config import ConfigError


@dataclass(frozen=True)
class InitSource:
    path: Path
    config: Any  # ModelConfig as config.json gives it
    verified: dict | None = None  # a step-N's {file: sha256}, as its checkpoint.json recorded and verify() found

    @classmethod
    def open(cls, path: str | Path) -> InitSource:
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise CheckpointError(f"--init {folder}: not a folder")
        if is_lora(folder):
            raise CheckpointError(
                f"--init {folder}: a LoRA checkpoint (adapters only); write a full model first with "
                f"`anyseek export --merge {folder} --out DIR` and start from DIR"
            )
        if is_sharded(folder):
            raise CheckpointError(f"--init {folder}: a sharded checkpoint of a multi-process run; write one model "
                                  f"folder with `anyseek export {folder} --out DIR` and start from DIR")
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"--init {folder}: no config.json (a Hugging Face model folder or a step-N folder)")
        verified = None
        if (folder / MARKER).is_file():  # a training checkpoint: its files as recorded, or nothing
            try:
                verify(folder)
            except CheckpointDamaged as e:
                raise CheckpointDamaged(f"--init {e}") from None
            files = json.loads((folder / MARKER).read_text())["files"]
            verified = {name: rec["sha256"] for name, rec in files.items() if isinstance(rec, dict) and "sha256" in rec}

        try:
            config = read_config_json(folder / "config.json")
        except ValueError as e:
            raise CheckpointError(f"--init {folder}: {e}") from e
        return cls(folder, config, verified)

    @property
    def tokenizer_file(self) -> Path | None:
        f = self.path / "tokenizer.json"
        return f if f.is_file() else None

    def reference(self, log=None) -> dict[str, str]:
        """{"path", "sha256", "hashed"} of the folder (`anyseek.checkpoint.identity`; a step-N's files are not read
        again: verified against checkpoint.json just before); `log` hears of a long hash."""
        return reference(self.path, log, self.verified)


def model_config(init: InitSource, section) -> Any:
    """The run's ModelConfig: the folder's, plus the [model] section's knob overrides. A shape override is an error."""
    cfg = init.config
    bad = sorted(k for k, v in section.overrides.items() if k not in TRAINING_KNOBS and getattr(cfg, k) != v)
    if bad:
        got = ", ".join(f"model.{k}={section.overrides[k]!r} (the folder has {getattr(cfg, k)!r})" for k in bad)
        raise ConfigError(f"--init {init.path} fixes the model's shape; remove {got}. Only "
                          f"{', '.join('model.' + k for k in TRAINING_KNOBS)} may be set with --init")
    knobs = {k: v for k, v in section.overrides.items() if k in TRAINING_KNOBS}
    return dataclasses.replace(cfg, **knobs) if knobs else cfg


def load_model(init: InitSource, cfg, device: torch.device, dtype: torch.dtype = torch.float32, quantize4=None):
    """The folder's weights in a DeepSeekV3 on `device` (built on meta, filled tensor by tensor), in train mode,
    with `cfg`'s training knobs. quantize4: which parameters to quantize to 4 bits as they are read
    (`load_pretrained`'s; a 4-bit LoRA base)."""
    model = load_pretrained(init.path, dtype=dtype, device=device, quantize4=quantize4)
    knobs = {k: getattr(cfg, k) for k in TRAINING_KNOBS}
    model.config = dataclasses.replace(model.config, **knobs)  # MTP depth as loaded (a folder may hold fewer)
    return model.train()


# ---------------------------------------------------------------- data and tokenizer


def prepare_data(data, init: InitSource) -> Path:
    """A data.source prepared with the folder's tokenizer, into a cache folder named by that tokenizer's hash."""
    if init.tokenizer_file is None:
        raise CheckpointError(f"--init {init.path}: no tokenizer.json, so data.source {data.source!r} cannot be "
                              "tokenized to match it; prepare data with its tokenizer and pass --data.path")
    plain = default_out(data.source, 0)
    out = plain.with_name(plain.name.removesuffix("-v0") + "-tok" + sha256_file(init.tokenizer_file)[:12])
    return Path(ensure_prepared(source=data.source, out=out, tokenizer=init.path))


def check_tokenizer(init: InitSource, data_dir: Path, manifest: dict, log=print) -> None:
    """Prepared data must come from the folder's tokenizer (same file, or the same vocabulary), and its ids must fit
    the model's embedding."""
    vocab = int(manifest["vocab_size"])
    if vocab > init.config.vocab_size:
        raise ConfigError(f"data {data_dir} has {vocab} token ids but the model in {init.path} embeds "
                          f"{init.config.vocab_size}: the data was tokenized with another tokenizer")
    mine = init.tokenizer_file
    if mine is None:
        log(f"warning: --init {init.path} has no tokenizer.json; cannot check that {data_dir} uses its tokenizer")
        return
    theirs = tokenizer_files(data_dir)[0]
    if tokenized_with(mine, data_dir, manifest):
        return
    described = manifest.get("tokenizer", {}).get("path") or manifest.get("tokenizer", {}).get("kind", "its own")
    raise ConfigError(
        f"data {data_dir} was prepared with another tokenizer ({theirs}, from {described}) than the model's "
        f"({mine}); prepare it again with `anyseek prepare --tokenizer {init.path} ...`, or use --data.source to "
        "have it prepared automatically"
    )

