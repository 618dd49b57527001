"""One-token decode steps on the CPU: the same maths as `layers.py` in few, large PyTorch ops.

On a CPU nothing replays a captured step the way a CUDA graph does: every PyTorch op costs a few microseconds of
Python and dispatch, and at small model sizes those microseconds are the whole step (the `tiny` flavor: ~1,700 ops
and ~6 ms per token through the general path, of which the arithmetic is ~0.1 ms). This path cuts the op count
per layer to ~17 for MLA and ~5 for a dense MLP or (small) MoE, by repacking the weights once per model:

    MLA   x -> [kv_a | q_a] (one matmul) -> q_a_layernorm -> q in latent space (W_UK and the softmax scale folded
          into q_b_proj) -> RoPE in place on q_pe and k_pe (their rows permuted to the interleaved pair layout)
          -> write [latent | k_pe] to the cache -> scores over the cached rows -> softmax -> o_lat
          -> o_proj with W_UV folded in, the residual added by the same matmul (addmm)
    MoE   x -> [router | every expert's gate | every expert's up] (one matmul) -> routing (the model's own rules)
          -> silu(gate) * up * (routing weight, 0 where not chosen; 1 for shared experts) -> one down matmul
          (routed_scaling_factor folded into the routed experts' down weights), the residual added by addmm

A fold is used only where it does not add multiplies (it does for large heads: DeepSeek-V3's W_UK folded into
q_b_proj would triple q's projection), and the all-experts MoE only while the wasted expert work is cheaper than the
ops of gathering the chosen experts' weights; otherwise the general `layers.ffn_forward` runs. Folded weights are
products computed in fp64 and rounded once, so the logits match the general path to fp32 precision.
Shape legend: B sequences (one new token each), D hidden, H heads, N nope dim, R rope dim, V v dim,
L kv_lora_rank, Q q_lora_rank, E routed experts, I expert intermediate, S cached tokens attended, X = L + R.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from anyseek.infer.layers import ffn_forward
from anyseek.kernels.reference.router import route_topk
from anyseek.model.moe import MLP

# The all-experts form wastes B * (E - K) expert evaluations; the gathered form costs ~8 more ops (~25 us here, a
# 2-core VM) -- about what 1M wasted multiply-adds cost. Above this, gather the chosen experts instead.
DENSE_MOE_WASTE = 1_000_000


# Weights are kept as [in, out] (x @ W): MKL's small-batch sgemm is 1.2-1.5x faster that way here (AMD EPYC,
# 2 threads), except for the lm_head from 4 rows on (its [vocab, D] layout: 170 vs 200 us at 8 rows).
HEAD_VD_BATCH = 4


@dataclass
class _Attn:
    w_in: torch.Tensor  # [D, X + Qin]: x -> [kv_a | q_a] (or [kv_a | q] without q_lora), input norm weight folded
    eps: float  # the input norm's
    w_q: torch.Tensor | None  # [Q, H * C]: q_a -> q (q_a_layernorm weight and softmax scale folded; None: no q_lora)
    q_eps: float
    kv_norm: torch.Tensor  # kv_a_layernorm weight [L]: cached latents are normalized
    kv_eps: float
    w_uk: torch.Tensor | None  # [H, N, L] when W_UK is not folded into q (C = N + R; else C = X)
    w_o: torch.Tensor  # [H * L, D] (W_UV folded) or [H * V, D]
    w_uv: torch.Tensor | None  # [H, L, V] when W_UV is not folded into o_proj


@dataclass
class _Ffn:
    w_in: torch.Tensor  # [D, (router E |) gate F | up F], the post-attention norm weight folded
    w_down: torch.Tensor  # [F, D]
    eps: float
    norm: torch.Tensor  # the post-attention norm weight (for the gathered-experts fallback)
    n_router: int  # E for a MoE, 0 for a dense MLP
    width: int  # F = (E + shared) * I, or the MLP's intermediate size
    group: int  # I: the width of one expert (a MoE)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def _pair_rows(R: int, interleave: bool) -> torch.Tensor:
    """Row order that makes a rope projection produce (re_0, im_0, re_1, im_1, ...): the pairs `apply_rope` uses."""
    return torch.arange(R) if interleave else torch.arange(R).view(2, R // 2).T.reshape(-1)


def _pack_attn(m, norm) -> _Attn:
    H, N, R, V, L = m.n_heads, m.nope, m.rope, m.v_dim, m.kv_lora_rank
    dt = m.kv_b_proj.weight.dtype
    perm = _pair_rows(R, m.rope_interleave)
    kv_a = _f64(m.kv_a_proj_with_mqa.weight)
    kv_a = torch.cat([kv_a[:L], kv_a[L:][perm]])  # [X, D]
    w_kvb = _f64(m.kv_b_proj.weight).view(H, N + V, L)
    w_uk_HNL, w_uv_HVL = w_kvb[:, :N], w_kvb[:, N:]
    lora = hasattr(m, "q_a_proj")
    wq = _f64(m.q_b_proj.weight if lora else m.q_proj.weight)
    Qin = wq.shape[1]
    wq_HCQ = wq.view(H, N + R, Qin) * m.softmax_scale
    q_pe_HRQ = wq_HCQ[:, N:][:, perm]
    fold_q = H * (L + R) <= H * (N + R) + H * N * L / Qin  # multiplies per token: folded vs q_b then W_UK
    if fold_q:
        q_lat_HLQ = torch.matmul(w_uk_HNL.transpose(1, 2), wq_HCQ[:, :N])
        wq_out = torch.cat([q_lat_HLQ, q_pe_HRQ], dim=1).reshape(-1, Qin)  # [H * X, Qin]
    else:
        wq_out = torch.cat([wq_HCQ[:, :N], q_pe_HRQ], dim=1).reshape(-1, Qin)  # [H * (N + R), Qin]
    w_o = _f64(m.o_proj.weight)  # [D, H * V]
    D = w_o.shape[0]
    fold_o = D * H * L <= H * L * V + D * H * V
    if fold_o:
        w_o_out = torch.einsum("dhv,hvl->dhl", w_o.view(D, H, V), w_uv_HVL).reshape(D, H * L)
    else:
        w_o_out = w_o
    if lora:  # rmsnorm(x) @ W^T = rstd(x) * (x @ (W * w_norm)^T): norm weights go into the next matmul
        w_in = torch.cat([kv_a, _f64(m.q_a_proj.weight)])
        w_q = (wq_out * _f64(m.q_a_layernorm.weight)).T.to(dt).contiguous()
    else:
        w_in, w_q = torch.cat([kv_a, wq_out]), None
    return _Attn(
        w_in=(w_in * _f64(norm.weight)).T.to(dt).contiguous(), eps=norm.eps, w_q=w_q,
        q_eps=m.q_a_layernorm.eps if lora else 0.0, kv_norm=m.kv_a_layernorm.weight.detach(),
        kv_eps=m.kv_a_layernorm.eps, w_uk=None if fold_q else w_uk_HNL.to(dt).contiguous(),
        w_o=w_o_out.T.to(dt).contiguous(), w_uv=None if fold_o else w_uv_HVL.transpose(1, 2).to(dt).contiguous(),
    )  # fmt: skip


def _pack_ffn(mlp, norm) -> _Ffn:
    w_norm, dt = _f64(norm.weight), norm.weight.dtype
    if isinstance(mlp, MLP):
        w_in = torch.cat([_f64(mlp.gate_proj.weight), _f64(mlp.up_proj.weight)]) * w_norm
        return _Ffn(w_in.T.to(dt).contiguous(), mlp.down_proj.weight.detach().T.contiguous(), norm.eps,
                    norm.weight.detach(), 0, mlp.gate_proj.out_features, 0)  # fmt: skip
    gate_up_EFD, down_EDI = _f64(mlp.experts.gate_up_proj), _f64(mlp.experts.down_proj)
    E, D, I = down_EDI.shape
    dt = mlp.experts.down_proj.dtype
    gates, ups = [gate_up_EFD[:, :I].reshape(E * I, D)], [gate_up_EFD[:, I:].reshape(E * I, D)]
    downs = [down_EDI.transpose(1, 2).reshape(E * I, D) * mlp.gate.routed_scaling_factor]
    if hasattr(mlp, "shared_experts"):
        sh = mlp.shared_experts
        gates.append(_f64(sh.gate_proj.weight))
        ups.append(_f64(sh.up_proj.weight))
        downs.append(_f64(sh.down_proj.weight).T)
    gate, up = torch.cat(gates), torch.cat(ups)
    w_in = torch.cat([_f64(mlp.gate.weight), gate, up]) * w_norm
    return _Ffn(w_in.to(dt).T.contiguous(), torch.cat(downs).to(dt).contiguous(), norm.eps, norm.weight.detach(), E,
                gate.shape[0], I)  # fmt: skip


@dataclass
class _Packed:
    layers: list[tuple[_Attn, _Ffn]]
    head: torch.Tensor  # [D, vocab]: lm_head with the final norm weight folded
    head_vd: torch.Tensor  # [vocab, D]: the same in nn.Linear's layout
    eps: float


def _pack(model) -> _Packed:
    with torch.no_grad():
        layers = [(_pack_attn(lay.self_attn, lay.input_layernorm), _pack_ffn(lay.mlp, lay.post_attention_layernorm))
                  for lay in model.model.layers]  # fmt: skip
        n = model.model.norm
        head_vd = (_f64(model.lm_head.weight) * _f64(n.weight)).to(n.weight.dtype)
    return _Packed(layers, head_vd.T.contiguous(), head_vd, n.eps)


_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_key(model) -> tuple:
    """Changes whenever a weight of the trunk is replaced or updated in place (training between generate calls)."""
    return tuple((t.data_ptr(), t._version) for t in (*model.model.parameters(), *model.model.buffers()))


def packed_layers(model) -> _Packed:
    """The repacked weights of `model`'s layers, computed once per model and weights version."""
    key = _weights_key(model)
    hit = _PACKS.get(model)
    if hit is None or hit[0] != key:
        hit = (key, _pack(model))
        _PACKS[model] = hit
    return hit[1]


