"""The seams through which the model reaches kernels, and nothing else.

(a) attention over packed variable-length batches: `mla_attention` (MLA's split form) and `varlen_attention`;
(b) the routed experts: `routed_experts` (group tokens by expert, grouped SwiGLU matmul, weighted combine);
(c) decoding: `mla_decode` (absorbed MLA attention over a paged latent cache, for `anyseek.infer`);
(d) fused elementwise chains: `rms_norm`, `add_rms_norm` (a residual add and the norm after it),
    `cross_entropy_rows` (the output head's loss between its matmuls), `rope_rotate` (MLA's rope dims), `swiglu`,
    `low_rank_merge` (a weight plus its low-rank update, LoRA's merged weight);
(e) the trainer's optimizer step over flat buffers: `adamw_flat`, `sq_norm` (train/precision.py; not the model's), and
    over lists of tensors: `adamw_tensors` (train/optim.py: FSDP2's shards, LoRA's adapters);
(f) LoRA, applied from outside the model (transforms/lora.py): `low_rank_linear` (a linear layer with a low-rank term
    beside its frozen weight; `model.concat.fused_linear` calls it for joined layers too) and `lora_routed_experts`
    (the routed experts with per-expert adapters beside the frozen stacks). Both take the frozen weights in 4 bits
    too (`quantize4` / `dequantize4`, the format in reference/quant4.py; ops quant4_linear, quant4_routed_experts);
(g) FP8 training, applied from outside the model (transforms/fp8.py): `fp8_linear` (a linear layer in DeepSeek-V3's
    FP8 recipe; `model.concat.fused_linear` calls it for joined layers too) and `fp8_routed_experts`; expert
    parallelism's FP8 dispatch: `fp8_pack_rows` / `fp8_unpack_rows`.

The attention seams check their input contract once (`contract.py`); backends trust it.
Each call goes through `registry`, which picks a backend per op (Triton on CUDA, SDPA, the pure-PyTorch
reference) and says why; every op has a pure-PyTorch reference twin in `reference/`. `import anyseek.kernels` never
imports Triton. Where each backend's code lives (kernels, launchers, autograd glue): docs/kernels.md.
"""

from __future__ import annotations

import torch

from anyseek.kernels import contract, registry
from anyseek.kernels.reference.quant4 import dequantize4, quantize4
from anyseek.kernels.reference.quant4 import in_features as in_features4
from anyseek.kernels.registry import describe, set_backend


