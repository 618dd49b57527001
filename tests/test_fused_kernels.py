"""Fused elementwise kernels (`kernels.rms_norm`, `add_rms_norm`, `swiglu`, `cross_entropy_rows`, `rope_rotate`,
`mla_cache_write`, `gumbel_argmax`): the Triton backends against their pure-PyTorch twins, on CPU under TRITON_INTERPRET=1 (in a
subprocess: the variable never leaks; tests/interpreter.py) and on a GPU (marked cuda). The fused optimizer is in test_fused_adamw.py, the
router and the low-rank merge in test_fused_router_merge.py.

The rule: max|kernel - fp32 reference| <= 2 * max|PyTorch at the same precision - fp32 reference| + a small atol,
for the output and every gradient.
"""

import interpreter
import pytest
import torch
from interpreter import passes

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


# (name, T, L, R, dtype, weight dtype, pairs interleaved in, kv_a rows strided, query heads (0: no query)): the
# latent-cache write
CACHE_CASES = [
    ("fp16_pairs", 37, 40, 16, "float16", "float16", True, False, 3),
    ("fp32_halves_strided", 5, 48, 8, "float32", "float32", False, True, 2),
    ("one_token_v3_widths", 1, 512, 64, "float16", "float16", True, False, 16),
    ("no_query", 4, 40, 16, "float16", "float16", True, False, 0),
    ("fp16_x_fp32_w_twin", 9, 32, 16, "float16", "float32", True, True, 3),  # other roundings: the twin runs
]


def cache_write_errors(T, L, R, dtype, w_dtype, inter_in, strided, heads, device, seed=0):
    """[(what, max |kernel - twin|, allowed)] for `mla_cache_write` into scattered rows of a cache filled with 7s:
    the written rows within 2 ulps of the twin (the norm's reciprocal square root may round apart), every other row
    untouched; with query heads, their rope part (read from strided heads) written into the last R columns of a
    wider buffer as the twin's `rope_rotate` does, within 2 ulps, the buffer's other columns untouched."""
    from anyseek.kernels.reference.cache import mla_cache_write as ref
    from anyseek.kernels.triton.cache import mla_cache_write as fused

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(T, L + R + (5 if strided else 0), generator=g).to(dtype)
    kv = base[:, : L + R]
    w = (torch.rand(L, generator=g) + 0.5).to(w_dtype)
    ang = torch.randn(T, R // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(3 * T, generator=g)[:T]
    q_pe = (torch.randn(T, heads, R + 3, generator=g) * 4).to(dtype)[..., :R] if heads else None
    q_want = torch.full((T, heads, L + R), 7.0, dtype=dtype) if heads else None
    q_got = torch.full((T, heads, L + R), 7.0, dtype=dtype, device=device) if heads else None
    want = torch.full((3 * T, L + R), 7.0, dtype=dtype)
    ref(want, slots, kv, w, 1e-6, cos, sin, inter_in, q_pe, q_want[..., L:] if heads else None)
    got = torch.full((3 * T, L + R), 7.0, dtype=dtype, device=device)
    fused(got, slots.to(device), kv.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device), inter_in,
          q_pe.to(device) if heads else None, q_got[..., L:] if heads else None)  # fmt: skip
    got = got.cpu().float()
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    rest = torch.ones(3 * T, dtype=torch.bool)
    rest[slots] = False
    table = [("rows", (got[slots] - want[slots].float()).abs().max().item(), 2 * ulp * want[slots].abs().max().item()),
             ("others", (got[rest] - 7.0).abs().max().item() if rest.any() else 0.0, 0.0)]
    if heads:
        q_got = q_got.cpu().float()
        table += [("query rope", (q_got[..., L:] - q_want[..., L:].float()).abs().max().item(),
                   2 * ulp * q_want[..., L:].float().abs().max().item()),
                  ("query's other columns", (q_got[..., :L] - 7.0).abs().max().item(), 0.0)]  # fmt: skip
    return table


# (name, rows, vocabulary): the sampler's draw
GUMBEL_CASES = [("one_row_one_token", 1, 1), ("odd_vocab", 3, 2049), ("rows", 5, 5000)]


def gumbel_errors(B, V, device, seed=0):
    """[(what, ids that differ from the twin's, allowed 0)]: zero logits (the draw is the argmax of the noise: the
    hash itself, bit for bit), random logits, and rows with all but a few logits -inf (after top-k)."""
    from anyseek.kernels.reference.sampling import gumbel_argmax as ref
    from anyseek.kernels.triton.sampling import gumbel_argmax as fused

    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (B,), generator=g)
    masked = torch.full((B, V), float("-inf"))
    masked[:, torch.randperm(V, generator=g)[: min(3, V)]] = 0.0
    rows = []
    for what, logits in (("zero", torch.zeros(B, V)), ("random", torch.randn(B, V, generator=g) * 4),
                         ("top3", masked)):  # fmt: skip
        got = fused(logits.to(device), keys.to(device)).cpu()
        rows.append((what, int((got != ref(logits, keys)).sum()), 0))
    return rows


def _worker() -> None:
    """Runs in the subprocess: every case of this module; reports one JSON line."""
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
    for name, B, V in GUMBEL_CASES:
        table = gumbel_errors(B, V, "cpu")
        results[f"gumbel_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    for name, *case in CACHE_CASES:
        table = cache_write_errors(*case[:3], getattr(torch, case[3]), getattr(torch, case[4]), *case[5:], "cpu")
        results[f"cache_{name}"] = {"pass": all(err <= tol for _, err, tol in table), "table": table}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"rms_norm_{c[0]}" for c in NORM_CASES] + [f"xent_{c[0]}" for c in XENT_CASES]
                         + [f"rope_{c[0]}" for c in ROPE_CASES] + [f"add_norm_{c[0]}" for c in ADD_NORM_CASES]
                         + [f"swiglu_{c[0]}" for c in SWIGLU_CASES] + [f"cache_{c[0]}" for c in CACHE_CASES]
                         + [f"gumbel_{c[0]}" for c in GUMBEL_CASES])
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(what, err, err_torch)")


def test_seam_uses_reference_on_cpu():
    """Without a GPU the seam is the reference, bit for bit the RMSNorm maths the model always had."""
    import torch.nn.functional as F

    from anyseek import kernels
    from anyseek.kernels import registry

    x, w = torch.randn(6, 16), torch.rand(16) + 0.5
    assert registry.choose("rms_norm", x)[1] == "reference"
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), w * F.rms_norm(x, (16,), eps=1e-6))


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
@pytest.mark.parametrize("case", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_mla_cache_write(case, dtype):
    name, T, L, R, _, w_dtype, *flags = case
    table = cache_write_errors(T * 13, L, R, dtype, getattr(torch, w_dtype), *flags, "cuda")
    assert all(err <= tol for _, err, tol in table), table


@pytest.mark.cuda
@pytest.mark.parametrize("B, V", [(1, 102400), (64, 102400), (7, 129280), (3, 33)])
def test_gpu_gumbel_argmax(B, V):
    """The draw's noise bit for bit (zero logits) and the same ids on random and top-k-masked logits; at the 16B and
    V3 vocabularies (ties broken to the first index in both)."""
    table = gumbel_errors(B, V, "cuda")
    assert all(err <= tol for _, err, tol in table), table


if __name__ == "__main__":
    _worker()
