"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over every rank, applied to a built model from outside.

Units (each gathers its weights just before its forward and frees them after, ZeRO-3 by default; a one-rank mesh
has a single root unit instead, gathered once per step):
    every decoder layer model.layers[i], every MTP module mtp[k] (and, alone, its shared_head.norm: the model
    calls that norm outside the module's forward), then the root (embedding, final norm, lm_head).

Gradients are reduce-scattered as sums, not means (`set_gradient_divide_factor(1.0)`; one rank's mesh sums without
it): each rank's loss is already divided by the whole step's target count over every rank, so the sum over ranks is
the loss of the global batch.
Routed-expert weights under expert parallelism are DTensors of their own mesh and are left to `ignored_params`.

The shards' dtype (`parallel.shard_dtype`). fp32 shards are the optimizer's master weights, and FSDP2 casts them to
bf16 for every gather. bf16 shards (`ShardMasters`; by default where the run computes in bf16 with one micro-batch
per step) are what the one-process working copy is to its master weights (train/precision.py): FSDP2 gathers and
computes them as they are, their gradients are bf16 (the one-process step's too), and the fp32 master of each
rank's shard lives beside them, updated by the optimizer kernel, which writes the bf16 shard in the same pass
(`TensorAdamW`); checkpoints save the masters under the weights' names, so they are the same files either way.

One rank (a one-GPU run under torchrun): there is nothing to gather or reduce, and FSDP2 copies anyway. Its
"reduce-scatter" copies the gradients' buffer into an output buffer of the same size; `OneRankReduce` makes the
output the input itself (torch skips a copy onto itself), and the reduction runs in the shards' dtype so that no
cast follows it. With bf16 shards what is left per step is the copy of each weight into its gathered buffer and of
each gradient into the reduce buffer (docs/distributed.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils import _pytree
from torch.utils.checkpoint import checkpoint

from anyseek.model.transformer import ModelOutput

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def compute_dtype(param_dtype: str, autocast_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype FSDP2's gathered weights compute in (`parallel.param_dtype`; auto: the run's autocast dtype)."""
    return (autocast_dtype or torch.float32) if param_dtype == "auto" else _DTYPES[param_dtype]


def pick_shard_dtype(mode: str, compute: torch.dtype, grad_accum: int, ep: int) -> torch.dtype:
    """`parallel.shard_dtype`: auto is bf16 where the run computes in bf16 with one micro-batch per step and no
    expert parallelism, else fp32 (several micro-batches add their gradients in the shards' dtype; expert-parallel
    weights are not FSDP2's)."""
    why = []
    if compute != torch.bfloat16:
        why.append("the run computes in fp32 (parallel.param_dtype / train.dtype)")
    if grad_accum > 1:
        why.append(f"train.grad_accum={grad_accum}: several micro-batches add their gradients in the shards' dtype")
    if ep > 1:
        why.append(f"parallel.ep={ep}: expert-parallel weights keep fp32")
    if mode == "fp32" or (mode == "auto" and why):
        return torch.float32
    if why:
        raise ValueError(f"parallel.shard_dtype=bf16 is not available here: {'; '.join(why)}; use fp32 or auto")
    return torch.bfloat16


def mixed_precision(param_dtype: str, reduce_dtype: str, autocast_dtype: torch.dtype | None, world_size: int,
                    shard_dtype: torch.dtype = torch.float32) -> MixedPrecisionPolicy:  # fmt: skip
    """bf16 (or fp32) copies of the weights for compute, fp32 (or bf16) gradient reduction. Inputs are never cast
    (num_targets is fp32 and must stay so). One rank (`world_size` 1): the reduction sums a single gradient, so it
    runs in the shards' dtype whatever `reduce_dtype` says (the sharded gradient is the same bits either way; in that
    dtype no cast follows the reduction, and `OneRankReduce` makes it no copy either)."""
    compute = compute_dtype(param_dtype, autocast_dtype)
    if compute == torch.float32:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    reduce = shard_dtype if world_size == 1 else _DTYPES[reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, cast_forward_inputs=False)


class OneRankReduce:
    """FSDP2's reduce-scatter on a one-rank mesh (`FSDPModule.set_custom_reduce_scatter`) without its copy. FSDP2
    allocates the reduction's input (the gradients, copied in) and then its output, both of the same size on one
    rank, and copies the one into the other (torch 2.11-2.13: `reduce_output.copy_(reduce_scatter_input)`). Here the
    second of two consecutive allocations of one size and dtype returns the first buffer, so that copy is onto
    itself, which torch skips; the sharded gradients are then views of the buffer the gradients were copied into.
    Any other pattern of allocations gets buffers of its own (then the copy runs, as without this)."""

    def __init__(self):
        self._first: torch.Tensor | None = None
        self.aliased = 0  # outputs that were their inputs (tests read it)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        first, self._first = self._first, None
        if first is not None and first.shape == torch.Size(size) and first.dtype == dtype and first.device == device:
            self.aliased += 1
            return first  # the output: the input itself
        self._first = torch.empty(size, dtype=dtype, device=device)
        return self._first

    def __call__(self, output_tensor, input_tensor, group=None, op=None, async_op: bool = False):
        # (one rank: torch copies itself and does not call this; were it called, the sum over one rank is a copy)
        if output_tensor.data_ptr() != input_tensor.data_ptr():
            output_tensor.copy_(input_tensor)
        return None


def _expose_output_tensors() -> None:
    """Register the model's ModelOutput as a pytree node. FSDP2 starts a unit's backward work (and queues the
    end-of-backward callback that reduces gradients) from hooks on the tensors it finds in the unit's forward output;
    torch <= 2.11 finds them with pytree, which does not look inside an unregistered dataclass. Without this the root
    unit's gradients were never reduced into the sharded parameters, silently: a one-unit model trained nothing."""
    if ModelOutput not in _pytree.SUPPORTED_NODES:
        _pytree.register_dataclass(ModelOutput)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
    forward_prefetch: bool = False,
) -> nn.Module:
    """FSDP2 units: each decoder layer and MTP module, then the root. forward_prefetch: each layer's forward starts the
    next one's all-gather (explicitly: FSDP2 otherwise issues it when the host reaches the next layer, and expert
    parallelism's exact dispatch holds the host at a sync in every MoE layer, so each gather would wait in the
    stream)."""
    _expose_output_tensors()
    kw = dict(mesh=mesh, mp_policy=mp_policy, ignored_params=ignored_params or None)
    # One rank holds every weight anyway: per-layer units there would only add hooks and launches (and, resharding, a
    # second cast per layer in backward), so a one-rank mesh gets the root unit alone, its bf16 copy made once a step.
    if mesh.size() > 1:
        for module in model.mtp:
            fully_shard(module.shared_head.norm, reshard_after_forward=reshard_after_forward, **kw)
        units = [*model.model.layers, *model.mtp]
        for layer in units:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
        if forward_prefetch:
            for layer, after in zip(units, units[1:]):
                layer.set_modules_to_forward_prefetch([after])
    fully_shard(model, reshard_after_forward=False, **kw)  # the root's weights are needed again at once in backward
    for m in model.modules():
        if isinstance(m, FSDPModule):
            if mesh.size() > 1:  # (one rank: FSDP2 sums already; a factor of 1.0 costs a division pass over the
                m.set_gradient_divide_factor(1.0)  # fp32 gradients there, 1.3 ms a step on `small`)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
            if mesh.size() == 1:
                m.set_custom_reduce_scatter(OneRankReduce())
    return model


class ShardMasters:
    """fp32 master weights beside FSDP2's bf16 shards (`parallel.shard_dtype=bf16`). Made from a model sharded in
    fp32: each trained weight's shard is cloned as its master (a DTensor of the same mesh and placement), then the
    model's trained weights are cast to bf16 (`module.to`'s path, which FSDP2 follows: it re-registers its shards).
    The optimizer (`TensorAdamW`) updates the masters from the bf16 gradients and writes the bf16 shards; checkpoints
    hold the masters under the weights' names (`state_dict`), and loading writes the masters, then the shards
    (`refresh`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
        self.masters = {n: p.detach().clone() for n, p in trained}  # fp32 DTensors: this rank's shard, contiguous
        ids = {id(p) for _, p in trained}
        model._apply(lambda t: t.to(dtype) if id(t) in ids else t)
        params = dict(model.named_parameters())
        self.params = {n: params[n] for n, _ in trained}
        for n, p in self.params.items():
            m = self.masters[n]
            local, master = p.to_local(), m.to_local()
            if p.dtype != dtype or local.shape != master.shape or not local.is_contiguous():
                raise RuntimeError(f"FSDP2 did not keep {n}'s shard as a contiguous {dtype} tensor of its master's "
                                   f"shape ({p.dtype} {tuple(local.shape)} against {tuple(master.shape)})")

    def by_param(self) -> dict[nn.Parameter, torch.Tensor]:
        """For the optimizer: each trained (bf16) parameter's fp32 master."""
        return {p: self.masters[n] for n, p in self.params.items()}

    def state_dict(self, model_sd: dict) -> dict:
        """`model_sd` (get_model_state_dict) with the fp32 masters in place of the bf16 weights: what is saved, and
        what a sharded checkpoint is loaded into."""
        return {k: self.masters.get(k, v) for k, v in model_sd.items()}

    @torch.no_grad()
    def load_full(self, full_sd: dict) -> None:
        """The masters from a full (unsharded) fp32 state dict: each rank its own slice, as FSDP2 shards them."""
        for n, m in self.masters.items():
            local = m.to_local()  # (a view: written in place)
            t = full_sd[n].to(device=local.device, dtype=m.dtype)
            local.copy_(distribute_tensor(t, m.device_mesh, m.placements, src_data_rank=None).to_local())
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """The bf16 shards from the masters (after a checkpoint load)."""
        for n, p in self.params.items():
            p.to_local().copy_(self.masters[n].to_local())


def apply_activation_checkpointing(model: nn.Module, mode: str = "full") -> list[int]:
    """Recompute decoder layers (and MTP modules) in backward instead of keeping their activations (non-reentrant
    torch.utils.checkpoint; routing is deterministic, so the recompute picks the same experts). "full": every layer
    and MTP module; "selective": every other decoder layer (0, 2, 4, ...), about half the saved activations for half
    the recompute. Parameter names are unchanged: the layer's forward is wrapped, the module is not. A decoder
    layer's input comes as h and the previous FFN output still to be added (`DecoderLayer.forward`'s `pending`): the
    wrapper adds them before the checkpoint, which then keeps one [T, D] tensor a layer instead of two (the 16B at
    4,096 tokens: 0.42 GiB less), for one unfused add. Returns the indices (into layers + mtp) that recompute."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be full or selective, got {mode!r}")
    n_layers = len(model.model.layers)
    units = [*model.model.layers, *model.mtp]
    chosen = [i for i in range(len(units)) if mode == "full" or (i < n_layers and i % 2 == 0)]
    for i in chosen:
        plain = functools.partial(checkpoint, units[i].forward, use_reentrant=False)
        units[i].forward = _folding(plain) if i < n_layers else plain
    return chosen


def _folding(checkpointed):
    """A checkpointed decoder layer's forward that takes h + pending as its one input (see
    `apply_activation_checkpointing`)."""

    @functools.wraps(checkpointed)
    def forward(h_TD, *args, pending=None, **kwargs):
        if pending is not None:
            h_TD = h_TD + pending
        return checkpointed(h_TD, *args, **kwargs)

    return forward
