"""A LoRA checkpoint's model part: the adapters and the base they sit on, in place of the model files.

    step-N/adapters.safetensors   the adapters (fp32, our parameter names: `...q_b_proj.lora_A`)
    step-N/lora.json              the spec (rank, alpha, dropout, targets) and the base: {"path", "sha256", "hashed"}
                                  (`anyseek.checkpoint.identity.reference`)

`anyseek export` merges them into their base (`anyseek.checkpoint.exporter`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from anyseek.checkpoint.identity import same_content
from anyseek.storage import CheckpointError
from anyseek.transforms.lora import LoRASpec, load_adapter_state

LORA_JSON = "lora.json"
ADAPTERS = "adapters.safetensors"


@dataclass(frozen=True)
class Adapters:
    """What a LoRA run's checkpoints hold in place of the model: the adapters of `spec` over the base `base`
    ({"path", "sha256"})."""

    spec: LoRASpec
    base: dict


def is_lora(folder: Path) -> bool:
    return (Path(folder) / LORA_JSON).is_file()


def write_adapters(tensors: dict[str, torch.Tensor], folder: Path, adapters: Adapters) -> None:
    """adapters.safetensors (`tensors`: `adapter_state` of the model, on the CPU) and lora.json."""
    save_file(tensors, str(folder / ADAPTERS))
    (folder / LORA_JSON).write_text(json.dumps({**adapters.spec.to_dict(), "base": adapters.base}, indent=1))


def read_lora_json(folder: Path) -> Adapters:
    f = Path(folder) / LORA_JSON
    if not f.is_file():
        raise CheckpointError(f"{folder}: no {LORA_JSON} (not a LoRA checkpoint)")
    d = json.loads(f.read_text())
    spec = LoRASpec(int(d["rank"]), float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]),
                    int(d.get("base_bits", 16)))  # (written before 4-bit bases: 16)
    return Adapters(spec, d["base"])


def read_adapters(folder: Path, model: nn.Module, base: dict | None = None) -> None:
    """Load a LoRA checkpoint's adapters into `model` (apply_lora'd with the same spec). `base` (the reference of
    the base the model was built from) must match the one the checkpoint was trained on."""
    saved = read_lora_json(folder).base
    if base is not None and not same_content(saved, base):
        if saved["path"] == base["path"]:
            raise CheckpointError(f"{folder}: its adapters were trained on the base {base['path']} as it was then "
                                  f"(sha256 {saved['sha256'][:12]}); it has changed since ({base['sha256'][:12]} "
                                  "now): damaged or replaced; restore that model, or pass the one they were trained on")
        raise CheckpointError(f"{folder}: its adapters were trained on the base {saved['path']} "
                              f"(sha256 {saved['sha256'][:12]}), not on {base['path']} (sha256 {base['sha256'][:12]})")
    try:
        load_adapter_state(model, load_file(str(Path(folder) / ADAPTERS)))
    except ValueError as e:
        raise CheckpointError(f"{folder}: {e}") from e
