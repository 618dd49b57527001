"""The random streams a checkpoint keeps, so a resumed run draws what the uninterrupted run would have drawn.

One-process checkpoints hold torch's CPU and GPU generators as tensors (rng.safetensors) and Python's `random` in
train_state.json; sharded ones hold every rank's streams as JSON in train_state.json (`rank_state`).
"""

from __future__ import annotations

import random
from typing import Any

import torch


def torch_state() -> dict[str, torch.Tensor]:
    """torch's CPU generator and every visible GPU's, as uint8 tensors (for safetensors)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda.{i}"] = s
    return states


def set_torch_state(states: dict[str, torch.Tensor]) -> None:
    """Restore `torch_state()`; the GPU generators only when this machine has as many GPUs as the saved one."""
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available():
        cuda = [states[k] for k in sorted(k for k in states if k.startswith("cuda."))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def python_state() -> list:
    """Python's `random` state as JSON-ready lists."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_state(value: list) -> None:
    version, internal, gauss = value
    random.setstate((version, tuple(internal), gauss))


def rank_state() -> dict[str, Any]:
    """This process's random streams as JSON: torch CPU, this rank's GPU, Python's `random`."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state().tolist(), "python": python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rank_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["cpu"], dtype=torch.uint8))
    set_python_state(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
