"""Mixed precision with a low-precision working copy of the weights (`train.working_copy`).

The model's parameters stay fp32: they are the master weights that the optimizer updates, that checkpoints save and
that evaluation reads. For each micro-batch's forward and backward the parameters' storage is swapped for a bf16
copy (`WorkingCopy.active`), so every matmul, norm and residual add runs in bf16 without autocast:

- autocast casts each weight at every use (and the activations between fp32 and bf16 around every op it lowers),
  and casts each weight gradient back to fp32: at 32k tokens per step on the `small` flavor ~20 ms of a 131 ms
  step went to such casts and fp32 adds (docs/benchmarks.md);
- here the weights are cast once per optimizer step (`refresh`), and the activations stay bf16 throughout, as in
  Megatron's and torchtitan's bf16 training and in transformers with bf16 parameters.

Gradients come out of the backward in bf16 and go into fp32 tensors of this object (`collect`: copied with one
micro-batch per step, added with several), which are handed to `.grad` for clipping and the optimizer (`hand_over`).
Within a micro-batch each weight's gradient is summed in bf16 only where a weight is used more than once.

Frozen parameters in another dtype (LoRA: the fp32 embedding and norms beside the bf16 base) get a working copy
too, and no gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def unavailable(device: torch.device, distributed: bool, low: torch.dtype | None) -> str | None:
    """Why a working copy cannot be used here (None: it can)."""
    if low is None:
        return "the run computes in fp32 (train.dtype)"
    if distributed:
        return "under torchrun FSDP2 casts the weights once per step itself (parallel.param_dtype)"
    if device.type != "cuda":
        return f"off by default on {device.type} (train.working_copy=true turns it on)"
    return None


class WorkingCopy:
    """The swap between a model's fp32 parameters and their low-precision working copies, and the fp32 gradients."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, accumulate: bool):
        """accumulate: several micro-batches per step (their gradients add up), else one (copied)."""
        self.dtype, self.accumulate = dtype, accumulate
        params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
        self.params = params
        self.masters = [p.data for p in params]  # the same storage as the parameters: updates show here
        self.low = [m.to(dtype) for m in self.masters]  # fixed addresses (CUDA graphs read them)
        self.trained = [i for i, p in enumerate(params) if p.requires_grad]
        self.grads = [torch.zeros_like(self.masters[i]) for i in self.trained]
        self._active = False

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the model (forward and backward) on the working copy; the parameters are fp32 again afterwards."""
        if self._active:
            raise RuntimeError("WorkingCopy.active() entered twice")
        for p, low in zip(self.params, self.low):
            p.data = low
        self._active = True
        try:
            yield
        finally:
            for p, master in zip(self.params, self.masters):
                p.data = master
            self._active = False

    def collect(self) -> None:
        """After a micro-batch's backward, inside `active()`: its bf16 gradients into the fp32 ones; `.grad` cleared."""
        pairs = [(self.grads[j], self.params[i].grad) for j, i in enumerate(self.trained)]
        have = [(acc, g) for acc, g in pairs if g is not None]
        if have:
            accs, gs = zip(*have)
            if self.accumulate:
                torch._foreach_add_(list(accs), list(gs))
            else:
                torch._foreach_copy_(list(accs), list(gs))
        if not self.accumulate:
            for acc, g in pairs:
                if g is None:  # a weight this micro-batch did not use: no stale gradient from the last step
                    acc.zero_()
        for i in self.trained:
            self.params[i].grad = None

    def hand_over(self) -> None:
        """Before clipping and the optimizer step: the fp32 gradients become the parameters' `.grad`."""
        for j, i in enumerate(self.trained):
            self.params[i].grad = self.grads[j]

    def after_step(self, stepped: bool) -> None:
        """After an optimizer step (or a skipped one): take the gradients back (zeroed when they accumulate) and
        cast the updated master weights into the working copy."""
        for i in self.trained:
            self.params[i].grad = None
        if self.accumulate:
            torch._foreach_zero_(self.grads)
        if stepped:
            self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the master weights into the working copy (after an optimizer step or a checkpoint load)."""
        if self._active:
            raise RuntimeError("WorkingCopy.refresh() while the working copy is active")
        torch._foreach_copy_(self.low, self.masters)

    def nbytes(self) -> int:
        """Memory the working copy adds (the low-precision weights; the fp32 gradients replace autocast's)."""
        return sum(t.numel() * t.element_size() for t in self.low)
