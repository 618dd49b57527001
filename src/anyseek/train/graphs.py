"""CUDA graphs for the training step (`train.cuda_graphs`): one micro-batch's forward and backward replayed as one
graph, so that the host no longer issues ~2,000 kernel launches per step.

Graphs need fixed shapes and addresses. A packed micro-batch always has `data.tokens_per_batch` tokens, but its
number of documents and its longest document vary, so each captured graph reads static buffers:

- input_ids and targets [T];
- cu_seqlens padded to a bucket of documents (the next power of two of B+1, at least 64 entries) by repeating T:
  the padding documents are empty, so they add no attention tiles, no loss targets, no expert load and no term of
  the sequence-wise balance loss (whose denominator is the step's count of segments, counted on the host);
- max_seqlen rounded up to a power of two, at most `data.max_seqlen` (an upper bound, as every attention seam takes
  it; kernels choose their tiles by it, so one bound for all would slow batches of short documents);
- the step's loss denominators (targets and balance-loss segments) and the MTP loss weight as device tensors.

One graph per (tokens, document bucket, max_seqlen bucket), at most MAX_GRAPHS, all in one memory pool (they
never run at once and none reads another's output). The first micro-batch of a new shape runs eagerly on the graph's
buffers (the warm-up: Triton compiles, cuBLAS sets up) and is then captured; later ones replay. Anything that fails
while capturing turns graphs off for the rest of the run with one line saying why; the step then runs eagerly.
Each graph keeps its activations' memory (its pool) and, with one micro-batch per step, its gradients: where the
GPU has no room for another (as the first one measured), a batch of a new shape replays on a graph whose buckets
hold it, or, if none does, every graph is given back and one graph of the largest buckets takes every batch from
then on (said in one line).

Gradients. One micro-batch per step (the default): the graph writes each gradient into a tensor of its own, which
it hands to `.grad` before each replay (no zeroing, no accumulation pass; the tensors cost one gradient's memory per
graph). Several micro-batches: `.grad` tensors made before the first capture, added into by every graph and eager
micro-batch, and zeroed (not freed) after each optimizer step. With `train.working_copy` the graphs own no
gradients: the captured micro-batch ends with the working copy's `collect`, which moves them into its flat buffer
(the trainer passes no parameters here).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from anyseek.model.layout import check_cu_seqlens

MAX_GRAPHS = 4
CAPTURE_MARGIN = 1.1  # a capture needs its eager warm-up's peak; this much more, for what the estimate misses
MIN_DOC_SLOTS = 64


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def unavailable(device: torch.device, compiled: bool, *, torchrun: bool = False, ep: int = 1,
                grad_accum: int = 1, ep_fixed: bool = False) -> str | None:
    """Why the step cannot (or, by default, does not) run as CUDA graphs here; None: it does.

    Under torchrun the captured micro-batch holds FSDP2's work too: its hooks run once, while capturing, and the
    copies and collectives they issue (the gathered weights, the reduced gradients) replay with the rest, so the
    gradients land in the same sharded `.grad` tensors at every replay. That needs one micro-batch per step, and
    with expert parallelism its fixed-shape dispatch (parallel.ep_dispatch: the exact one reads counts on the
    host). On by default for any number of ranks: one rank measured and tested on one GPU; several ranks (NCCL
    collectives inside the graph) measured on 2 H200s, 4.9x the eager step, which is host-bound
    (docs/distributed.md)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device (this run is on {device.type})"
    if compiled:
        return "train.compile=true: torch.compile manages its own graphs"
    if torchrun:
        if ep > 1 and not ep_fixed:
            return ("expert parallelism's exact dispatch (parallel.ep_dispatch=exact) reads the all-to-all's counts "
                    "on the host")
        if grad_accum > 1:
            return "under torchrun the graphs take one micro-batch per step (train.grad_accum=1)"
    return None


