"""Fused elementwise kernels (`kernels.rms_norm`, ...): the Triton backends against their pure-PyTorch twins, on CPU
under TRITON_INTERPRET=1 (in a subprocess: the variable never leaks) and on a GPU (marked cuda).

The rule: max|kernel - fp32 reference| <= 2 * max|PyTorch at the same precision - fp32 reference| + a small atol,
for the output and every gradient.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

# (name, leading shape, D, x dtype, weight dtype, strided input)
NORM_CASES = [
    ("fp32_odd", (37,), 100, "float32", "float32", False),
    ("fp16_x_fp32_w", (5, 7), 64, "float16", "float32", False),
    ("fp16_all", (19,), 33, "float16", "float16", False),
    ("fp16_strided_rows", (23,), 48, "float16", "float32", True),
    ("one_row", (1,), 7, "float32", "float32", False),
    ("fp16_frozen_w", (21,), 40, "float16", "float32", False, True),
]


def norm_errors(lead, D, x_dtype, w_dtype, strided, device, seed=0, frozen_w=False):
    """[(what, err kernel, err torch)] for rms_norm's output, dx and dw against an fp32 (fp64 on GPU) reference.
    frozen_w: the weight needs no gradient (LoRA): w.grad must stay None (the kernel skips the partials)."""
    from anyseek.kernels.reference.norm import rms_norm as ref
    from anyseek.kernels.triton.rmsnorm import rms_norm as fused

    g = torch.Generator().manual_seed(seed)
    width = D + 5 if strided else D
    x_full = (torch.randn(*lead, width, generator=g) * 3).to(device=device, dtype=x_dtype)
    x0 = x_full[..., :D]
    w0 = (1 + 0.5 * torch.randn(D, generator=g)).to(device=device, dtype=w_dtype)
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    dout = torch.randn(*lead, D, generator=g).to(device=device, dtype=out_dtype)
    exact = torch.float64 if device != "cpu" else torch.float32

    def run(fn, dt_x, dt_w):
        x = x0.detach().to(dt_x).requires_grad_()
        w = w0.detach().to(dt_w).requires_grad_(not frozen_w)
        y = fn(x, w, 1e-6)
        y.backward(dout.to(y.dtype))
        if frozen_w:
            assert w.grad is None
            w.grad = torch.zeros_like(w)
        return [t.detach().to(exact) for t in (y, x.grad, w.grad)], y.dtype

    want, _ = run(ref, exact, exact)
    torch_low, dt_torch = run(ref, x_dtype, w_dtype)
    ours, dt_ours = run(fused, x_dtype, w_dtype)
    assert dt_ours == dt_torch, (dt_ours, dt_torch)
    return [(what, (o - r).abs().max().item(), (t - r).abs().max().item())
            for what, o, t, r in zip(("out", "dx", "dw"), ours, torch_low, want)]


def add_norm_errors(lead, D, x_dtype, y_dtype, w_dtype, use_h, device, seed=0, uses=(True,), frozen_w=False):
    """[(what, err kernel, err torch)] for add_rms_norm's h, out, dx, dy and dw against an fp32 (fp64 on GPU)
    reference. use_h: the residual h feeds the loss too (its gradient is added in the kernel), else only the norm.
    uses: the output asked for len(uses) times (`copies`), each copy with its own gradient where True and unused
    where False (the kernel sums the copies' gradients). frozen_w: the weight needs no gradient, as `norm_errors`."""
    from anyseek.kernels.reference.norm import add_rms_norm as ref
    from anyseek.kernels.triton.rmsnorm import add_rms_norm as fused

    g = torch.Generator().manual_seed(seed)
    x0 = (torch.randn(*lead, D, generator=g) * 3).to(device=device)
    y0 = (torch.randn(*lead, D, generator=g) * 2).to(device=device)
    w0 = (1 + 0.5 * torch.randn(D, generator=g)).to(device=device)
    dh = torch.randn(*lead, D, generator=g).to(device=device)
    douts = [torch.randn(*lead, D, generator=g).to(device=device) for _ in uses]
    exact = torch.float64 if device != "cpu" else torch.float32

    def run(fn, dx_, dy_, dw_):
        x = x0.detach().to(dx_).requires_grad_()
        y = y0.detach().to(dy_).requires_grad_()
        w = w0.detach().to(dw_).requires_grad_(not frozen_w)
        h, *outs = fn(x, y, w, 1e-6, len(uses))
        assert len(outs) == len(uses)
        out = outs[0]
        loss = sum((o * d.to(o.dtype)).sum() for o, d, u in zip(outs, douts, uses) if u)
        loss = loss + ((h * dh.to(h.dtype)).sum() if use_h else 0)
        loss.backward()
        if not any(uses) or frozen_w:
            assert w.grad is None
            w.grad = torch.zeros_like(w)
        return [t.detach().to(exact) for t in (h, out, x.grad, y.grad, w.grad)], (h.dtype, out.dtype)

    want, _ = run(ref, exact, exact, exact)
    torch_low, dts = run(ref, x_dtype, y_dtype, w_dtype)
    ours, dto = run(fused, x_dtype, y_dtype, w_dtype)
    assert dto == dts, (dto, dts)
    return [(what, (o - r).abs().max().item(), (t - r).abs().max().item())
            for what, o, t, r in zip(("h", "out", "dx", "dy", "dw"), ours, torch_low, want)]


# (name, leading shape, D, x dtype, y dtype, weight dtype, h used)
ADD_NORM_CASES = [
    ("fp32_odd", (37,), 100, "float32", "float32", "float32", True),
    ("fp16_all", (5, 7), 64, "float16", "float16", "float16", True),
    ("fp16_fp32_w_norm_only", (19,), 33, "float16", "float16", "float32", False),
    ("fp32_residual_fp16_branch", (11,), 48, "float32", "float16", "float32", True),
    ("one_row", (1,), 7, "float32", "float32", "float32", True),
    ("fp16_three_copies", (13,), 64, "float16", "float16", "float32", True, (True, True, True)),
    ("fp32_three_copies_middle_unused", (9,), 40, "float32", "float32", "float32", False, (True, False, True)),
    ("fp16_two_copies_first_unused", (17,), 33, "float16", "float16", "float16", True, (False, True)),
    ("fp32_copies_all_unused", (5,), 24, "float32", "float32", "float32", True, (False, False, False)),
    ("fp16_two_copies_frozen_w", (15,), 48, "float16", "float16", "float32", True, (True, True), True),
]


def swiglu_errors(N, I, dtype, device, strided=False, seed=0):
    """[(what, err kernel, err torch)] for swiglu's output and d[gate | up] against an fp32 (fp64 on GPU) reference."""
    from anyseek.kernels.reference.swiglu import swiglu as ref
    from anyseek.kernels.triton.swiglu import swiglu as fused

    g = torch.Generator().manual_seed(seed)
    width = 2 * I + (6 if strided else 0)
    full = (torch.randn(N, width, generator=g) * 2).to(device=device)
    dout = torch.randn(N, I, generator=g).to(device=device)
    exact = torch.float64 if device != "cpu" else torch.float32

    def run(fn, dt):
        gu = full.to(dt)[:, :2 * I].detach().requires_grad_()
        out = fn(gu)
        out.backward(dout.to(out.dtype))
        assert gu.grad.shape == gu.shape
        return [t.detach().to(exact) for t in (out, gu.grad)], out.dtype

    want, _ = run(ref, exact)
    torch_low, dtt = run(ref, dtype)
    ours, dto = run(fused, dtype)
    assert dto == dtt == dtype
    return [(what, (o - r).abs().max().item(), (t - r).abs().max().item())
            for what, o, t, r in zip(("out", "dgu"), ours, torch_low, want)]


# (name, rows, I, dtype, strided rows)
SWIGLU_CASES = [
    ("fp32_odd", 37, 100, "float32", False),
    ("fp16_wide", 9, 1300, "float16", False),
    ("fp16_strided", 13, 64, "float16", True),
    ("one_row", 1, 3, "float32", False),
]


# (name, rows, V, logits dtype, logit scale, labels: "random" | "first" | "last" | "argmax")
XENT_CASES = [
    ("fp32_odd_vocab", 37, 1000, "float32", 3.0, "random"),
    ("fp16_many_blocks", 19, 2053, "float16", 3.0, "random"),
    ("fp32_edges", 8, 513, "float32", 3.0, "last"),
    ("fp32_first_label", 5, 300, "float32", 3.0, "first"),
    ("fp32_extreme", 6, 700, "float32", 80.0, "random"),  # the label's probability underflows
    ("fp16_confident", 9, 257, "float16", 12.0, "argmax"),
    ("one_row", 1, 17, "float32", 1.0, "random"),
]


def xent_errors(C, V, dtype, scale, labels_kind, device, seed=0):
    """[(what, err kernel, err torch)] for cross_entropy_rows' nll and gradient against fp64 maths; 'torch' is the
    reference twin on the same low-precision logits (PyTorch's fp32 softmax chain, the path it replaces)."""
    from anyseek.kernels.reference.xent import cross_entropy_rows as ref
    from anyseek.kernels.triton.xent import cross_entropy_rows as fused

    g = torch.Generator().manual_seed(seed)
    x0 = (torch.randn(C, V, generator=g) * scale).to(dtype)
    labels = {"random": torch.randint(0, V, (C,), generator=g), "first": torch.zeros(C, dtype=torch.long),
              "last": torch.full((C,), V - 1), "argmax": x0.float().argmax(-1)}[labels_kind]
    xd = x0.double()  # the oracle: fp64 maths (the twin always computes in fp32)
    want_nll = torch.logsumexp(xd, -1) - xd.gather(1, labels[:, None])[:, 0]
    want_g = torch.softmax(xd, -1).scatter_add_(1, labels[:, None], torch.full((C, 1), -1.0, dtype=torch.float64))
    low_nll, low_g = ref(x0.clone(), labels, True)
    nll, grad = fused(x0.clone().to(device), labels.to(device), True)
    nll_only, none = fused(x0.clone().to(device), labels.to(device), False)
    assert none is None and torch.equal(nll_only.cpu(), nll.cpu())
    assert grad.dtype == dtype and nll.dtype == torch.float32
    return [("nll", (nll.cpu().double() - want_nll).abs().max().item(), (low_nll.double() - want_nll).abs().max().item()),
            ("grad", (grad.cpu().double() - want_g).abs().max().item(), (low_g.double() - want_g).abs().max().item())]


# (name, elements, gradient dtype, working-copy dtype or None[, moments dtype])
ADAMW_CASES = [
    ("fp32_grad", 5003, "float32", None),
    ("fp16_grad_fp16_copy", 4099, "float16", "float16"),
    ("one", 1, "float32", "float16"),
    ("empty", 0, "float16", "float16"),
    ("bf16_moments", 4099, "float16", "float16", "bfloat16"),
    ("bf16_moments_one", 1, "float32", None, "bfloat16"),
]


def adamw_errors(n, grad_dtype, low_dtype, device, seed=0, moments_dtype=torch.float32):
    """[(what, max |kernel - reference|, allowed)] after 3 steps of `kernels.adamw_flat` (weight decay, a folded
    clip factor) and for `sq_norm`; both compute in fp32, so they may differ by a few fp32 roundings only (bf16
    moments: by one bf16 ulp where those roundings move a value across a stochastic-rounding threshold)."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype) for _ in range(3)]
    out = {}
    for name, mod in (("ref", ref), ("fused", fused)):
        dev = "cpu" if name == "ref" else device
        p = p0.clone().to(dev)
        m, v = torch.zeros(n, device=dev, dtype=moments_dtype), torch.zeros(n, device=dev, dtype=moments_dtype)
        low = torch.empty(n, dtype=low_dtype, device=dev) if low_dtype is not None else None
        for step, grad in enumerate(grads, 1):
            skip = torch.tensor(0.0, device=dev) if step == 2 else None  # a step the device flag lets through
            mod.adamw_flat(p, grad.to(dev), m, v, low, torch.tensor(1.5, device=dev), step, 1e-2, 0.9, 0.95, 1e-8, 0.1,
                           skip=skip, seed=1000 + step)
        before = [t.clone() for t in (p, m, v) + (() if low is None else (low,))]
        nan = torch.full((n,), float("nan"), device=dev).to(grad_dtype)  # a skipped step changes nothing at all
        mod.adamw_flat(p, nan, m, v, low, torch.tensor(float("nan"), device=dev), 4, 1e-2, 0.9, 0.95, 1e-8, 0.1,
                       skip=torch.tensor(1.0, device=dev))
        assert all(torch.equal(a, b) for a, b in zip(before, (p, m, v) + (() if low is None else (low,)))), name
        out[name] = [t.cpu().float() for t in (p, m, v)] + ([low.cpu().float()] if low is not None else [])
        out[name].append(mod.sq_norm(grads[0].to(dev)).cpu().reshape(1))
    names = ["p", "m", "v"] + (["low"] if low_dtype is not None else []) + ["sq_norm"]
    table = []
    for what, a, b in zip(names, out["fused"], out["ref"]):
        err = (a - b).abs().max().item() if a.numel() else 0.0
        tol = 1e-5 * max(1.0, b.abs().max().item() if b.numel() else 0.0)
        if what == "low" or (what in ("m", "v") and moments_dtype == torch.bfloat16):  # one rounding may land on
            tol = 2.0 ** -7 * max(1.0, b.abs().max().item() if b.numel() else 0.0)  # the other side
        if what == "p" and moments_dtype == torch.bfloat16:  # a moment one bf16 ulp apart (above) moves a later
            tol += 3 * 1e-2 * 2.0**-7  # update (at most lr = 1e-2 in size) by at most that fraction, for 3 steps
        table.append((what, err, tol))
    return table


# (name, shapes, grad dtype[, low copies' dtype]): `kernels.adamw_tensors` over tensors of these shapes
ADAMW_TENSORS_CASES = [
    ("fp32_odd_shapes", [(7,), (2049,), (3, 5), (0,), (1,), (2, 2100)], "float32"),
    ("fp16_grads", [(4100,), (33, 17)], "float16"),
    ("fp16_grads_fp16_lows", [(4100,), (0,), (33, 17), (1,)], "float16", "float16"),
]


def adamw_tensors_errors(shapes, grad_dtype, device, seed=0, low_dtype=None):
    """[(what, max |kernel - reference|, allowed)] after 3 steps of `adamw_tensors` over tensors whose step counts
    differ (the first starts at 5), one step let through by a zero skip flag and a skipped one (nothing may change:
    compared exactly). low_dtype: each weight also has a low-precision copy written from the new weights (compared
    with the reference's within one rounding of the weights' difference)."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    g = torch.Generator().manual_seed(seed)
    p0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(grad_dtype) for s in shapes] for _ in range(3)]
    out = {}
    for name, mod in (("ref", ref), ("fused", fused)):
        dev = "cpu" if name == "ref" else device
        ps = [t.clone().to(dev) for t in p0]
        ms, vs = [torch.zeros(s, device=dev) for s in shapes], [torch.zeros(s, device=dev) for s in shapes]
        steps = [torch.tensor(4.0 if i == 0 else 0.0, device=dev) for i in range(len(shapes))]
        lows = None if low_dtype is None else [torch.zeros(s, dtype=low_dtype, device=dev) for s in shapes]
        for k, gs in enumerate(grads):
            for st in steps:
                st += 1
            skip = torch.tensor(0.0, device=dev) if k == 1 else None
            mod.adamw_tensors(ps, [x.to(dev) for x in gs], ms, vs, steps, torch.tensor(1.5, device=dev), 1e-2, 0.9,
                              0.95, 1e-8, 0.1, skip=skip, lows=lows)  # fmt: skip
        kept = ps + ms + vs + (lows or [])
        before = [t.clone() for t in kept]
        nan = [torch.full(s, float("nan"), device=dev).to(grad_dtype) for s in shapes]
        mod.adamw_tensors(ps, nan, ms, vs, steps, torch.tensor(float("nan"), device=dev), 1e-2, 0.9, 0.95, 1e-8, 0.1,
                          skip=torch.tensor(1.0, device=dev), lows=lows)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(before, kept)), name
        out[name] = [torch.cat([t.cpu().reshape(-1) for t in ts]) for ts in (ps, ms, vs)]
        if lows is not None:  # the copy is the new weights rounded
            assert all(torch.equal(low.cpu(), p.cpu().to(low_dtype)) for low, p in zip(lows, ps)), name
            out[name].append(torch.cat([t.cpu().float().reshape(-1) for t in lows]))
    table = []
    for what, a, b in zip(("p", "m", "v", "low"), out["fused"], out["ref"]):
        ulp = 0.0 if what != "low" else b.abs().max().item() * torch.finfo(low_dtype).eps
        table.append((what, (a - b).abs().max().item(), 1e-5 * max(1.0, b.abs().max().item()) + ulp))
    return table


