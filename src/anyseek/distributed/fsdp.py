"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over every rank, applied to a built model from outside.

Units (each gathers its weights just before its forward and frees them after, ZeRO-3 by default; a one-rank mesh
has a single root unit instead, gathered once per step):
    every decoder layer model.layers[i], every MTP module mtp[k] (and, alone, its shared_head.norm: the model
    calls that norm outside the module's forward), then the root (embedding, final norm, lm_head).

Gradients are reduce-scattered as sums, not means (`set_gradient_divide_factor(1.0)`; one rank's mesh sums without
it): each rank's loss is already divided by the whole step's target count over every rank, so the sum over ranks is
the loss of the global batch.
Routed-expert weights under expert parallelism are DTensors of their own mesh and are left to `ignored_params`.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def mixed_precision(param_dtype: str, reduce_dtype: str, autocast_dtype: torch.dtype | None,
                    world_size: int) -> MixedPrecisionPolicy:  # fmt: skip
    """bf16 (or fp32) copies of the weights for compute, fp32 (or bf16) gradient reduction; the fp32 sharded
    parameters stay the optimizer's master weights. Inputs are never cast (num_targets is fp32 and must stay so).
    One rank (`world_size` 1): the reduction sums a single gradient, so it runs in the compute dtype whatever
    `reduce_dtype` says (the gradient is the same bits either way, cast to fp32 after it; in fp32 it would cost a
    cast into an fp32 buffer and twice the bytes through the reduction and out of it)."""
    compute = autocast_dtype if param_dtype == "auto" else _DTYPES[param_dtype]
    if compute in (None, torch.float32):
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    reduce = compute if world_size == 1 else _DTYPES[reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, cast_forward_inputs=False)


def _expose_output_tensors() -> None:
    """Register the model's ModelOutput as a pytree node. FSDP2 starts a unit's backward work (and queues the
    end-of-backward callback that reduces gradients) from hooks on the tensors it finds in the unit's forward output;
    torch <= 2.11 finds them with pytree, which does not look inside an unregistered dataclass. Without this the root
    unit's gradients were never reduced into the sharded parameters, silently: a one-unit model trained nothing."""
    from torch.utils import _pytree

    from anyseek.model.transformer import ModelOutput

    if ModelOutput not in _pytree.SUPPORTED_NODES:
        _pytree.register_dataclass(ModelOutput)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    _expose_output_tensors()
    kw = dict(mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params or None)
    # One rank holds every weight anyway: per-layer units there would only add hooks and launches (and, resharding, a
    # second cast per layer in backward), so a one-rank mesh gets the root unit alone, its bf16 copy made once a step.
    if mesh.size() > 1:
        for module in model.mtp:
            fully_shard(module.shared_head.norm, reshard_after_forward=reshard_after_forward, **kw)
        for layer in [*model.model.layers, *model.mtp]:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=False, **kw)  # the root's weights are needed again at once in backward
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if mesh.size() > 1:  # (one rank: FSDP2 sums already; a factor of 1.0 costs a division pass over the
                m.set_gradient_divide_factor(1.0)  # fp32 gradients there, 1.3 ms a step on `small`)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> list[int]:
    """Recompute decoder layers (and MTP modules) in backward instead of keeping their activations (non-reentrant
    torch.utils.checkpoint; routing is deterministic, so the recompute picks the same experts). "full": every layer
    and MTP module; "selective": every other decoder layer (0, 2, 4, ...), about half the saved activations for half
    the recompute. Parameter names are unchanged: the layer's forward is wrapped, the module is not. Returns the
    indices (into layers + mtp) that recompute."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be full or selective, got {mode!r}")
    units = [*model.model.layers, *model.mtp]
    chosen = [i for i in range(len(units)) if mode == "full" or (i < len(model.model.layers) and i % 2 == 0)]
    for i in chosen:
        units[i].forward = functools.partial(checkpoint, units[i].forward, use_reentrant=False)
    return chosen