def _free_bytes(device: torch.device) -> int:
    """Bytes free on the GPU once the allocator's unused cache is given back."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class StepGraphs:
    """Captured forward+backward of micro-batches, keyed by shape bucket.

    micro(input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments, mtp_weight, graphed) runs one
    micro-batch's forward and backward and returns (loss, parts, expert_load) as tensors (the trainer's own step,
    not a copy)."""

    def __init__(self, micro: Callable, params: list[torch.nn.Parameter], device: torch.device, tokens: int,
                 max_seqlen: int, accumulate: bool, log: Callable[[str], None] = print,
                 agree: Callable[[bool], bool] | None = None):
        """accumulate: several micro-batches per step (the graphs add into kept `.grad` tensors), else one.
        agree: every rank's verdict from this one's (True where all say True; torchrun), for decisions all ranks
        must take alike (a capture holds collectives); None: this process alone."""
        self.micro, self.params, self.device, self.log = micro, params, device, log
        self.agree = agree
        self.tokens, self.max_seqlen, self.accumulate = tokens, max_seqlen, accumulate
        self.enabled = True
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.replays = 0
        self.eager = 0  # micro-batches that ran eagerly on a graph's buffers (the warm-ups)
        self.cost: int | None = None  # bytes one more graph needs (measured on the first)
        self.one_shape = False  # one graph of the largest buckets for every batch (memory for no other)
        self.stand_ins: dict[tuple, _Graph] = {}  # shapes without a graph of their own, replayed on a larger one

    def key(self, batch) -> tuple | None:
        """The graph this host batch fits, or None (then it runs eagerly)."""
        T = batch.num_tokens
        if T != self.tokens or batch.max_seqlen > self.max_seqlen:
            return None
        if self.one_shape:  # the largest buckets: every batch of T tokens fits
            return T, max(MIN_DOC_SLOTS, _pow2(T + 1)), self.max_seqlen
        return T, max(MIN_DOC_SLOTS, _pow2(batch.num_segments + 1)), min(_pow2(batch.max_seqlen), self.max_seqlen)

    def run(self, batch, num_targets: torch.Tensor, num_segments: torch.Tensor, mtp_weight: float):
        """One micro-batch: (loss, parts, expert_load) as tensors of its own, or None if this batch must run eagerly
        (the caller runs it). A new shape runs eagerly on the graph's own buffers (the warm-up) and is captured."""
        if not self.enabled:
            return None
        key = self.key(batch)
        if key is None:
            return None
        g = self.graphs.get(key) or self.stand_ins.get(key)
        if g is None and len(self.graphs) >= MAX_GRAPHS:
            g = self._covering(key)
            if g is None:
                return None
        if g is None and self.graphs and not self.room():
            g = self.stand_ins[key] = self._covering(key)
            if g is None:  # no room for another graph and none holds this batch: one graph for every shape
                del self.stand_ins[key]
                self._one_shape()
                key = self.key(batch)
        _check_cu(batch, key[0])
        if g is None:
            g = _Graph(*key, num_targets, num_segments, self.device)
            g.load(batch, num_targets, num_segments, mtp_weight)
            measure = self.cost is None
            if measure:
                torch.cuda.synchronize(self.device)
                before = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                outputs = self.micro(g.ids, g.cu, g.targets, g.max_seqlen, g.num_targets, g.num_segments,
                                     g.mtp_weight, False)
            current.wait_stream(self.stream)
            self.eager += 1
            if measure:
                torch.cuda.synchronize(self.device)
                warm = torch.cuda.max_memory_allocated(self.device) - before
                reserved = torch.cuda.memory_reserved(self.device)
            if measure and not self._capture_fits(warm):
                self.enabled = False
                self._drop_graphs()
                return outputs
            try:
                self._capture(g)
                if measure:  # what one more graph needs: its eager warm-up's peak, then the pool it keeps
                    self.cost = warm + max(torch.cuda.memory_reserved(self.device) - reserved, 0)
            except Exception as e:  # noqa: BLE001 - any failure: say why, go on eagerly
                self.enabled = False
                g.outputs = g.grads = None
                self._drop_graphs()  # their pool: the eager steps need the memory (16B EP4 ran out without)
                first = str(e).splitlines()[0] if str(e) else ""
                self.log(f"CUDA graphs off for the rest of the run: capturing the step failed "
                         f"({type(e).__name__}: {first}); the step runs eagerly")
                return outputs
            self.graphs[key] = g
            return outputs
        self._keep_grads(g)
        g.load(batch, num_targets, num_segments, mtp_weight)
        g.graph.replay()
        self.replays += 1
        loss, parts, load = g.outputs
        return loss.clone(), {k: v.clone() for k, v in parts.items()}, None if load is None else load.clone()

    def release(self) -> None:
        """Delete the captured graphs (the run is over, or graphs are off from now on). Under torchrun they hold
        NCCL kernels of the process group's communicators: on 2 ranks (H200s, stop 31) the process hung in
        destroy_process_group after a complete run while they were alive."""
        self._drop_graphs()
        self.enabled = False

    def forget(self) -> None:
        """Delete every graph (what they captured has changed shape: expert parallelism's C grew); the next batches
        are captured again, the memory check measured anew."""
        if self.enabled:
            self._drop_graphs()
            self.cost = None

    def _drop_graphs(self) -> None:
        """Delete every graph and give their memory back to the device; later captures go to a new pool (capturing
        into the emptied one failed an allocator assert, torch 2.11)."""
        torch.cuda.synchronize(self.device)
        for g in self.graphs.values():
            if g.graph is not None:
                g.graph.reset()
                g.graph = None
        self.graphs.clear()
        self.stand_ins.clear()
        gc.collect()  # (an exception's frames may still hold a failed capture's tensors)
        torch.cuda.empty_cache()
        self.pool = torch.cuda.graph_pool_handle()

    def _capture_fits(self, warm: int) -> bool:
        """Whether a first capture (or the first after `forget`) has memory on every rank: the eager warm-up's peak
        (`warm`, what the graph's pool will hold) times CAPTURE_MARGIN within what is free once the allocator's
        cache is given back. A capture that runs out of memory under torchrun leaves CUDA failing (`invalid
        argument`) on every rank (16B EP4 on 4 H200s, stops 46 and 47), so all ranks decide together and, where
        one lacks the room, the run goes on eagerly, saying so. (A collective: every rank gets here in the same
        step, since every rank starts without a graph, and `forget` runs on all of them together.)"""
        free = _free_bytes(self.device)
        mine = free > CAPTURE_MARGIN * warm
        every = self.agree(mine) if self.agree is not None else mine
        if not every:
            where = "here" if not mine else "on another rank"
            self.log(f"CUDA graphs off for the rest of the run: the step's graph would need about "
                     f"{CAPTURE_MARGIN * warm / 2**30:.1f} GiB and there is not that much free {where} "
                     f"({free / 2**30:.1f} GiB here); the step runs eagerly")
        return every

    def room(self) -> bool:
        """Whether the GPU has memory for one more graph: its warm-up and its pool (`cost`, as the first one took)
        in what is free once the allocator's unused cache is given back."""
        return self.cost is None or _free_bytes(self.device) > CAPTURE_MARGIN * self.cost

    def _covering(self, key: tuple) -> _Graph | None:
        """A captured graph whose buckets hold a batch of `key` (as many tokens, at least its document slots and
        its max_seqlen bound): the smallest such, or None."""
        T, slots, max_seqlen = key
        fits = [g for g in self.graphs.values() if g.T == T and g.slots >= slots and g.max_seqlen >= max_seqlen]
        return min(fits, key=lambda g: (g.slots, g.max_seqlen), default=None)

    def _one_shape(self) -> None:
        """Give every graph's memory back and capture one graph of the largest buckets from now on (a model whose
        activations and gradients take most of the GPU: 16B with expert parallelism on 4 H200s ran out of memory
        warming up its second graph). Shorter batches run on the longest bounds: the attention kernels' tiles
        chosen for `data.max_seqlen`, empty documents filling the slots (no work)."""
        free = torch.cuda.mem_get_info(self.device)[0]
        self.log(f"CUDA graphs: one graph for every batch shape from now on: another would need "
                 f"{self.cost / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free")
        self._drop_graphs()
        self.one_shape = True

    def _capture(self, g: _Graph) -> None:
        """Record (not run) the micro-batch on g's buffers. The step's gradients so far stay as they are."""
        held = [p.grad for p in self.params]
        for p in self.params:
            if self.accumulate and p.grad is None:  # recorded as `grad += new`: the tensors must exist
                p.grad = torch.zeros_like(p)
            elif not self.accumulate:  # recorded as `grad = new`, into tensors of the graph's own
                p.grad = None
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                g.outputs = self.micro(g.ids, g.cu, g.targets, g.max_seqlen, g.num_targets, g.num_segments,
                                       g.mtp_weight, True)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            g.grads = [p.grad for p in self.params]
            if not self.accumulate:
                for p, grad in zip(self.params, held):
                    p.grad = grad
        g.graph = graph

    def _keep_grads(self, g: _Graph) -> None:
        """Before a replay. One micro-batch per step: hand the graph's gradient tensors to `.grad` (the replay
        overwrites them). Several: the graph adds into the tensors it was captured with; where something set a
        `.grad` to None (no gradient yet) or replaced it, put the captured tensor back, holding the same values."""
        for p, grad in zip(self.params, g.grads):
            if p.grad is grad:
                continue
            if self.accumulate:
                if p.grad is None:
                    grad.zero_()
                else:
                    grad.copy_(p.grad)
            elif p.grad is not None:
                raise RuntimeError("one micro-batch per step, but a gradient is already set before it (grad_accum=1 "
                                   "with graphs expects `.grad` cleared after each step)")
            p.grad = grad


