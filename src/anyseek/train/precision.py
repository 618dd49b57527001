"""Mixed precision with a low-precision working copy of the weights (`train.working_copy`).

The model's parameters stay fp32: they are the master weights that the optimizer updates, that checkpoints save and
that evaluation reads. For each micro-batch's forward and backward the parameters' storage is swapped for a bf16
copy (`WorkingCopy.active`), so every matmul, norm and residual add runs in bf16 without autocast:

- autocast casts each weight at every use (and the activations between fp32 and bf16 around every op it lowers),
  and casts each weight gradient back to fp32: at 32k tokens per step on the `small` flavor ~12 ms of a 131 ms
  step went to such casts and fp32 adds (docs/benchmarks.md);
- here the activations stay bf16 throughout, as in Megatron's and torchtitan's bf16 training and in transformers
  with bf16 parameters, and the weights are cast once per step, by the optimizer kernel itself.

Flat buffers. The trained parameters live in one flat fp32 buffer (each parameter a view of it), their working copy
in one flat bf16 buffer, their gradients in one flat buffer (bf16 with one micro-batch per step; fp32 where several
add up), and `FlatAdamW`'s moments in two more. After each micro-batch's backward `collect` copies (or adds) the
gradients into the flat buffer; the step is then one kernel per parameter group (`kernels.adamw_flat`: gradient,
weights and moments in, weights, moments and the working copy out), and the gradient norm one reduction
(`kernels.sq_norm`).

Frozen parameters in another dtype (LoRA: the fp32 embedding and norms beside the bf16 base) get a working copy
too, and no gradient.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from anyseek import kernels
from anyseek.model.concat import adjacent_weights


def compute_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The low precision a run computes in (train.dtype: auto = bf16 on CUDA), or None for fp32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bf16": torch.bfloat16, "fp32": None}[name]


def wanted(mode: str, device: torch.device, distributed: bool, low: torch.dtype | None) -> bool:
    """Whether train.working_copy=`mode` gives this run a working copy (why not: `unavailable`)."""
    return mode != "false" and unavailable(device, distributed, low, asked=mode == "true") is None


def unavailable(device: torch.device, distributed: bool, low: torch.dtype | None, asked: bool = False) -> str | None:
    """Why a working copy is not used here (None: it is). asked: train.working_copy=true (the CPU then has one too)."""
    if low is None:
        return "the run computes in fp32 (train.dtype)"
    if distributed:
        return "under torchrun FSDP2 holds the weights (parallel.shard_dtype, parallel.param_dtype)"
    if device.type != "cuda" and not asked:
        return f"off by default on {device.type} (train.working_copy=true turns it on)"
    return None


def _joined_order(params: list[torch.Tensor], groups: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """`params` with each group (all of whose members are in `params`, with the same dims) moved together, in the
    group's order, to where its first member stood."""
    where = {id(p) for p in params}
    follow, later = {}, set()
    for g in groups:
        if len(g) > 1 and all(id(w) in where for w in g) and len({w.dim() for w in g}) == 1:
            follow[id(g[0])] = g
            later.update(id(w) for w in g[1:])
    out = []
    for p in params:
        if id(p) in follow:
            out += follow[id(p)]
        elif id(p) not in later:
            out.append(p)
    return out


