"""Expert parallelism: each MoE layer's routed experts split over the `ep` ranks of an expert group; tokens travel
to the rank that holds their expert and back with two `all_to_all_single`s (counts first, then the rows).

    rank r, E experts, ep ranks, E_loc = E / ep experts here (E_loc*r ... E_loc*(r+1)-1)
    x [T, D], topk_ids [T, K] --sort the T*K slots by expert--> rows for rank 0 | rows for rank 1 | ...
        counts per expert  --all_to_all-->  how many rows each source sends for each of my experts   (host sync)
        rows [M, D], routing weights [M]  --all_to_all-->  received rows [N, D] (source-major, then expert)
        kernels.routed_experts(rows, local expert ids [N, 1], weights [N, 1], my experts)  (the unchanged seam)
        outputs [N, D]  --all_to_all (reverse splits)-->  [M, D]  --sum each token's K rows in fp32-->  y [T, D]

FP8 training (experts whose module says `fp8`): the rows travel as E4M3 bytes with power-of-two 1x128 scales
(`kernels.fp8_pack_rows`, ~1.03 bytes an element instead of 2) and the experts run `kernels.fp8_routed_experts`,
which quantize the rows to the very values they arrived as. So do the outputs' gradients on their way to the
experts (the activation gradient before the down projection, which the experts' backward quantizes the same way);
the outputs, and the rows' gradients on their way back, travel in bf16 (DeepSeek-V3's FP8 dispatch, bf16 combine,
forward and backward).

Backward is the same exchange with the splits swapped (`_AllToAll`). The one host sync per MoE layer and forward is
the split sizes: `all_to_all_single` takes them as Python ints.

Without host syncs (`Dispatch.capacity`, what lets the step replay as a CUDA graph): every (source, destination)
pair gets a fixed block of C rows, so both exchanges have equal, fixed splits, and the exact counts travel on the
device (the counts all-to-all, also of fixed size). The received [ep*C, D] rows carry the local expert of each row,
worked out on the device from the counts; rows past a source's count are marked "no expert" (id E_loc), which the
routed-experts kernel skips (no work, no tile). A pair with more than C rows is an overflow: the rows past C are not
sent, and the step's `Dispatch.overflow` flag is set on the device; the training step then runs that step again on
the exact path (train/step.py), so no token is ever dropped from an applied step. C is a multiple of a pair's
fair share T*K/ep (`capacity_rows`; parallel.ep_capacity_factor, 2 by default), at most the worst case
T*min(K, E_loc) rows (no overflow possible).

The expert weights are DTensors on the expert mesh ("edp", "ep"): Shard(0) over "ep", Replicate over "edp" (the copies held by
the other expert groups); their gradients are summed over "edp" by `sync_expert_grads` before clipping (a no-op when
ep == world size).

Shape legend: T tokens, K experts per token, M = T*K routed slots, N rows received, D hidden, E experts.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from anyseek import kernels
from anyseek.model.moe import addend


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of one or more row-aligned tensors with the same split sizes; backward sends the gradients
    back the same way. Every rank runs the same exchanges in the same order, forward and backward: a gradient that
    is None here (say, no rows arrived) travels as zeros, so no rank skips a collective the others wait in. fp8: the
    first tensor travels as E4M3 bytes and power-of-two scales (`kernels.fp8_pack_rows`) and arrives as those
    values in its dtype; fp8_grad: so does the first tensor's gradient on its way back (else in its dtype)."""

    @staticmethod
    def forward(ctx, out_splits: list[int], in_splits: list[int], group, fp8: bool, fp8_grad: bool,
                *tensors: torch.Tensor):  # fmt: skip
        ctx.splits, ctx.group, ctx.fp8_grad = (out_splits, in_splits), group, fp8_grad
        ctx.shapes = [(t.shape[1:], t.dtype, t.device) for t in tensors]
        first = _exchange_fp8 if fp8 else _exchange
        return (first(tensors[0], out_splits, in_splits, group),
                *(_exchange(t, out_splits, in_splits, group) for t in tensors[1:]))  # fmt: skip

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        out_splits, in_splits = ctx.splits
        back = []
        for i, (g, (shape, dtype, device)) in enumerate(zip(grads, ctx.shapes)):
            if g is None:
                g = torch.zeros((sum(out_splits), *shape), dtype=dtype, device=device)
            send = _exchange_fp8 if ctx.fp8_grad and i == 0 else _exchange
            back.append(send(g, in_splits, out_splits, ctx.group))
        return (None, None, None, None, None, *back)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _exchange_fp8(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """`_exchange` of rows as E4M3 bytes and power-of-two 1x128 scales (~1.03 bytes an element instead of bf16's
    2), unpacked on arrival to the quantized values in x's dtype."""
    q, s = kernels.fp8_pack_rows(x_SD)
    return kernels.fp8_unpack_rows(_exchange(q, out_splits, in_splits, group),
                                   _exchange(s, out_splits, in_splits, group), x_SD.dtype)  # fmt: skip


class _InFlight:
    """An exchange between its `_Start` and its `_Wait`: the forward's work handles, then the backward's. fp8: the
    first tensor travels as `kernels.fp8_pack_rows`' bytes (kept here in flight) and scales (which stand for the
    rows between `_Start` and `_Wait`: the autograd link), and `_Wait` unpacks them."""

    def __init__(self, group, fp8: bool = False):
        self.group, self.fp8 = group, fp8
        self.works: list = []
        self.grads: list[torch.Tensor] = []
        self.codes: torch.Tensor | None = None  # fp8: the first tensor's bytes as they arrive
        self.dtype: torch.dtype | None = None  # fp8: the first tensor's dtype


class _Start(torch.autograd.Function):
    """Start an equal-split all-to-all of each tensor without waiting for it (the rows travel while the caller
    computes something else); `_Wait` makes the stream wait. Backward is the mirror: `_Wait`'s backward starts the
    gradients' exchange and this one waits for it, so what autograd runs between (the shared experts' backward,
    which it reaches first) overlaps it."""

    @staticmethod
    def forward(ctx, flight: _InFlight, *tensors: torch.Tensor):
        ctx.flight = flight
        sends = list(tensors)
        if flight.fp8:  # the rows as bytes and scales; the scales stand for them until `_Wait`
            flight.dtype = tensors[0].dtype
            codes, sends[0] = kernels.fp8_pack_rows(tensors[0])
            flight.codes = codes.new_empty(codes.shape)
            flight.works = [dist.all_to_all_single(flight.codes, codes, group=flight.group, async_op=True)]
        outs = tuple(t.new_empty(t.shape) for t in sends)
        flight.works += [dist.all_to_all_single(o, t.contiguous(), group=flight.group, async_op=True)
                         for o, t in zip(outs, sends)]  # fmt: skip
        return outs

    @staticmethod
    def backward(ctx, *grads):
        for w in ctx.flight.works:
            w.wait()
        back, ctx.flight.grads, ctx.flight.works = ctx.flight.grads, [], []
        return (None, *back)


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flight: _InFlight, *tensors: torch.Tensor):
        ctx.flight = flight
        for w in flight.works:
            w.wait()
        flight.works = []
        outs = [t.view_as(t) for t in tensors]
        if flight.fp8:
            outs[0] = kernels.fp8_unpack_rows(flight.codes, tensors[0], flight.dtype)
            flight.codes = None
            ctx.link = tensors[0].shape  # the scales' shape: their (zero) gradient
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        f = ctx.flight
        # every rank sends every gradient (a None one as zeros): no rank skips a collective another waits in
        grads = [torch.zeros(shape, dtype=dtype, device=dev) if g is None else g.contiguous()
                 for g, (shape, dtype, dev) in zip(grads, ctx.shapes)]
        f.grads = [g.new_empty(g.shape) for g in grads]
        f.works = [dist.all_to_all_single(o, g, group=f.group, async_op=True) for o, g in zip(f.grads, grads)]
        back = list(f.grads)  # not yet arrived: `_Start.backward`, their only reader, waits first
        if f.fp8:  # the scales that stood for the rows get none (the rows' gradient goes through `f.grads`)
            back[0] = grads[0].new_zeros(ctx.link, dtype=torch.float32)
        return (None, *back)