class _Graph:
    """Static inputs and outputs of one captured micro-batch."""

    def __init__(self, T: int, slots: int, max_seqlen: int, num_targets: torch.Tensor, num_segments: torch.Tensor,
                 device: torch.device):
        self.T, self.slots, self.max_seqlen = T, slots, max_seqlen
        self.ids = torch.zeros(T, dtype=torch.int64, device=device)
        self.targets = torch.zeros(T, dtype=torch.int64, device=device)
        self.cu = torch.full((slots,), T, dtype=torch.int32, device=device)
        self.num_targets = torch.ones_like(num_targets)
        self.num_segments = torch.ones_like(num_segments)
        self.mtp_weight = torch.zeros((), dtype=torch.float32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.grads: list[torch.Tensor] = []
        self.outputs = None

    def load(self, batch, num_targets: torch.Tensor, num_segments: torch.Tensor, mtp_weight: float) -> None:
        """Copy a host batch in through pinned memory, as the trainer's `_to_device` does: a copy from pageable memory
        waits for the stream first (the GPU then idled while the host copied and launched the next replay: 0.3-0.5 ms
        a step of `small` at 8k tokens on an H100); torch's pinned-memory cache keeps each block until the copy
        queued from it has run."""
        n = batch.cu_seqlens.numel()
        cu = torch.full((self.slots,), self.T, dtype=torch.int32, pin_memory=True)
        cu[:n] = batch.cu_seqlens
        self.ids.copy_(batch.input_ids.pin_memory(), non_blocking=True)
        self.targets.copy_(batch.targets.pin_memory(), non_blocking=True)
        self.cu.copy_(cu, non_blocking=True)
        self.num_targets.copy_(num_targets)
        self.num_segments.copy_(num_segments)
        self.mtp_weight.fill_(mtp_weight)


def _check_cu(batch, T: int) -> None:
    """`PackedLayout.build`'s check, made on the host copy: a graph being replayed cannot read values."""
    cu = batch.cu_seqlens.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
    check_cu_seqlens(int(cu[0]), int(cu[-1]), int(cu.diff().min()), T)