def _flat_views(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    views, at = [], 0
    for t in tensors:
        views.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return views


class WorkingCopy:
    """The swap between a model's fp32 parameters and their low-precision working copies, and the flat buffers."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, accumulate: bool):
        """accumulate: several micro-batches per step (their gradients add up in fp32), else one (copied in bf16)."""
        self.dtype, self.accumulate = dtype, accumulate
        params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
        # trained ones first, matrices (weight decay) before vectors: each optimizer group is one flat range;
        # weights the model joins (model/concat.py) row after row, so that it can use them without a copy
        trained = _joined_order(sorted((p for p in params if p.requires_grad), key=lambda p: p.dim() < 2),
                                adjacent_weights(model))
        self.trained = trained
        self.frozen = [p for p in params if not p.requires_grad]
        n = sum(p.numel() for p in trained)
        device = trained[0].device if trained else torch.device("cpu")
        self.flat = torch.empty(n, dtype=torch.float32, device=device)  # the master weights
        self.flat_low = torch.empty(n, dtype=dtype, device=device)
        self.flat_grad = torch.zeros(n, dtype=torch.float32 if accumulate else dtype, device=device)
        ends = itertools.accumulate(p.numel() for p in trained)
        self.offsets = {p: (end - p.numel(), end) for p, end in zip(trained, ends)}
        masters = _flat_views(self.flat, trained)
        for p, view in zip(trained, masters):
            view.copy_(p.detach())
            p.data = view  # the parameter now lives in the flat buffer
        # frozen ones (LoRA's base: embedding, norms, router) are only ever read: converted once and held in the low
        # precision alone (no fp32 copy beside it, nothing to swap)
        for p in self.frozen:
            p.data = p.data.to(dtype)
        self.masters = masters
        self.low = _flat_views(self.flat_low, trained)
        self.grads = _flat_views(self.flat_grad, trained)
        if not accumulate:  # a backend that writes a weight gradient itself may write it here (the routed experts)
            for p in trained:
                kernels.set_grad_destination(p, self.flat_grad, self.offsets[p][0])
        self._active = False
        self.refresh()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the model (forward and backward) on the working copy; the parameters are fp32 again afterwards."""
        if self._active:
            raise RuntimeError("WorkingCopy.active() entered twice")
        for p, low in zip(self.trained, self.low):
            p.data = low
        self._active = True
        try:
            yield
        finally:
            for p, master in zip(self.trained, self.masters):
                p.data = master
            self._active = False

    def collect(self) -> None:
        """After a micro-batch's backward, inside `active()`: its gradients into the flat buffer; `.grad` cleared."""
        pairs = [(acc, p.grad) for acc, p in zip(self.grads, self.trained)]
        # a gradient a kernel wrote into its destination (kernels.set_grad_destination) is in place already
        have = [(acc, g) for acc, g in pairs if g is not None and not (g.data_ptr() == acc.data_ptr()
                                                                       and g.dtype == acc.dtype)]
        if have:
            accs, gs = (list(t) for t in zip(*have))
            if self.accumulate:
                torch._foreach_add_(accs, gs)
            else:
                torch._foreach_copy_(accs, gs)
        if not self.accumulate:
            for acc, g in pairs:
                if g is None:  # a weight this micro-batch did not use: no stale gradient from the last step
                    acc.zero_()
        for p in self.trained:
            p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the step's gradients (fp32 0-dim tensor on the device; no sync)."""
        return kernels.sq_norm(self.flat_grad).sqrt()

    def before_step(self) -> None:
        """Before a step's first micro-batch: gradients that add up start from zero. (Here, not after the optimizer
        step: with the trainer's overlap the host settles a step after it has queued the next one's micro-batches.)"""
        if self.accumulate:
            self.flat_grad.zero_()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the master weights into the working copy (at the start and after a checkpoint load; the optimizer
        step writes it itself)."""
        if self._active:
            raise RuntimeError("WorkingCopy.refresh() while the working copy is active")
        self.flat_low.copy_(self.flat)

    def nbytes(self) -> int:
        """Memory the working copy adds: the low-precision weights (the flat gradients replace `.grad`)."""
        return sum(t.numel() * t.element_size() for t in self.low)


class FlatAdamW(torch.optim.Optimizer):
    """AdamW over a WorkingCopy's flat buffers: one `kernels.adamw_flat` per parameter group reads the gradients and
    writes the fp32 weights, both moments (fp32, or bf16 with stochastic rounding: `moments_dtype`) and the working
    copy. Its state looks like torch.optim.AdamW's (`step`,
    `exp_avg`, `exp_avg_sq` per parameter: views of the flat moments), so `train.optim` saves and loads it the
    same way (loading copies into these tensors).

    `grad_scale` (a device scalar, default none): every gradient is divided by it (the folded clip factor).
    `skip` (a device scalar, default none): nonzero makes a step leave every buffer as it is, decided on the device
    (the trainer's overlap: a non-finite step skipped without a host sync). Such a step still counts in `step`
    until `uncount` takes it back, once the host knows."""

    def __init__(self, groups: list[dict], working: WorkingCopy, lr: float, betas: tuple[float, float], eps: float,
                 moments_dtype: torch.dtype = torch.float32):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.working = working
        self.m = torch.zeros_like(working.flat, dtype=moments_dtype)
        self.v = torch.zeros_like(working.flat, dtype=moments_dtype)
        self.grad_scale: torch.Tensor | None = None
        self.skip: torch.Tensor | None = None
        self._one = torch.ones((), dtype=torch.float32, device=working.flat.device)
        self._ranges = []
        for group in self.param_groups:
            spans = [working.offsets[p] for p in group["params"]]
            if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
                raise ValueError("FlatAdamW: a parameter group must be one contiguous range of the flat buffer")
            self._ranges.append((spans[0][0], spans[-1][1]) if spans else (0, 0))
        # torch.optim.AdamW's state layout, as views of the flat buffers: train.optim saves these, and its loader
        # copies a checkpoint into them in place; one CPU step counter shared by all (saved per parameter)
        self._step_t = torch.zeros(())
        for p, (a, b) in working.offsets.items():
            self.state[p] = {"step": self._step_t, "exp_avg": self.m[a:b].view(p.shape),
                             "exp_avg_sq": self.v[a:b].view(p.shape)}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FlatAdamW.step takes no closure")
        self._step_t += 1
        step = int(self._step_t)
        w = self.working
        scale = self.grad_scale if self.grad_scale is not None else self._one
        for group, (a, b) in zip(self.param_groups, self._ranges):
            if a == b:
                continue
            beta1, beta2 = group["betas"]
            # bf16 moments' rounding: a seed per step and range (a resumed run rounds as the uninterrupted one)
            seed = (step * 0x9E3779B1 + a) & 0x7FFFFFFF
            kernels.adamw_flat(w.flat[a:b], w.flat_grad[a:b], self.m[a:b], self.v[a:b], w.flat_low[a:b], scale,
                               step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], skip=self.skip,
                               seed=seed)

    def uncount(self) -> None:
        """Take back the step count of a step the device skipped (`skip`)."""
        self._step_t -= 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients live in the working copy's flat buffer (`collect` overwrites or `before_step` zeroes them)."""


def build_flat_adamw(working: WorkingCopy, cfg) -> FlatAdamW:
    """AdamW with train.optim.build_optimizer's groups (weight decay on matrices) over the working copy's buffers."""
    decay = [p for p in working.trained if p.dim() >= 2]
    no_decay = [p for p in working.trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    moments = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.moments_dtype]
    return FlatAdamW(groups, working, cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps, moments)


