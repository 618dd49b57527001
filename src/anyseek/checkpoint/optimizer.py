"""The optimizer's state in a checkpoint folder: safetensors (tensors keyed by parameter name) plus JSON
(hyper-parameters), so a resumed run never unpickles anything."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, folder: Path) -> None:
    """optimizer.safetensors: `{param_name}/{state_key}` -> tensor; optimizer.json: param groups by name."""
    write_optimizer(*optimizer_state(optimizer, model), folder)


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                    copy: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> tuple[dict, list]:
    """(tensors, param groups) as `write_optimizer` writes them, each tensor a CPU copy of its own (states may be
    views of one buffer or one shared tensor: precision.FlatAdamW), made by `copy(name, tensor)` when given (the
    host buffers of a save in the background)."""
    copy = copy or (lambda name, t: t.detach().to("cpu", copy=True).contiguous())
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{names[id(p)]}/{key}"] = copy(f"optim/{names[id(p)]}/{key}", t)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    return tensors, groups


def write_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict], folder: Path) -> None:
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "optimizer.json").write_text(json.dumps({"param_groups": groups}, indent=1))


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    meta = json.loads((folder / "optimizer.json").read_text())
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{folder / 'optimizer.json'}: {len(saved_groups)} param groups, expected "
                         f"{len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        if [names[id(p)] for p in group["params"]] != saved["params"]:
            raise ValueError(f"{folder / 'optimizer.json'}: parameter list differs from the model's")
        group.update({k: v for k, v in saved.items() if k != "params"})
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    tensors = load_file(str(folder / "optimizer.safetensors"))
    # AdamW keeps its scalar `step` on the CPU unless fused/capturable; every other state lives with its parameter.
    step_on_param = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    own = {p: dict(st) for p, st in optimizer.state.items()}
    optimizer.state.clear()
    for key, value in tensors.items():
        name, state_key = key.rsplit("/", 1)
        if name not in params:
            raise ValueError(f"{folder / 'optimizer.safetensors'}: state for unknown parameter {name!r}")
        p = params[name]
        target = own.get(p, {}).get(state_key)
        if torch.is_tensor(target) and target.shape == value.shape:  # the optimizer's own tensor (FlatAdamW: a view
            optimizer.state[p][state_key] = target.copy_(value)  # of its flat moments), filled in place
            continue
        on_param = state_key != "step" or value.dim() > 0 or step_on_param
        if state_key != "step" and value.is_floating_point():  # bf16 moments (train.moments_dtype) into fp32 ones
            value = value.to(p.dtype)
        optimizer.state[p][state_key] = value.to(p.device if on_param else "cpu")