def _count_slots(topk_ids_TK: torch.Tensor, E: int, group):
    """Both dispatches' start: the T*K slots (ids_M), their order by expert (hence by owning rank), this rank's
    count per expert [E], and what every source sends each of my experts ([ep sources x E_loc], one all-to-all of
    equal splits: no host sync)."""
    ids_M = topk_ids_TK.reshape(-1)
    order_M = torch.argsort(ids_M, stable=True)
    counts_E = torch.zeros(E, dtype=torch.int64, device=ids_M.device).index_add_(0, ids_M, torch.ones_like(ids_M))
    recv_counts_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_E, counts_E, group=group)
    return ids_M, order_M, counts_E, recv_counts_E


def dispatch_combine_fixed(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    group,
    capacity: int,
    overflow: torch.Tensor,
    add_TD=None,
    overlap: bool = True,
    peak: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """`dispatch_combine` in fixed shapes, without a host sync: `capacity` (C) rows for each (source, destination)
    pair; `overflow` (a device scalar) is raised where a pair needs more (the rows past C are not computed).
    add_TD (a [T, D] tensor, or a function computing it: the shared experts) is added to the output; with `overlap`
    it is computed while the rows travel, and its backward runs while their gradients travel back. peak (an int64
    device scalar): raised to the most rows this rank sends any other (what C would have to be). fp8: as
    `dispatch_combine`'s."""
    T, K = topk_ids_TK.shape
    ep, E_loc, C = dist.get_world_size(group), gate_up_local.shape[0], capacity
    dev = x_TD.device
    ids_M, order_M, counts_E, recv_counts_E = _count_slots(topk_ids_TK, ep * E_loc, group)
    M = ids_M.numel()
    to_rank_R = counts_E.view(ep, E_loc).sum(1)
    dest_M = ids_M.index_select(0, order_M) // E_loc  # the owning rank of each sorted slot
    pos_M = torch.arange(M, device=dev) - (to_rank_R.cumsum(0) - to_rank_R).index_select(0, dest_M)
    keep_M = pos_M < C
    overflow.logical_or_(~keep_M.all())
    if peak is not None:
        torch.maximum(peak, to_rank_R.max(), out=peak)
    at_M = torch.where(keep_M, dest_M * C + pos_M, ep * C)  # a slot past its pair's C rows: the spare row ep*C
    # each slot's row in the [ep*C] exchange buffers, in slot order (t*K + k), and each buffer row's token
    at_slot_M = torch.empty_like(at_M).index_copy_(0, order_M, at_M).clamp_(max=ep * C - 1)
    token_S = torch.zeros(ep * C + 1, dtype=order_M.dtype, device=dev).index_copy_(0, at_M, order_M // K)[:-1]
    w_M = topk_weights_TK.reshape(-1).index_select(0, order_M)
    send_w_S = w_M.new_zeros(ep * C + 1).index_copy(0, at_M, w_M)[:-1]
    send_SD = _SendRows.apply(x_TD, token_S, at_slot_M, K)
    splits = [C] * ep
    if overlap:
        flight = _InFlight(group, fp8)
        recv_SD, recv_w_S = _Start.apply(flight, send_SD, send_w_S)
        add_TD = addend(add_TD)  # the shared experts, while the rows travel
        recv_SD, recv_w_S = _Wait.apply(flight, recv_SD, recv_w_S)
    else:
        recv_SD, recv_w_S = _AllToAll.apply(splits, splits, group, fp8, False, send_SD, send_w_S)
    # row j of source s's block: the first local expert whose running count passes j (E_loc: past the count)
    ends = recv_counts_E.view(ep, E_loc).cumsum(1)
    local_S = torch.searchsorted(ends, torch.arange(C, device=dev).expand(ep, C).contiguous(), right=True)
    experts = kernels.fp8_routed_experts if fp8 else kernels.routed_experts
    y_SD = experts(recv_SD, local_S.view(-1, 1), recv_w_S[:, None], gate_up_local, down_local)
    (back_SD,) = _AllToAll.apply(splits, splits, group, False, fp8, y_SD)  # fp8: the outputs' gradients
    y_TD = _sum_slots(back_SD.index_select(0, at_slot_M), T, K, x_TD.dtype)
    add_TD = addend(add_TD)
    return y_TD if add_TD is None else y_TD + add_TD


def _sum_slots(rows_MD: torch.Tensor, T: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """[T*K, D] in slot order -> [T, D]: each token's K rows summed in fp32 (k in order: deterministic)."""
    return rows_MD.view(T, K, -1).sum(1, dtype=torch.float32).to(dtype)


class _Permute(torch.autograd.Function):
    """rows.index_select(0, perm) for a permutation whose inverse is `inverse`: the backward is a gather too
    (index_select's own backward scatters with atomics)."""

    @staticmethod
    def forward(ctx, rows, perm, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.index_select(0, inverse), None, None


class _SendRows(torch.autograd.Function):
    """The fixed-shape send buffer in one gather: row s is token_S[s]'s row (a row past its pair's count carries
    token 0's, marked "no expert" on arrival). Backward reads only the rows that were sent (at_slot: each slot's
    buffer row), summed per token in fp32: the unsent rows' gradients (the experts leave them unspecified) never
    reach x."""

    @staticmethod
    def forward(ctx, x_TD, token_S, at_slot_M, K: int):
        ctx.save_for_backward(at_slot_M)
        ctx.T, ctx.K = x_TD.shape[0], K
        return x_TD.index_select(0, token_S)

    @staticmethod
    def backward(ctx, g_SD):
        (at_slot_M,) = ctx.saved_tensors
        return _sum_slots(g_SD.index_select(0, at_slot_M), ctx.T, ctx.K, g_SD.dtype), None, None, None


class Dispatch:
    """How every MoE layer of a model sends its rows (shared by them): inside `fixed_shapes()` (the training step's
    micro-batches, which C was sized for) `capacity` C rows per (source, destination) pair (`dispatch_combine_fixed`:
    no host sync); elsewhere (evaluation, sampling, a step run again after an overflow), or with capacity None,
    exact splits read on the host (`dispatch_combine`). `overflow`: raised on the device by a fixed-shape dispatch
    that needed more than C rows, until `reset`; `peak`: the most rows any pair needed meanwhile, by the fixed or the
    exact dispatch (an overflow's caller may raise C to it: `capacity` is read at each call, the shapes of graphs
    captured before do not change). `settling`: the exact dispatch inside `fixed_shapes()` too, its peaks still
    recorded (the caller turns the fixed shapes on once the routing fits C)."""

    def __init__(self, device: torch.device, capacity: int | None = None, overlap: bool = True,
                 worst: int | None = None, settling: bool = False):
        """worst: the C that never overflows (what C may grow to); settling: start on the exact dispatch (at the
        worst-case C nothing can overflow: never)."""
        self.capacity, self.overlap, self.worst = capacity, overlap, worst
        self.overflow = torch.zeros((), dtype=torch.bool, device=device)
        self.peak = torch.zeros((), dtype=torch.int64, device=device)  # the most rows a pair needed since `reset`
        # the exact dispatch inside `fixed_shapes()` too (the caller waits for the routing to fit C)
        self.settling = settling and capacity is not None and (worst is None or capacity < worst)
        self._on = False

    def reset(self) -> None:
        self.overflow.zero_()
        self.peak.zero_()

    @contextlib.contextmanager
    def fixed_shapes(self):
        before, self._on = self._on, self.capacity is not None and not self.settling
        try:
            yield
        finally:
            self._on = before

    @property
    def fixed(self) -> bool:
        return self._on


def capacity_rows(tokens: int, top_k: int, ep: int, experts_here: int, factor: float) -> int:
    """C for micro-batches of `tokens` tokens: `factor` times a pair's fair share (tokens*top_k/ep, rounded up to
    16 rows), at most the worst case tokens*min(top_k, experts_here) (which never overflows). factor <= 0: the
    worst case."""
    worst = tokens * min(top_k, experts_here)
    if factor <= 0:
        return worst
    return max(1, min(worst, -(-math.ceil(factor * tokens * top_k / ep) // 16) * 16))


def dispatch_combine(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_local: torch.Tensor,
    down_local: torch.Tensor,
    group,
    peak: torch.Tensor | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """The routed experts of a whole expert group, this rank holding experts [E_loc*r, E_loc*(r+1)) (gate_up_local
    [E_loc, 2I, D], down_local [E_loc, D, I]). Same maths as `kernels.routed_experts` on all E experts; y [T, D] in
    x's dtype. Every rank of `group` must call it (with its own tokens, possibly none). peak: raised (on the device)
    to the most rows this rank sent to or received from one rank. fp8 (FP8 training, DeepSeek-V3's recipe): the
    rows travel as E4M3 with power-of-two 1x128 scales (`kernels.fp8_pack_rows`: about half the bytes) and the
    experts are `kernels.fp8_routed_experts`, which quantize them to the same values; so do the outputs' gradients
    on their way to the experts; the outputs travel back, and the rows' gradients too, in x's dtype (the paper's
    combine in bf16). Same maths as `kernels.fp8_routed_experts` on all E experts."""
    T, K = topk_ids_TK.shape
    ep, E_loc = dist.get_world_size(group), gate_up_local.shape[0]
    _, order_M, counts_E, recv_counts_E = _count_slots(topk_ids_TK, ep * E_loc, group)
    splits_2R = torch.stack([counts_E.view(ep, E_loc).sum(1), recv_counts_E.view(ep, E_loc).sum(1)])
    # the rows in expert order, their slots' positions in it (the inverse permutation), queued before the host sync
    # so that the GPU has them to do while the host waits for the counts and catches up after
    at_slot_M = torch.empty_like(order_M).index_copy_(0, order_M, torch.arange(T * K, device=x_TD.device))
    rows_MD = _SendRows.apply(x_TD, order_M // K, at_slot_M, K)
    w_M = topk_weights_TK.reshape(-1).index_select(0, order_M)
    in_splits, out_splits = splits_2R.tolist()  # the host sync: Python ints for the row exchange
    if peak is not None:
        peak.clamp_(min=max(in_splits + out_splits))
    rows_ND, w_N = _AllToAll.apply(out_splits, in_splits, group, fp8, False, rows_MD, w_M)
    N = rows_ND.shape[0]
    local_ids_N = torch.arange(E_loc, device=x_TD.device).repeat(ep).repeat_interleave(recv_counts_E, output_size=N)
    experts = kernels.fp8_routed_experts if fp8 else kernels.routed_experts
    if N:
        y_ND = experts(rows_ND, local_ids_N[:, None], w_N[:, None], gate_up_local, down_local)
    else:  # nothing arrived: keep the exchanges in the autograd graph, or this rank's backward would skip them
        y_ND = rows_ND * w_N[:, None].to(rows_ND.dtype) + 0 * (gate_up_local.sum() + down_local.sum())
    (y_MD,) = _AllToAll.apply(in_splits, out_splits, group, False, fp8, y_ND)  # fp8: the outputs' gradients
    # each token's K rows gathered back into slot order and summed in fp32 (k in order: deterministic; no atomics,
    # no fp32 copy of the rows: the stop-46 profile of 16B EP4 spent ~60 of 352 ms of compute in that glue)
    return _sum_slots(_Permute.apply(y_MD, at_slot_M, order_M), T, K, x_TD.dtype)


class ExpertParallelExperts(nn.Module):
    """Drop-in for `model.moe.Experts` (same parameter names, so state dicts and checkpoints keep their keys)
    holding this rank's slice of the experts as DTensors on `mesh` ("edp", "ep")."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, mesh: DeviceMesh,
                 dispatch: Dispatch | None = None, fp8: bool = False):
        """fp8: the experts replaced were FP8 training's (`fp8 = True` on their module): FP8 dispatch and
        `kernels.fp8_routed_experts`."""
        super().__init__()
        self.mesh = mesh
        self.dispatch = dispatch
        self.fp8 = fp8
        placements = [Replicate(), Shard(0)]
        self.gate_up_proj = nn.Parameter(distribute_tensor(gate_up_proj.detach(), mesh, placements))
        self.down_proj = nn.Parameter(distribute_tensor(down_proj.detach(), mesh, placements))

    def forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                add_TD=None) -> torch.Tensor:  # fmt: skip
        gate_up = self.gate_up_proj.to_local(grad_placements=self.gate_up_proj.placements)
        down = self.down_proj.to_local(grad_placements=self.down_proj.placements)
        group, d = self.mesh.get_group("ep"), self.dispatch
        if d is not None and d.fixed:
            return dispatch_combine_fixed(x_TD, topk_ids_TK, topk_weights_TK, gate_up, down, group, d.capacity,
                                          d.overflow, add_TD, d.overlap, d.peak, self.fp8)
        y_TD = dispatch_combine(x_TD, topk_ids_TK, topk_weights_TK, gate_up, down, group,
                                None if d is None or d.capacity is None else d.peak, self.fp8)
        add_TD = addend(add_TD)
        return y_TD if add_TD is None else y_TD + add_TD


def apply_ep(model: nn.Module, mesh: DeviceMesh, dispatch: Dispatch | None = None) -> list[nn.Parameter]:
    """Replace every MoE layer's `experts` with its expert-parallel twin on `mesh` ("edp", "ep"), all sending their
    rows as `dispatch` says (None: exact splits); the model's full expert weights (identical on every rank) are split
    by `distribute_tensor`; experts whose module says `fp8` (FP8 training's) stay FP8 with FP8 dispatch. Returns the
    new expert parameters (for FSDP to leave alone)."""
    ep = mesh["ep"].size()
    params: list[nn.Parameter] = []
    for moe in model.moe_layers():
        E = moe.experts.gate_up_proj.shape[0]
        if E % ep:
            raise ValueError(f"parallel.ep={ep} must divide the number of routed experts ({E})")
        moe.experts = ExpertParallelExperts(moe.experts.gate_up_proj, moe.experts.down_proj, mesh, dispatch,
                                            fp8=getattr(moe.experts, "fp8", False))  # fmt: skip
        params += [moe.experts.gate_up_proj, moe.experts.down_proj]
    return params


def sync_expert_grads(params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Sum the expert gradients over the expert groups ("edp": ranks holding the same experts)."""
    if mesh["edp"].size() == 1:
        return
    group = mesh.get_group("edp")
    for p in params:  # every rank reduces every expert weight, in the same order
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