# (name, T, H or 0 for [T, R], R, dtype, interleaved_in, interleaved_out, conj, in place, strided rows)
ROPE_CASES = [
    ("fp32_q_inplace", 37, 3, 16, "float32", True, True, False, True, True),
    ("fp32_halves_to_pairs", 9, 2, 8, "float32", False, True, False, False, True),
    ("fp16_backward_to_halves", 21, 4, 64, "float16", True, False, True, True, True),
    ("fp16_k_rows", 33, 0, 64, "float16", False, True, False, False, True),
    ("fp32_one_token", 1, 1, 4, "float32", True, True, True, False, False),
]


def rope_errors(T, H, R, dtype, inter_in, inter_out, conj, inplace, strided, device, seed=0):
    """[(what, max |kernel - twin|, allowed)]: both rotate in fp32 and round once to dtype (one ulp apart at most)."""
    from anyseek.kernels.reference.rope import rope_rotate as ref
    from anyseek.kernels.triton.rope import rope_rotate as fused

    g = torch.Generator().manual_seed(seed)
    shape = (T, H, R + (6 if strided else 0)) if H else (T, R + (6 if strided else 0))
    base = torch.randn(*shape, generator=g).to(dtype)
    ang = torch.randn(T, R // 2, generator=g)
    cos, sin = ang.cos() * 1.1, ang.sin() * 1.1
    want = ref(base[..., -R:].clone(), cos, sin, None, inter_in, inter_out, conj)
    x = base.to(device)
    view = x[..., -R:]
    got = fused(view, cos.to(device), sin.to(device), view if inplace else None, inter_in, inter_out, conj)
    if inplace:
        assert got.data_ptr() == view.data_ptr() and torch.equal(x[..., :-R].cpu(), base[..., :-R])
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -20
    return [("out", (got.cpu().float() - want.float()).abs().max().item(), ulp * 4 * want.abs().max().item() + 1e-6)]


# (name, T, E, n_group, topk_group, top_k, V3's best-two group score, scores strided)
ROUTER_CASES = [
    ("v3_small", 37, 32, 4, 2, 4, True, False),
    ("v3_wide", 19, 256, 8, 4, 8, True, True),
    ("v2_groups_not_pow2", 23, 160, 8, 3, 6, False, False),
    ("one_group", 9, 16, 1, 1, 3, True, False),
    ("one_token_top1", 1, 64, 8, 1, 1, True, False),
]


def router_errors(T, E, G, TG, K, top2, strided, device, seed=0):
    """[(what, mismatches, 0)]: the kernel's expert set per token against the reference's (scores with no ties)."""
    from anyseek.kernels.reference.router import route_topk as ref
    from anyseek.kernels.triton.router import route_topk as fused

    g = torch.Generator().manual_seed(seed)
    full = torch.rand(T, E + (3 if strided else 0), generator=g)
    scores, bias = full[:, :E], (torch.rand(E, generator=g) - 0.5) * 0.2
    want = ref(scores, bias, K, G, TG, top2).sort(dim=1)[0]
    got = fused(scores.to(device), bias.to(device), K, G, TG, top2)
    assert got.dtype == torch.int64 and got.shape == (T, K)
    wrong = (got.cpu().sort(dim=1)[0] != want).any(dim=1).sum().item()
    return [("ids", wrong, 0)]


# (name, O, I, r, dtype, out: None | "slice" (rows of a bigger buffer) | "strip" (rows of [W + s B A | B]: the merge
# in the first I columns of a wider buffer, B in columns 3 .. 3 + r of the strip after them, zeros elsewhere in it))
MERGE_CASES = [
    ("fp32_odd", 37, 100, 3, "float32", None),
    ("fp16_r16", 64, 128, 16, "float16", None),
    ("fp16_r20_slice", 19, 150, 20, "float16", "slice"),
    ("fp32_one_row", 1, 7, 1, "float32", "slice"),
    ("fp16_r5_strip", 70, 130, 5, "float16", "strip"),
    ("fp32_r16_strip", 33, 64, 16, "float32", "strip"),
]


def merge_errors(O, I, r, dtype, out, device, seed=0):
    """[(what, err kernel, err torch)] for low_rank_merge (W + s B A) against an fp64 reference; with out="slice"
    the kernel writes rows of a bigger buffer, and the rows around them must stay as they were."""
    from anyseek.kernels.reference.lowrank import low_rank_merge as ref
    from anyseek.kernels.triton.lowrank import low_rank_merge as fused

    g = torch.Generator().manual_seed(seed)
    W, B, A = (torch.randn(*s, generator=g) for s in ((O, I), (O, r), (r, I)))
    want = ref(W.double(), B.double(), A.double(), 0.75)
    low = [t.to(device=device, dtype=dtype) for t in (W, B, A)]
    torch_low = ref(*low, 0.75).double().cpu()
    strip = []
    if out == "slice":
        buf = torch.full((O + 3, I), 7.0, dtype=dtype, device=device)
        got = fused(*low, 0.75, out=buf[1:O + 1])
        untouched = float(((buf[0] != 7).sum() + (buf[O + 1:] != 7).sum()).item())
    elif out == "strip":  # rows 1..O of a [O + 2, I + RT] buffer, RT = r + 5, B at strip column 3
        RT = r + 5
        buf = torch.full((O + 2, I + RT), 7.0, dtype=dtype, device=device)
        got = fused(*low, 0.75, out=buf[1:O + 1, :I], b_out=buf[1:O + 1, I:], b_at=3)
        untouched = float(((buf[0] != 7).sum() + (buf[O + 1] != 7).sum()).item())
        want_strip = torch.zeros(O, RT, dtype=torch.float64)
        want_strip[:, 3:3 + r] = low[1].double().cpu()
        strip = [("B strip", (buf[1:O + 1, I:].double().cpu() - want_strip).abs().max().item(), 0.0)]
    else:
        got, untouched = fused(*low, 0.75), 0.0
    assert got.dtype == dtype and got.shape == (O, I)
    return [("merged", (got.double().cpu() - want).abs().max().item(), (torch_low - want).abs().max().item()),
            ("rows around out", untouched, 0.0)] + strip


def passes(table, atol=1e-5):
    return all(err <= 2 * err_torch + atol for _, err, err_torch in table)


def _worker() -> None:
    results = {}
    for name, lead, D, xd, wd, strided, *frozen in NORM_CASES:
        table = norm_errors(lead, D, getattr(torch, xd), getattr(torch, wd), strided, "cpu", frozen_w=bool(frozen))
        results[f"rms_norm_{name}"] = {"pass": passes(table), "table": table}
    for name, lead, D, xd, yd, wd, use_h, *more in ADD_NORM_CASES:
        table = add_norm_errors(lead, D, getattr(torch, xd), getattr(torch, yd), getattr(torch, wd), use_h, "cpu",
                                uses=more[0] if more else (True,), frozen_w=len(more) > 1 and more[1])  # fmt: skip
        results[f"add_norm_{name}"] = {"pass": passes(table), "table": table}
    for name, N, I, dt, strided in SWIGLU_CASES:
        table = swiglu_errors(N, I, getattr(torch, dt), "cpu", strided)
        results[f"swiglu_{name}"] = {"pass": passes(table), "table": table}
    for name, C, V, dt, scale, kind in XENT_CASES:
        table = xent_errors(C, V, getattr(torch, dt), scale, kind, "cpu")
        results[f"xent_{name}"] = {"pass": passes(table), "table": table}
    for name, *case in ROPE_CASES:
        table = rope_errors(*case[:3], getattr(torch, case[3]), *case[4:], "cpu")
        results[f"rope_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    for name, n, gd, ld, *md in ADAMW_CASES:
        table = adamw_errors(n, getattr(torch, gd), getattr(torch, ld) if ld else None, "cpu",
                             moments_dtype=getattr(torch, md[0]) if md else torch.float32)
        results[f"adamw_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    for name, shapes, gd, *ld in ADAMW_TENSORS_CASES:
        table = adamw_tensors_errors([tuple(x) for x in shapes], getattr(torch, gd), "cpu",
                                     low_dtype=getattr(torch, ld[0]) if ld else None)
        results[f"adamw_tensors_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    for name, O, I, r, dt, out in MERGE_CASES:
        table = merge_errors(O, I, r, getattr(torch, dt), out, "cpu")
        results[f"merge_{name}"] = {"pass": passes(table), "table": table}
    for name, *case in ROUTER_CASES:
        table = router_errors(*case, "cpu")
        results[f"router_{name}"] = {"pass": all(err == 0 for _, err, _ in table), "table": table}
    from anyseek.kernels.triton.router import route_topk

    ids = route_topk(torch.full((5, 32), float("nan")), torch.zeros(32), 4, 4, 2, True)  # a non-finite step
    results["router_nan_rows_stay_valid"] = {"pass": bool(ids.min() >= 0 and ids.max() < 32), "table": ids.tolist()}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interp_results():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", [f"rms_norm_{c[0]}" for c in NORM_CASES] + [f"xent_{c[0]}" for c in XENT_CASES]
                         + [f"adamw_{c[0]}" for c in ADAMW_CASES] + [f"rope_{c[0]}" for c in ROPE_CASES]
                         + [f"add_norm_{c[0]}" for c in ADD_NORM_CASES] + [f"swiglu_{c[0]}" for c in SWIGLU_CASES]
                         + [f"router_{c[0]}" for c in ROUTER_CASES] + ["router_nan_rows_stay_valid"]
                         + [f"merge_{c[0]}" for c in MERGE_CASES]
                         + [f"adamw_tensors_{c[0]}" for c in ADAMW_TENSORS_CASES])
def test_interpreter(interp_results, name):
    r = interp_results[name]
    assert r["pass"], f"{name}: (what, err, err_torch) = {r['table']}"


def test_seam_uses_reference_on_cpu():
    """Without a GPU the seam is the reference, bit for bit the RMSNorm maths the model always had."""
    import torch.nn.functional as F

    from anyseek import kernels
    from anyseek.kernels import registry

    x, w = torch.randn(6, 16), torch.rand(16) + 0.5
    assert registry.choose("rms_norm", x)[1] == "reference"
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (16,), eps=1e-6))


def test_tensor_adamw_is_torch_adamw():
    """`train.optim.TensorAdamW` (here through the seam's PyTorch twin) takes torch's AdamW steps: the same weights
    and state after 3 steps with a folded clip factor, state dicts that load into each other, and a step that
    `found_inf` halts changes nothing, its step counts included."""
    from anyseek.train.optim import TensorAdamW

    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (1,)]
    p0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(cls, **kw):
        ps = [torch.nn.Parameter(t.clone()) for t in p0]
        opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.95), eps=1e-8, **kw)  # fmt: skip
        opt.grad_scale = torch.tensor(1.5)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        return ps, opt

    ps, opt = run(TensorAdamW)
    want, torch_opt = run(torch.optim.AdamW, fused=True)
    for a, b in zip(ps, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(opt.state.values(), torch_opt.state.values()):
        assert a.keys() == b.keys() and float(a["step"]) == float(b["step"]) == 3.0
        torch.testing.assert_close(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-6, atol=1e-9)
    opt.load_state_dict(torch_opt.state_dict())
    before = [p.detach().clone() for p in ps] + [st["step"].clone() for st in opt.state.values()]
    opt.found_inf = torch.tensor(1.0)
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    after = [p.detach() for p in ps] + [st["step"] for st in opt.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_router_reference_is_the_models_old_routing():
    """The seam's twin is the selection the model made inline before (written out here as the spec); a top_k that
    the kept groups cannot hold is an error naming the sizes."""
    from anyseek.kernels.reference.router import route_topk

    g = torch.Generator().manual_seed(1)
    T, E, G, TG, K = 50, 64, 8, 3, 6
    s, b = torch.rand(T, E, generator=g), torch.randn(E, generator=g) * 0.1
    c = (s + b).view(T, G, E // G)
    keep = torch.zeros(T, G, dtype=torch.bool).scatter_(1, c.topk(2, dim=-1)[0].sum(-1).topk(TG, dim=-1)[1], True)
    want = c.masked_fill(~keep[:, :, None], float("-inf")).view(T, E).topk(K, dim=-1)[1].sort(1)[0]
    assert torch.equal(route_topk(s, b, K, G, TG, True).sort(1)[0], want)
    with pytest.raises(ValueError, match="do not fit"):
        from anyseek import kernels

        kernels.route_topk(s, b, 30, G, TG, True)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ROUTER_CASES + [("v3_8k", 8192, 256, 8, 4, 8, True, False),
                                                 ("small_8k", 8192, 32, 4, 2, 4, True, False)])
def test_gpu_router(case):
    table = router_errors(*case[1:], "cuda")
    assert table[0][1] == 0, table
    from anyseek.kernels.triton.router import route_topk

    nan = torch.full((5, 32), float("nan"), device="cuda")  # a non-finite step: ids stay valid
    ids = route_topk(nan, torch.zeros(32, device="cuda"), 4, 4, 2, True)
    assert ids.min() >= 0 and ids.max() < 32


@pytest.mark.cuda
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [1024, 512, 256, 100, 7168])
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_rms_norm(x_dtype, D, strided):
    for w_dtype in {torch.float32, x_dtype}:
        table = norm_errors((4099,), D, x_dtype, w_dtype, strided, "cuda")
        assert passes(table, atol=1e-5), table
    table = norm_errors((4099,), D, x_dtype, torch.float32, strided, "cuda", frozen_w=True)  # LoRA's frozen norms
    assert passes(table, atol=1e-5), table


@pytest.mark.cuda
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [1024, 7168, 100])
@pytest.mark.parametrize("use_h", [True, False])
def test_gpu_add_rms_norm(x_dtype, D, use_h):
    for y_dtype, w_dtype in {(x_dtype, x_dtype), (x_dtype, torch.float32), (torch.bfloat16, torch.float32)}:
        if y_dtype != x_dtype and x_dtype != torch.float32:
            continue
        table = add_norm_errors((4099,), D, x_dtype, y_dtype, w_dtype, use_h, "cuda")
        assert passes(table, atol=1e-5), (y_dtype, w_dtype, table)
    table = add_norm_errors((4099,), D, x_dtype, x_dtype, torch.float32, use_h, "cuda", frozen_w=True)
    assert passes(table, atol=1e-5), table