def mla_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """MLA attention on a packed batch.

    q [T, H, nope+rope] (nope part first), k_nope [T, H, nope], k_pe [T, rope] (shared by all heads),
    v [T, H, v_dim], cu_seqlens int32 [B+1] (document starts; attention never crosses one), max_seqlen:
    the longest document. Returns out [T, H, v_dim]. softmax_scale defaults to 1/sqrt(nope+rope).
    """
    contract.check_mla(q, k_nope, k_pe, v, cu_seqlens)
    fn = registry.get("mla_attention", q)
    return fn(q, k_nope, k_pe, v, cu_seqlens, max_seqlen, softmax_scale, causal)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    softmax_scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention on a packed batch with head dims up to 256 (qk and v may differ).

    q [T, H, d_qk], k [T, H, d_qk], v [T, H, d_v], cu_seqlens int32 [B+1] -> out [T, H, d_v].
    """
    contract.check_varlen(q, k, v, cu_seqlens)
    fn = registry.get("varlen_attention", q)
    return fn(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)


def routed_experts(
    x_TD: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    gate_up_proj_EFD: torch.Tensor,
    down_proj_EDI: torch.Tensor,
    add_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]) (+ add[t]), e = topk_ids[t,k].

    x [T, D], topk_ids int [T, K] in [0, E] (E: a slot no expert takes, as expert parallelism's empty receive rows
    are; its output row is unspecified and its gradients are ignored), topk_weights [T, K] (already normalised and
    scaled by the router),
    gate_up_proj [E, 2*I, D] (rows 0..I-1 the gate projection, I..2I-1 the up projection; nn.Linear layout),
    down_proj [E, D, I]; add_TD [T, D] or None: a term added to the output (the shared experts'; every backend takes
    it, the Triton one sums it with the K experts' rows in one fp32 pass). Returns y [T, D] in x's dtype (promoted
    with add's).
    """
    if add_TD is not None and add_TD.shape != x_TD.shape:
        raise ValueError(f"routed_experts: add_TD {tuple(add_TD.shape)} must have x's shape {tuple(x_TD.shape)}")
    fn = registry.get("routed_experts", x_TD)
    return fn(x_TD, topk_ids_TK, topk_weights_TK, gate_up_proj_EFD, down_proj_EDI, add_TD=add_TD)


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_lora_rank: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of query rows over a paged latent cache (one layer).

    q [T, H, L+R] (the latent-space query q_nope @ W_UK, then the rotated q_pe), cache [blocks, page, L+R]
    (normalized kv_a latent, then rotated k_pe), block_table int32 [T, M] (the pages row t reads, in order),
    kv_lens int32 [T] (row t attends to its first kv_lens[t] >= 1 cached tokens). Returns out [T, H, L] in q's
    dtype, still in latent space (apply W_UV after). softmax_scale defaults to 1/sqrt(L+R).
    """
    fn = registry.get("mla_decode", q)
    return fn(q, cache, block_table, kv_lens, kv_lora_rank, softmax_scale)


def rms_norm(x: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V3's RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype before
    the scale. x [..., D], weight [D] -> same shape as x, dtype the promotion of x's and weight's."""
    fn = registry.get("rms_norm", x)
    return fn(x, weight_D, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight_D: torch.Tensor, eps: float, copies: int = 1
                 ) -> tuple[torch.Tensor, ...]:
    """The residual add and the RMSNorm after it: (h, rms_norm(h, weight, eps)) with h = x + y in the promotion of
    x's and y's dtypes. x, y [..., D] of one shape. copies (1-3): the normalised h is returned that many times,
    (h, out_1, ..., out_copies), one per consumer; a backend may then sum the consumers' gradients inside its own
    backward instead of autograd adding them one [..., D] pass at a time (the MoE's three inputs)."""
    if x.shape != y.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and y {tuple(y.shape)} must have one shape")
    if not 1 <= copies <= 3:
        raise ValueError(f"add_rms_norm: copies must be 1, 2 or 3, got {copies}")
    fn = registry.get("add_rms_norm", x)
    return fn(x, y, weight_D, eps, copies)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the gate and up projections side by side: gu [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of gu {tuple(gu.shape)} must be even ([gate | up])")
    return registry.get("swiglu", gu)(gu)


def cross_entropy_rows(logits_CV: torch.Tensor, labels_C: torch.Tensor, want_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of a chunk of logits [C, V]: nll = logsumexp - logits[label] (fp32 [C]; labels int [C], each a valid
    index) and, with want_grad, softmax - onehot(label) in the logits' dtype (None without). The gradient may be
    written over the logits (the Triton backend does): do not use `logits_CV` after this call."""
    if logits_CV.dim() != 2 or labels_C.shape != logits_CV.shape[:1]:
        raise ValueError(f"cross_entropy_rows: logits must be [C, V] and labels [C], got {tuple(logits_CV.shape)} "
                         f"and {tuple(labels_C.shape)}")
    fn = registry.get("cross_entropy_rows", logits_CV)
    return fn(logits_CV, labels_C, want_grad)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None,
                interleaved_in: bool = True, interleaved_out: bool = True, conj: bool = False) -> torch.Tensor:
    """Rotary embedding of the rope dims: x [T, H, R] or [T, R] (last dim contiguous, any other strides), cos/sin
    [T, R/2] (fp32). Each pair, read as (x[2i], x[2i+1]) when interleaved_in else (x[i], x[i + R/2]), is multiplied
    by cos + i sin (conj: cos - i sin, the backward) in fp32 and written to `out` (default a new tensor; may be x
    itself) as (re, im) interleaved when interleaved_out, else as halves. Returns out."""
    if x.shape[-1] % 2 or x.stride(-1) != 1 or x.dim() not in (2, 3) or cos.shape != (x.shape[0], x.shape[-1] // 2):
        raise ValueError(f"rope_rotate: x must be [T, H, R] or [T, R] with an even, contiguous last dim and cos/sin "
                         f"[T, R/2]; got x {tuple(x.shape)} (strides {x.stride()}), cos {tuple(cos.shape)}")
    if out is not None and (out.shape != x.shape or out.stride(-1) != 1):
        raise ValueError(f"rope_rotate: out {tuple(out.shape)} must match x {tuple(x.shape)}, last dim contiguous")
    return registry.get("rope_rotate", x)(x, cos, sin, out, interleaved_in, interleaved_out, conj)


def mla_cache_write(cache_NX: torch.Tensor, slots_T: torch.Tensor, kv_a_TX: torch.Tensor, weight_L: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, interleaved_in: bool,
                    q_pe_THR: torch.Tensor | None = None, q_out_THR: torch.Tensor | None = None) -> None:  # fmt: skip
    """The latent cache rows of T new tokens, in place: row slots[t] of the flat cache [N, L+R] gets the token's
    normalized latent, `rms_norm(kv_a[t, :L], weight_L, eps)`, then its rotated k_pe, `rope_rotate(kv_a[t, L:], cos,
    sin, interleaved_in=interleaved_in)` (pairs out interleaved), both in the cache's dtype. kv_a [T, L+R] (the
    MLA's kv_a projection; last dim contiguous), slots int64 [T], cos/sin fp32 [T, R/2]. With q_pe [T, H, R] and
    q_out [T, H, R] (last dims contiguous; q_out typically the rope columns of the absorbed query), also the
    query's rotation with the same cos/sin, `rope_rotate(q_pe, cos, sin, out=q_out, interleaved_in=interleaved_in)`.
    One kernel on GPUs where the decode step ran five (the norm, two ropes, a concatenation, the row copy)."""
    T, X = kv_a_TX.shape if kv_a_TX.dim() == 2 else (-1, -1)
    L = weight_L.shape[0] if weight_L.dim() == 1 else -1
    if (T < 0 or L < 0 or X - L <= 0 or (X - L) % 2 or kv_a_TX.stride(-1) != 1 or cache_NX.dim() != 2
            or cache_NX.shape[1] != X or cache_NX.stride(-1) != 1 or slots_T.shape != (T,)
            or cos.shape != (T, (X - L) // 2) or sin.shape != cos.shape):  # fmt: skip
        raise ValueError(f"mla_cache_write: cache [N, L+R], slots [T], kv_a [T, L+R] (last dims contiguous), weight "
                         f"[L], cos/sin [T, R/2] with R even; got cache {tuple(cache_NX.shape)}, slots "
                         f"{tuple(slots_T.shape)}, kv_a {tuple(kv_a_TX.shape)}, weight {tuple(weight_L.shape)}, cos "
                         f"{tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if (q_pe_THR is None) != (q_out_THR is None) or (q_pe_THR is not None and (
            q_pe_THR.dim() != 3 or q_pe_THR.shape[0] != T or q_pe_THR.shape[2] != X - L
            or q_out_THR.shape != q_pe_THR.shape or q_pe_THR.stride(-1) != 1 or q_out_THR.stride(-1) != 1)):
        raise ValueError(f"mla_cache_write: q_pe and q_out together, each [T, H, R] = [{T}, H, {X - L}] with a "
                         f"contiguous last dim; got q_pe {None if q_pe_THR is None else tuple(q_pe_THR.shape)}, "
                         f"q_out {None if q_out_THR is None else tuple(q_out_THR.shape)}")
    registry.get("mla_cache_write", kv_a_TX)(cache_NX, slots_T, kv_a_TX, weight_L, eps, cos, sin, interleaved_in,
                                             q_pe_THR, q_out_THR)  # fmt: skip


def gumbel_argmax(logits_BV: torch.Tensor, keys_B: torch.Tensor) -> torch.Tensor:
    """A draw from softmax(logits) per row, Gumbel-max with counter-based noise: argmax over v of logits[b, v] -
    log(-log(u)), u in (0, 1) the splitmix64 hash of keys[b] + (v + 1) * golden (24 bits; `reference/sampling.py`),
    so a row's draw depends on its logits and key only. logits fp32 [B, V], keys int64 [B] -> ids int64 [B]. One
    pass over the logits on GPUs where the twin makes the [B, V] noise in about fifteen."""
    if logits_BV.dim() != 2 or keys_B.shape != (logits_BV.shape[0],) or keys_B.dtype != torch.int64:
        raise ValueError(f"gumbel_argmax: logits [B, V] and int64 keys [B], got logits {tuple(logits_BV.shape)}, "
                         f"keys {tuple(keys_B.shape)} {keys_B.dtype}")
    return registry.get("gumbel_argmax", logits_BV)(logits_BV, keys_B)


def adamw_flat(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, low: torch.Tensor | None,
               scale: torch.Tensor, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               skip: torch.Tensor | None = None, seed: int = 0) -> None:
    """One AdamW step (torch.optim.AdamW's maths) in place over flat 1-D buffers: fp32 weights p, moments m, v (fp32,
    or bf16: read as fp32 and stored with stochastic rounding driven by `seed`, an int the caller changes every step),
    the gradient (bf16/fp16/fp32) divided by the device scalar `scale` (the folded clip factor), and the working copy
    `low` (or None) rewritten from the new weights. step: the step number, from 1. skip (a device scalar or None):
    nonzero leaves every buffer unchanged (a non-finite step skipped without a host sync)."""
    if not (p.dim() == 1 and p.shape == grad.shape == m.shape == v.shape and (low is None or low.shape == p.shape)):
        raise ValueError(f"adamw_flat: 1-D buffers of one length expected, got p {tuple(p.shape)}, grad "
                         f"{tuple(grad.shape)}, m {tuple(m.shape)}, v {tuple(v.shape)}"
                         + ("" if low is None else f", low {tuple(low.shape)}"))
    if p.dtype != torch.float32 or m.dtype != v.dtype or m.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adamw_flat: p must be fp32 and m, v both fp32 or both bf16; got p {p.dtype}, m {m.dtype}, "
                         f"v {v.dtype}")
    if skip is not None and skip.numel() != 1:
        raise ValueError(f"adamw_flat: skip must be a scalar, got shape {tuple(skip.shape)}")
    fn = registry.get("adamw_flat", p)
    fn(p, grad, m, v, low, scale, step, lr, beta1, beta2, eps, weight_decay, skip=skip, seed=seed)


def adamw_tensors(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], scale: torch.Tensor, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float, skip: torch.Tensor | None = None,
                  lows: list[torch.Tensor] | None = None) -> None:  # fmt: skip
    """One AdamW step (torch.optim.AdamW's maths) in place over lists of tensors, each of any shape: contiguous fp32
    weights and moments, gradients (contiguous, one float dtype for all) divided by the device scalar `scale`, and
    each tensor's step number as a 0-dim fp32 tensor on the device, counted by the caller before the update (torch's
    AdamW state). skip (a device scalar or None): nonzero leaves every tensor unchanged. lows (or None): a contiguous
    bf16 or fp16 copy of each weight (one dtype for all), rewritten from the new weights (FSDP2's bf16 shards beside
    their fp32 masters). For optimizers whose weights are not one flat buffer: FSDP2's shards, LoRA's adapters
    (`train.optim.TensorAdamW`)."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, steps)
    if len({len(x) for x in lists}) != 1:
        raise ValueError(f"adamw_tensors: lists of one length expected, got {[len(x) for x in lists]}")
    f32, gdt = torch.float32, grads[0].dtype if grads else None
    for i, (p, g, m, v, s) in enumerate(zip(*lists)):  # (one pass, messages made only on failure: ~200 tensors a step)
        if not (p.shape == g.shape == m.shape == v.shape and s.numel() == 1):
            raise ValueError(f"adamw_tensors: tensor {i}: p {tuple(p.shape)}, grad {tuple(g.shape)}, m "
                             f"{tuple(m.shape)}, v {tuple(v.shape)} must match and step be a scalar")
        if not (p.dtype == m.dtype == v.dtype == s.dtype == f32 and g.dtype == gdt):
            raise ValueError(f"adamw_tensors: tensor {i}: p, m, v and step must be fp32 and every grad one float "
                             f"dtype; got p {p.dtype}, m {m.dtype}, v {v.dtype}, step {s.dtype}, grad {g.dtype}")
        if not (p.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"adamw_tensors: tensor {i} (shape {tuple(p.shape)}) is not contiguous")
    if gdt not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"adamw_tensors: gradients must be fp32, bf16 or fp16, got {gdt}")
    if lows is not None:
        if len(lows) != len(params):
            raise ValueError(f"adamw_tensors: {len(lows)} low copies for {len(params)} weights")
        ldt = lows[0].dtype if lows else None
        for i, (p, low) in enumerate(zip(params, lows)):
            if low.shape != p.shape or low.dtype != ldt or ldt not in (torch.bfloat16, torch.float16) \
                    or not low.is_contiguous():
                raise ValueError(f"adamw_tensors: low copy {i}: {tuple(low.shape)} {low.dtype} must be a contiguous "
                                 f"bf16 or fp16 tensor (one dtype for all) of its weight's shape {tuple(p.shape)}")
    if not params:
        return
    fn = registry.get("adamw_tensors", params[0])
    fn(params, grads, exp_avgs, exp_avg_sqs, steps, scale, lr, beta1, beta2, eps, weight_decay, skip=skip, lows=lows)


def _check_routing(op: str, what: str, x_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int,
                   topk_group: int) -> None:  # fmt: skip
    """The routing seams' contract: x [T, E], bias [E], E experts in n_group equal groups, topk_group of them kept,
    top_k within those."""
    if x_TE.dim() != 2 or bias_E.shape != x_TE.shape[1:]:
        raise ValueError(f"{op}: {what} must be [T, E] and bias [E], got {tuple(x_TE.shape)} and "
                         f"{tuple(bias_E.shape)}")
    E = x_TE.shape[1]
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * (E // n_group):
        raise ValueError(f"{op}: {E} experts in {n_group} groups, {topk_group} groups kept and top_k {top_k} "
                         "do not fit (E divisible by n_group, 1 <= topk_group <= n_group, 1 <= top_k <= "
                         "topk_group * E / n_group)")


def route_topk(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
               top2_groups: bool) -> torch.Tensor:  # fmt: skip
    """The router's choice (no gradient): for each token the top_k experts by scores + bias (scores fp32 [T, E], bias
    [E]) among the topk_group best of n_group equal groups, a group scored by the sum of its best two (top2_groups:
    V3's noaux_tc) or its best (V2's group_limited_greedy) -> ids [T, top_k] int64, in no particular order."""
    _check_routing("route_topk", "scores", scores_TE, bias_E, top_k, n_group, topk_group)
    return registry.get("route_topk", scores_TE)(scores_TE, bias_E, top_k, n_group, topk_group, top2_groups)


def route_weights(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                  top2_groups: bool, sigmoid: bool, norm_topk_prob: bool, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The router's whole decision for inference (no gradient), from its logits fp32 [T, E]: scores (sigmoid, or
    softmax over the experts), ids as `route_topk` on them, and each chosen expert's weight, its score (normalized
    over the K when norm_topk_prob) times `scale` (routed_scaling_factor) -> (ids [T, K] int64, weights [T, K]
    fp32). What `model.moe.Router.forward` computes after its linear, in one kernel on GPUs (the decode step)."""
    _check_routing("route_weights", "logits", logits_TE, bias_E, top_k, n_group, topk_group)
    return registry.get("route_weights", logits_TE)(logits_TE, bias_E, top_k, n_group, topk_group, top2_groups,
                                                    sigmoid, norm_topk_prob, scale)  # fmt: skip


def set_grad_destination(param: torch.Tensor, buffer: torch.Tensor | None, start: int = 0) -> None:
    """Where a backend may write `param`'s gradient itself: `buffer[start:start + numel]` (same dtype as the
    parameter while the gradient is computed), or None to forget it. The trainer's working copy points each weight
    at its rows of the flat gradient buffer (train/precision.py), so that a backend that computes a weight gradient
    in a kernel of its own (the Triton routed experts) writes it there and nothing copies it again."""
    if buffer is None:
        param.__dict__.pop("_anyseek_grad_dest", None)
    else:
        param._anyseek_grad_dest = (buffer, start)


def grad_destination(param: torch.Tensor) -> torch.Tensor | None:
    """A fresh view of `param`'s gradient destination (see `set_grad_destination`) shaped like it, or None. Fresh:
    autograd then keeps the returned tensor as `.grad` instead of copying it."""
    dest = getattr(param, "_anyseek_grad_dest", None)
    if dest is None:
        return None
    buffer, start = dest
    if buffer.dtype != param.dtype:
        return None
    return buffer[start:start + param.numel()].view(param.shape)


def grad_destinations(params) -> torch.Tensor | None:
    """One flat view over the gradient destinations of `params` (see `set_grad_destination`) where they lie back to
    back, in that order, in one buffer of the parameters' dtype; else None. For a backend that computes several
    weights' gradients into one buffer (the LoRA routed experts' four adapters)."""
    dests = [getattr(p, "_anyseek_grad_dest", None) for p in params]
    if not dests or any(d is None for d in dests):
        return None
    buffer, start = dests[0]
    at = start
    for p, (buf, s) in zip(params, dests):
        if buf is not buffer or s != at or buf.dtype != p.dtype:
            return None
        at += p.numel()
    return buffer[start:at]


def low_rank_merge(W: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   b_out: torch.Tensor | None = None, b_at: int = 0) -> torch.Tensor:  # fmt: skip
    """W + scale * B A -> [O, I] in W's dtype, from W [O, I], B [O, r], A [r, I] (one dtype), the products summed in
    fp32: a weight with a low-rank update folded in (LoRA's merged weight, `model.concat`). out: an [O, I] tensor
    to write it to (not W), else a new one. b_out: an [O, RT] tensor (RT >= b_at + r) that also receives B, in its
    columns b_at .. b_at + r - 1, and zeros in the others (LoRA's backward: [W + s B A | B] as one matrix)."""
    if W.dim() != 2 or B.dim() != 2 or A.dim() != 2 or B.shape[0] != W.shape[0] or A.shape[1] != W.shape[1] \
            or B.shape[1] != A.shape[0]:
        raise ValueError(f"low_rank_merge: W [O, I], B [O, r], A [r, I] expected, got W {tuple(W.shape)}, "
                         f"B {tuple(B.shape)}, A {tuple(A.shape)}")
    if not W.dtype == B.dtype == A.dtype:
        raise ValueError(f"low_rank_merge: W, B, A must share a dtype, got {W.dtype}, {B.dtype}, {A.dtype}")
    if out is not None and (out.shape != W.shape or out.dtype != W.dtype):
        raise ValueError(f"low_rank_merge: out must be {tuple(W.shape)} {W.dtype}, got {tuple(out.shape)} {out.dtype}")
    if b_out is not None and (b_out.dim() != 2 or b_out.shape[0] != W.shape[0] or b_out.dtype != W.dtype
                              or not 0 <= b_at <= b_out.shape[1] - B.shape[1]):  # fmt: skip
        raise ValueError(f"low_rank_merge: b_out must be [{W.shape[0]}, >= {b_at} + {B.shape[1]}] {W.dtype} (b_at "
                         f"{b_at}), got {tuple(b_out.shape)} {b_out.dtype}")
    return registry.get("low_rank_merge", W)(W, B, A, scale, out, b_out, b_at)


def low_rank_linear(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B, xd: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    """x W^T + scale (xd A^T) B^T -> [..., out]: a linear layer with a low-rank term beside its weight (LoRA), without
    keeping W + s B A or a gradient of W's size. x [..., in], W [out, in], A [r, in], B [out, r]; xd (x's shape, or
    None: x itself) is the term's own input (x after dropout). B may also be a list of blocks [(first output column,
    B_i [o_i, r_i]), ...] over A's rows in order, r = sum of r_i: a block-diagonal B without forming it (layers
    joined by `model.concat.fused_linear`, each block adding into its own layer's columns). W may be a 4-bit frozen
    weight, packed uint8 [out, 17 in / 32] (`quantize4`; it gets no gradient). Computes in autocast's
    dtype where autocast is on (as F.linear would), else in x's; gradients for every input that wants one."""
    blocks = [(0, B)] if torch.is_tensor(B) else list(B)
    quant = W.dtype == torch.uint8  # a 4-bit frozen weight, packed [out, 17 in / 32] (reference/quant4.py)
    k = in_features4(W) if quant and W.dim() == 2 else W.shape[-1]
    if W.dim() != 2 or A.dim() != 2 or A.shape[1] != k or x.shape[-1] != k:
        raise ValueError(f"low_rank_linear: x [..., in], W [out, in], A [r, in] expected, got x {tuple(x.shape)}, "
                         f"W {tuple(W.shape)}{' (4-bit packed: in = ' + str(k) + ')' if quant else ''}, "
                         f"A {tuple(A.shape)}")
    if xd is not None and xd.shape != x.shape:
        raise ValueError(f"low_rank_linear: xd {tuple(xd.shape)} must have x's shape {tuple(x.shape)}")
    r0 = 0
    for at, b in blocks:
        if b.dim() != 2 or not 0 <= at <= W.shape[0] - b.shape[0]:
            raise ValueError(f"low_rank_linear: a B block [o, r] at output column {at} must lie within W's "
                             f"{W.shape[0]} rows, got {tuple(b.shape)}")
        r0 += b.shape[1]
    if r0 != A.shape[0]:
        raise ValueError(f"low_rank_linear: B's ranks add up to {r0}, A has {A.shape[0]} rows")
    return registry.get("quant4_linear" if quant else "low_rank_linear", x)(x, W, A, B, xd, scale)


def lora_routed_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor, A_gu: torch.Tensor, B_gu: torch.Tensor,
                        A_dn: torch.Tensor, B_dn: torch.Tensor, scale: float, add_TD: torch.Tensor | None = None
                        ) -> torch.Tensor:  # fmt: skip
    """`routed_experts` on the effective weights W + scale * B A of each expert, for frozen stacks (no gradient)
    gate_up [E, F, D] and down [E, D, I] with per-expert adapters A_gu [E, r, D], B_gu [E, F, r], A_dn [E, r, I],
    B_dn [E, D, r] (LoRA's routed experts, `transforms.lora.LoRAExperts`); or both stacks packed in 4 bits
    (uint8 [E, F, 17D/32] and [E, D, 17I/32], `quantize4`: a 4-bit frozen base). Gradients: x, topk_weights, the
    four adapters and add_TD. -> [T, D] as `routed_experts`. A backend need not form the effective weights (the
    Triton one does not, nor the [E, F, D] gradients: it adds the rank-r terms inside its GEMMs)."""
    quant = gate_up_EFD.dtype == torch.uint8  # 4-bit frozen stacks, packed [E, F, 17D/32], [E, D, 17I/32]
    if quant != (down_EDI.dtype == torch.uint8):
        raise ValueError(f"lora_routed_experts: gate_up ({gate_up_EFD.dtype}) and down ({down_EDI.dtype}) must both "
                         "be packed 4-bit (uint8) or neither")
    E, F, D = (*gate_up_EFD.shape[:2], in_features4(gate_up_EFD)) if quant else gate_up_EFD.shape
    I, r = in_features4(down_EDI) if quant else down_EDI.shape[-1], A_gu.shape[1]
    want = {"A_gu": (E, r, D), "B_gu": (E, F, r), "A_dn": (E, r, I), "B_dn": (E, D, r)}
    got = {"A_gu": A_gu, "B_gu": B_gu, "A_dn": A_dn, "B_dn": B_dn}
    bad = [f"{n} {tuple(got[n].shape)} (want {w})" for n, w in want.items() if tuple(got[n].shape) != w]
    if bad or down_EDI.shape[:2] != (E, D):
        raise ValueError(f"lora_routed_experts: gate_up {tuple(gate_up_EFD.shape)}, down {tuple(down_EDI.shape)} "
                         f"and adapters of rank {r} do not fit: {', '.join(bad) or 'down must be [E, D, I]'}")
    if add_TD is not None and add_TD.shape != x_TD.shape:
        raise ValueError(f"lora_routed_experts: add_TD {tuple(add_TD.shape)} must have x's shape {tuple(x_TD.shape)}")
    fn = registry.get("quant4_routed_experts" if quant else "lora_routed_experts", x_TD)
    return fn(x_TD, topk_ids_TK, topk_weights_TK, gate_up_EFD, down_EDI, A_gu, B_gu, A_dn, B_dn, scale, add_TD)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T (no bias) with DeepSeek-V3's FP8 recipe -> [..., out] in autocast's dtype where autocast is on, else in
    x's: x [..., in] quantized to E4M3 in 1x128 tiles, W [out, in] (the fp32 master or its bf16 working copy) in
    128x128 blocks, scales from the current tensors, fp32 promotion every 128 products; backward in FP8 too (Dgrad,
    and Wgrad in fp32, returned in W's dtype). Used by `transforms.fp8` (`train.precision = "fp8"`); the reference
    backend emulates the same quantization in PyTorch (`kernels/reference/fp8.py`)."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x [..., in] and weight [out, in] expected, got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    return registry.get("fp8_linear", x)(x, weight)


def fp8_routed_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       gate_up_proj_EFD: torch.Tensor, down_proj_EDI: torch.Tensor,
                       add_TD: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`routed_experts` (same arguments, same maths, slot id E: no expert) with DeepSeek-V3's FP8 recipe: x per 1x128
    tile, each expert's weights per 128x128 block, the weighted SwiGLU output per 1x128 tile, grouped GEMMs promoted
    every 128 products; backward in FP8 too (the weight gradients over each expert's rows in 1x128 tiles along them,
    fp32, returned in the weights' dtype). Used by `transforms.fp8` (`train.precision = "fp8"`)."""
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape != topk_weights_TK.shape or topk_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"fp8_routed_experts: topk_ids {tuple(topk_ids_TK.shape)} and topk_weights "
                         f"{tuple(topk_weights_TK.shape)} must both be [T, K] with T = {x_TD.shape[0]}")
    E, F, D = gate_up_proj_EFD.shape
    if D != x_TD.shape[1] or F % 2 or down_proj_EDI.shape != (E, D, F // 2):
        raise ValueError(f"fp8_routed_experts: gate_up_proj {tuple(gate_up_proj_EFD.shape)} must be [E, 2I, D] and "
                         f"down_proj {tuple(down_proj_EDI.shape)} [E, D, I] with D = {x_TD.shape[1]}")
    if add_TD is not None and add_TD.shape != x_TD.shape:
        raise ValueError(f"fp8_routed_experts: add_TD {tuple(add_TD.shape)} must have x's shape {tuple(x_TD.shape)}")
    fn = registry.get("fp8_routed_experts", x_TD)
    return fn(x_TD, topk_ids_TK, topk_weights_TK, gate_up_proj_EFD, down_proj_EDI, add_TD)


def fp8_pack_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows as expert parallelism's FP8 dispatch sends them: x [M, D] -> (E4M3 codes as bytes [M, D] uint8, scales
    [M, ceil(D/128)] fp32, one per 1x128 tile, powers of two: DeepSeek-V3's for the activations it dispatches).
    `fp8_unpack_rows` gives back the quantized values exactly; the routed experts' FP8 GEMMs quantize them again to
    the same values (their input has power-of-two scales too), so a row's trip costs no second rounding."""
    if x.dim() != 2:
        raise ValueError(f"fp8_pack_rows: rows [M, D] expected, got {tuple(x.shape)}")
    return registry.get("fp8_pack_rows", x)(x)


def fp8_unpack_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8_pack_rows`' bytes [M, D] and scales [M, ceil(D/128)] -> the rows' values [M, D] in `dtype`."""
    if q.dim() != 2 or q.dtype != torch.uint8 or scales.shape != (q.shape[0], -(-q.shape[1] // 128)):
        raise ValueError(f"fp8_unpack_rows: uint8 codes [M, D] and scales [M, ceil(D/128)] expected, got "
                         f"{q.dtype} {tuple(q.shape)} and {tuple(scales.shape)}")
    return registry.get("fp8_unpack_rows", q)(q, scales, dtype)


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) of a 1-D tensor, accumulated and returned in fp32 (0-dim)."""
    return registry.get("sq_norm", x)(x)


__all__ = ["adamw_flat", "adamw_tensors", "add_rms_norm", "cross_entropy_rows", "dequantize4", "describe",
           "fp8_linear", "fp8_pack_rows", "fp8_routed_experts", "fp8_unpack_rows", "grad_destination", "in_features4",
           "lora_routed_experts", "low_rank_linear", "low_rank_merge", "mla_attention", "mla_decode", "quantize4",
           "registry", "rms_norm", "rope_rotate", "route_topk", "route_weights", "routed_experts", "set_backend",
           "set_grad_destination", "sq_norm", "swiglu", "varlen_attention"]