# Repacking copies the trunk's weights. Above this size a step's matmuls take far longer than its ops' overhead
# (tens of ms per token against ~1 ms), so the copy would buy nothing and cost memory: the general path runs.
REPACK_MAX_BYTES = 1 << 30


def supports(model) -> bool:
    """The CPU path covers fp32 models up to REPACK_MAX_BYTES whose RoPE pair views line up (even L, R, N, Q)."""
    c, w = model.config, model.lm_head.weight
    even = all(v % 2 == 0 for v in (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.q_lora_rank or 0))
    size = sum(p.numel() * p.element_size() for p in model.model.parameters())
    return w.device.type == "cpu" and w.dtype == torch.float32 and even and size <= REPACK_MAX_BYTES


def _rstd(x_BD: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) [B, 1] in 3 ops (torch.rms_norm is ~10 on the CPU)."""
    n_B1 = torch.linalg.vector_norm(x_BD, dim=-1, keepdim=True)
    eps_t = _EPS.get(eps)
    if eps_t is None:
        eps_t = _EPS[eps] = torch.tensor(eps, dtype=torch.float32)
    return torch.addcmul(eps_t, n_B1, n_B1, value=1.0 / x_BD.shape[-1]).rsqrt_()


_EPS: dict[float, torch.Tensor] = {}


class _Work:
    """Output buffers of one batch size's matmuls, and their views (slices, RoPE's complex pairs) made once: on a
    CPU every view is an op of its own."""

    def __init__(self, B: int, packed: _Packed, H: int, L: int, R: int):
        X, a = L + R, packed.layers[0][0]  # every layer has the same shapes
        self.y = torch.empty(B, a.w_in.shape[1])  # [kv_a | q_a] or [kv_a | q]
        self.kv, self.lat = self.y[:, :X], self.y[:, :L]
        self.k_rot = torch.view_as_complex(self.y[:, L:X].unflatten(-1, (R // 2, 2)))  # [B, R/2]
        self.q_a = self.y[:, X:]
        self.q = torch.empty(B, a.w_q.shape[1]) if a.w_q is not None else self.q_a
        C = self.q.shape[1] // H  # X (latent q) or N + R
        self.q_BHC = self.q.view(B, H, C)
        self.q_rot = torch.view_as_complex(self.q_BHC[..., C - R :].unflatten(-1, (R // 2, 2)))  # [B, H, R/2]
        self.ffn: dict[int, tuple] = {}
        for _, f in packed.layers:
            if f.width not in self.ffn:
                E, F_ = f.n_router, f.width
                y = torch.empty(B, f.w_in.shape[1])  # [router logits E | gate F | up F]
                act = torch.empty(B, F_)
                I = f.group or F_  # a dense MLP: one group
                shared = torch.zeros(B, F_ // I)  # 0: routed (the routing weights are scattered in), 1: shared
                shared[:, E:] = 1.0
                self.ffn[F_] = (y, y[:, :E], y[:, E : E + F_], y[:, E + F_ :], act, act.view(B, -1, I), shared)


class CpuDecoder:
    """Runs one-token steps of `model` over a `PagedLatentCache` (its main layers 0..n-1) whose pages the engine
    hands out in whole blocks of `per_seq` consecutive pages per sequence: then a sequence's cached rows are one
    slice of the cache, and a batch of sequences on consecutive blocks one strided view (no gather)."""

    def __init__(self, model, cache, max_len: int, per_seq: int):
        self.model, self.cache = model, cache
        c = model.config
        self.H, self.L, self.R = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.N, self.K = c.qk_nope_head_dim, c.num_experts_per_tok
        cos, sin = model.rotary(torch.arange(max_len))
        self.rot_PR = torch.complex(cos, sin)  # [positions, R/2]: the same values `apply_rope` multiplies by
        kv = cache.kv  # [layers, 1 + blocks * per_seq, page, X]: page 0 is scratch
        self.per_seq = per_seq
        self.blocks = kv[:, 1:].view(kv.shape[0], -1, per_seq * cache.page, kv.shape[-1])  # [layers, blocks, rows, X]
        self.flat = [kv[i].view(-1, kv.shape[-1]) for i in range(kv.shape[0])]
        self.mlps = [layer.mlp for layer in model.model.layers]
        self.refresh()

    def refresh(self) -> None:
        """Pick up the model's current weights (repacked only if they changed)."""
        self.packed = packed_layers(self.model)
        self._work: dict[int, _Work] = {}

    def block_of(self, pages: list[int]) -> int | None:
        """The block a sequence's pages form, or None when they are not one whole block."""
        n = self.per_seq
        p0 = pages[0] if pages else 1
        if len(pages) != n or (p0 - 1) % n or pages != list(range(p0, p0 + n)):
            return None
        return (p0 - 1) // n

    @torch.inference_mode()
    @torch.autocast("cpu", enabled=False)  # its own weights' dtype (out= buffers); CPU autocast (train.dtype=bf16)
    def step(self, ids_B: torch.Tensor, pos_B: torch.Tensor, slots_B: torch.Tensor, rows: int | torch.Tensor,
             mask_B1S: torch.Tensor | None, S: int) -> torch.Tensor:  # fmt: skip
        """ids, positions, cache slots (flat rows) [B]; rows: the first of B consecutive blocks holding the batch's
        sequences in order, or their block ids [B]; mask [B, 1, S] = 0 / -inf past each sequence's end (None: all
        S rows); S = tokens attended -> logits fp32 [B, V]."""
        pk, L, B = self.packed, self.L, ids_B.shape[0]
        ws = self._work.get(B) or self._work.setdefault(B, _Work(B, pk, self.H, L, self.R))
        rot_BR = self.rot_PR.index_select(0, pos_B)
        rot_B1R = rot_BR[:, None]
        ctx = None
        if isinstance(rows, int):  # views of the cache: they see each layer's write of the new token
            c_ABSX = self.blocks[:, rows : rows + B, :S]
            ctx = list(zip(c_ABSX.transpose(2, 3).unbind(0), c_ABSX[..., :L].unbind(0)))
        h_BD = F.embedding(ids_B, self.model.model.embed_tokens.weight)
        for i, (attn, ffn) in enumerate(pk.layers):
            c = ctx[i] if ctx is not None else (rows, S)
            h_BD = self._attn(ws, attn, h_BD, rot_BR, rot_B1R, slots_B, i, c, mask_B1S)
            h_BD = self._ffn(ws, self.mlps[i], ffn, h_BD)
        head = pk.head if B < HEAD_VD_BATCH else pk.head_vd.T
        return torch.mm(h_BD, head).mul_(_rstd(h_BD, pk.eps))

    def _rows(self, layer: int, blocks_B: torch.Tensor, S: int) -> tuple:
        """The first S rows of blocks [B] of one layer, gathered (after the layer wrote its new rows)."""
        c_BSX = self.blocks[layer][:, :S].index_select(0, blocks_B)
        return c_BSX.transpose(1, 2), c_BSX[..., : self.L]

    def _attn(self, ws: _Work, a: _Attn, h_BD, rot_BR, rot_B1R, slots_B, layer, c, mask_B1S) -> torch.Tensor:
        """c: the cache rows to attend as views ([B, X, S], [B, S, L]), or (block ids [B], S) to gather them after
        this layer's write."""
        B = h_BD.shape[0]
        torch.mm(h_BD, a.w_in, out=ws.y).mul_(_rstd(h_BD, a.eps))  # [kv_a | q_a] (or [kv_a | q])
        if a.w_q is not None:
            torch.mm(ws.q_a, a.w_q, out=ws.q).mul_(_rstd(ws.q_a, a.q_eps))
        ws.q_rot.mul_(rot_B1R)  # RoPE on q_pe and k_pe
        ws.k_rot.mul_(rot_BR)
        ws.lat.mul_(_rstd(ws.lat, a.kv_eps)).mul_(a.kv_norm)
        self.flat[layer].index_copy_(0, slots_B, ws.kv)
        c_BXS, c_BSL = c if isinstance(c[0], torch.Tensor) and c[0].dim() == 3 else self._rows(layer, *c)
        q_BHC = ws.q_BHC
        if a.w_uk is not None:  # q_nope -> latent space per head, then [q_lat | q_pe]
            q_lat_HBL = torch.bmm(q_BHC[..., : self.N].transpose(0, 1), a.w_uk)
            q_BHC = torch.cat([q_lat_HBL.transpose(0, 1), q_BHC[..., self.N :]], dim=-1)
        if mask_B1S is None:
            s_BHS = torch.bmm(q_BHC, c_BXS)
        else:
            s_BHS = torch.baddbmm(mask_B1S, q_BHC, c_BXS)
        o_BHL = torch.bmm(torch.softmax(s_BHS, dim=-1), c_BSL)
        if a.w_uv is not None:
            o_BHL = torch.bmm(o_BHL.transpose(0, 1), a.w_uv).transpose(0, 1)
        return torch.addmm(h_BD, o_BHL.reshape(B, -1), a.w_o)

    def _ffn(self, ws: _Work, mlp, f: _Ffn, h_BD) -> torch.Tensor:
        B, D = h_BD.shape
        E = f.n_router
        if E and B * (E - self.K) * 3 * f.group * D > DENSE_MOE_WASTE:  # gather the chosen experts' weights
            return h_BD + ffn_forward(mlp, torch.rms_norm(h_BD, (D,), f.norm, f.eps))  # (the general decode path)
        y_BW, logits_BE, g_BF, u_BF, act_BF, act_BGI, shared_BG = ws.ffn[f.width]
        torch.mm(h_BD, f.w_in, out=y_BW).mul_(_rstd(h_BD, f.eps))
        torch.mul(F.silu(g_BF), u_BF, out=act_BF)
        if E:
            act_BGI.mul_(_route(mlp.gate, logits_BE, shared_BG)[:, :, None])
        return torch.addmm(h_BD, act_BF, f.w_down)


def _route(gate, logits_BE: torch.Tensor, shared_BG: torch.Tensor) -> torch.Tensor:
    """The Router's choice from its logits (the selection is the CPU twin of `kernels.route_topk`, called directly:
    no registry lookup per layer and token) -> weights [B, G]: each token's routing weight for its chosen experts, 0
    for the others, then 1 for each shared-expert group."""
    scores_BE = logits_BE.sigmoid() if gate.scoring_func == "sigmoid" else logits_BE.softmax(dim=-1)
    ids_BK = route_topk(scores_BE, gate.e_score_correction_bias, gate.top_k, gate.n_group, gate.topk_group,
                        gate.scoring_func == "sigmoid")
    w_BK = scores_BE.gather(1, ids_BK)
    if gate.norm_topk_prob:
        w_BK = w_BK.div_(w_BK.sum(dim=-1, keepdim=True).add_(1e-20))
    return shared_BG.scatter(1, ids_BK, w_BK)