@pytest.mark.cuda
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("uses", [(True, True, True), (True, False, True), (False, True)])
def test_gpu_add_rms_norm_copies(x_dtype, uses):
    """The MoE's input: the normalised h once per reader, their gradients summed in the norm's backward."""
    table = add_norm_errors((4099,), 1024, x_dtype, x_dtype, torch.float32, True, "cuda", uses=uses)
    assert passes(table, atol=1e-5), table


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("I", [4096, 512, 1408, 100])
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_swiglu(dtype, I, strided):
    table = swiglu_errors(4099, I, dtype, "cuda", strided)
    assert passes(table, atol=1e-5), table


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("V", [32000, 129280, 163840, 1000])
def test_gpu_cross_entropy_rows(dtype, V):
    for kind, scale in (("random", 3.0), ("argmax", 12.0), ("last", 30.0)):
        table = xent_errors(257, V, dtype, scale, kind, "cuda")
        assert passes(table, atol=1e-5), (kind, table)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rope_rotate(case, dtype):
    name, T, H, R, _, *flags = case
    table = rope_errors(T * 97, H, R, dtype, *flags, "cuda")
    if dtype == torch.bfloat16:  # one bf16 ulp (2^-8 relative) where the fp32 results round differently
        table = [(w, e, max(t, 2.0 ** -7 * 4)) for w, e, t in table]
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 2047, 3 * 2**20 + 5])
def test_gpu_adamw_flat(grad_dtype, n, moments):
    table = adamw_errors(n, grad_dtype, torch.bfloat16, "cuda", moments_dtype=moments)
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype,low_dtype", [(torch.bfloat16, None), (torch.float32, None),
                                                 (torch.bfloat16, torch.bfloat16)])
def test_gpu_adamw_tensors(grad_dtype, low_dtype):
    shapes = [(1,), (2047,), (1024, 3000), (0,), (5, 7), (3 * 2**20 + 5,)]
    table = adamw_tensors_errors(shapes, grad_dtype, "cuda", low_dtype=low_dtype)
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
def test_gpu_tensor_adamw_matches_fused_adamw():
    """TensorAdamW against torch's fused AdamW on CUDA tensors (clip factor, two groups), and a halted step."""
    from anyseek.train.optim import TensorAdamW

    g = torch.Generator().manual_seed(0)
    shapes = [(512, 300), (4099,), (64,)]
    p0 = [torch.randn(s, generator=g).cuda() for s in shapes]
    grads = [[torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(3)]
    res = []
    for cls in (TensorAdamW, lambda *a, **k: torch.optim.AdamW(*a, fused=True, **k)):
        ps = [torch.nn.Parameter(t.clone()) for t in p0]
        opt = cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}], lr=1e-2,
                  betas=(0.9, 0.95), eps=1e-8)  # fmt: skip
        opt.grad_scale, opt.found_inf = torch.tensor(1.5, device="cuda"), torch.zeros((), device="cuda")
        for k, gs in enumerate(grads + [grads[0]]):
            opt.found_inf.fill_(float(k == 3))  # the last step halted on the device
            for p, gr in zip(ps, gs):
                p.grad = gr.clone()
            opt.step()
        res.append(ps + [st["step"] for st in opt.state.values()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_gpu_bf16_moments_round_as_the_reference():
    """The kernel's random numbers are the reference's: given equal fp32 updates, all but a few elements (an fp32
    rounding apart, across a threshold) round to the same bf16."""
    from anyseek.kernels.reference import adamw as ref
    from anyseek.kernels.triton import adamw as fused

    n = 1 << 20
    out = []
    for mod, dev in ((ref, "cpu"), (fused, "cuda")):
        g = torch.Generator().manual_seed(1)
        grad = torch.randn(n, generator=g).to(dev)
        p, m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev, dtype=torch.bfloat16), torch.zeros(
            n, device=dev, dtype=torch.bfloat16)
        mod.adamw_flat(p, grad, m, v, None, torch.tensor(1.0, device=dev), 1, 1e-3, 0.9, 0.95, 1e-8, 0.0, seed=77)
        out.append((m.cpu(), v.cpu()))
    for a, b in zip(*out):
        assert (a != b).float().mean().item() < 1e-3


if __name__ == "__main__":
    _worker()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3072, 512, 16), (832, 1024, 32), (1024, 2048, 16), (100, 37, 5)])
@pytest.mark.parametrize("out", [None, "slice", "strip"])
def test_gpu_low_rank_merge(dtype, shape, out):
    table = merge_errors(*shape, dtype, out, "cuda")
    assert passes(table, atol=1e-6), table


def test_low_rank_merge_seam_checks_shapes():
    """The seam names the shapes it got; on the CPU it runs the twin (W + s B A)."""
    from anyseek import kernels

    W, B, A = torch.randn(4, 6), torch.randn(4, 2), torch.randn(2, 6)
    torch.testing.assert_close(kernels.low_rank_merge(W, B, A, 0.5), W + 0.5 * B @ A)
    with pytest.raises(ValueError, match=r"B \(4, 3\)"):
        kernels.low_rank_merge(W, torch.randn(4, 3), A, 0.5)
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.low_rank_merge(W, B.double(), A, 0.5)
    with pytest.raises(ValueError, match="out must be"):
        kernels.low_rank_merge(W, B, A, 0.5, out=torch.empty(3, 6))
    strip = torch.full((4, 5), 7.0)  # B in columns 1..2 of a 5-wide strip, zeros in the others
    kernels.low_rank_merge(W, B, A, 0.5, b_out=strip, b_at=1)
    torch.testing.assert_close(strip, torch.cat([torch.zeros(4, 1), B, torch.zeros(4, 2)], dim=1))
    with pytest.raises(ValueError, match=r"b_out must be \[4, >= 4 \+ 2\]"):
        kernels.low_rank_merge(W, B, A, 0.5, b_out=strip, b_at=4)
