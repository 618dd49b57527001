"""4-bit frozen weights: the NF4 format (`kernels/reference/quant4.py`), the seams given packed weights, and the
Triton dequant GEMMs (dense linear and the LoRA routed experts) in the interpreter against an fp64 computation
over the dequantized weights (the 2x rule: error at most twice PyTorch's own at the same precision)."""

from __future__ import annotations

import os

import interpreter
import pytest
import torch

from anyseek import kernels
from anyseek.kernels import accuracy, registry
from anyseek.kernels.reference import quant4


def _weights(shape, seed=0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g)
    return w * torch.rand(*shape, generator=g).pow(4) * 8 if heavy else w


def _nearest_level(w: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize written directly from the definition: per group of 64, s = bf16(absmax), the level
    nearest to w / s by argmin (not the boundaries `quantize4` uses), times s; fp64."""
    levels = quant4.nf4_levels().double()
    g = w.double().reshape(*w.shape[:-1], -1, 64)
    s = g.abs().amax(-1, keepdim=True).to(torch.bfloat16).double()
    idx = (g / s)[..., None].sub(levels).abs().argmin(-1)
    return (levels[idx] * s).reshape(w.shape)


# ---------------------------------------------------------------- the format


def test_nf4_levels_are_normal_quantiles_with_exact_zero_and_ends():
    lv = quant4.nf4_levels().double()
    assert lv.shape == (16,) and bool((lv[1:] > lv[:-1]).all())
    assert lv[0] == -1 and lv[-1] == 1 and lv[7] == 0
    # the positive levels are N(0,1) quantiles, evenly spaced in probability (up to the normalisation)
    p = torch.special.ndtr(lv[8:] * torch.special.ndtri(torch.tensor(0.5 * (1 + 0.9677), dtype=torch.float64)))
    gaps = p[1:] - p[:-1]
    assert torch.allclose(gaps, gaps.mean(), atol=1e-9)


@pytest.mark.parametrize("heavy", [False, True])
def test_quantize_round_trip_is_the_nearest_level_times_the_group_absmax(heavy):
    w = _weights((48, 192), seed=1, heavy=heavy)
    packed = quant4.quantize4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 192 * 17 // 32)
    got = quant4.dequantize4(packed, torch.float64)
    want = _nearest_level(w)
    # equal except where w / s lies within rounding of a midpoint (either level is then nearest)
    assert (got - want).abs().gt(1e-6).float().mean() < 1e-3
    assert quant4.in_features(packed) == 192
    rel = float((got - w.double()).norm() / w.double().norm())
    assert rel < (0.15 if heavy else 0.11)  # docs/training.md: 0.100 normal, 0.125 heavy-tailed (Student-t)


def test_rows_and_experts_quantize_independently():
    """Joined layers' packed rows are the packed rows of their join; a stack is its experts one by one."""
    a, b = _weights((16, 128), 2), _weights((24, 128), 3)
    assert torch.equal(torch.cat([quant4.quantize4(a), quant4.quantize4(b)]), quant4.quantize4(torch.cat([a, b])))
    stack = _weights((3, 32, 64), 4)
    per = torch.stack([quant4.quantize4(stack[e]) for e in range(3)])
    assert torch.equal(quant4.quantize4(stack), per)
    assert torch.equal(quant4.quantize4(stack, rows_per_chunk=5), per)


def test_input_dim_not_a_multiple_of_the_group_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        quant4.quantize4(torch.randn(8, 96))
    with pytest.raises(ValueError, match="not a packed 4-bit weight"):
        quant4.in_features(torch.zeros(4, 33, dtype=torch.uint8))


# ---------------------------------------------------------------- the seams (reference backend on the CPU)


def _linear_truth(x, W, A, blocks, scale, xd=None):
    """fp64 x dq(W)^T + s (xd A^T) B^T with autograd: the oracle."""
    Wd = quant4.dequantize4(W, torch.float64)
    y = x.double() @ Wd.t()
    u = (x if xd is None else xd).double() @ A.double().t()
    r0, cols = 0, []
    for at, B in blocks:
        r = B.shape[1]
        cols.append((at, u[:, r0:r0 + r] @ B.double().t() * scale))
        r0 += r
    add = torch.zeros_like(y)
    for at, c in cols:
        add = add + torch.nn.functional.pad(c, (at, y.shape[1] - at - c.shape[1]))
    return y + add


def _linear_case(seed=0, rows=37, in_f=128, blocks=((0, 20, 3), (28, 20, 5))):
    g = torch.Generator().manual_seed(seed)
    out_f = max(at + o for at, o, _ in blocks)
    W = quant4.quantize4(torch.randn(out_f, in_f, generator=g) / in_f**0.5)
    x = torch.randn(rows, in_f, generator=g)
    A = torch.randn(sum(r for *_, r in blocks), in_f, generator=g) / in_f**0.5
    Bs = [(at, torch.randn(o, r, generator=g)) for at, o, r in blocks]
    return x, W, A, Bs, torch.randn(rows, out_f, generator=g)


def _linear_run(fn, case, dtype, scale=0.5):
    """[y, dx, dA, dB_1, ...] of fn(x, W, A, blocks, None, scale) in dtype (fn None: the fp64 oracle)."""
    x, W, A, Bs, dy = case
    leaves = [t.to(torch.float64 if fn is None else dtype).requires_grad_() for t in [x, A] + [b for _, b in Bs]]
    blocks = [(at, b) for (at, _), b in zip(Bs, leaves[2:])]
    if fn is None:
        y = _linear_truth(leaves[0], W, leaves[1], blocks, scale)
    else:
        y = fn(leaves[0], W, leaves[1], blocks, None, scale)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [t.detach().double() for t in (y, *grads)]


def _linear_table(fn, case, dtype):
    """[(what, err of fn in dtype, err of PyTorch's own dequantize-then-matmul in dtype)] against the fp64 oracle."""
    truth = _linear_run(None, case, dtype)
    got = _linear_run(fn, case, dtype)
    pt = _linear_run(quant4.low_rank_linear, case, dtype)
    names = ["y", "dx", "dA"] + [f"dB{i}" for i in range(len(got) - 3)]
    return [(n, float((a - t).abs().max()), float((b - t).abs().max())) for n, a, b, t in zip(names, got, pt, truth)]


def test_low_rank_linear_seam_takes_a_packed_weight_and_matches_fp64():
    case = _linear_case()
    got = _linear_run(kernels.low_rank_linear, case, torch.float32)
    truth = _linear_run(None, case, torch.float32)
    for a, t in zip(got, truth):
        assert torch.allclose(a, t, rtol=1e-4, atol=1e-4)
    _, name, _ = registry.choose("quant4_linear", case[0])
    assert name == "reference"


def test_packed_seams_name_bad_shapes():
    x, W, A, Bs, _ = _linear_case()
    with pytest.raises(ValueError, match="4-bit packed: in = 128"):
        kernels.low_rank_linear(x[:, :64], W, A, Bs)
    gu, dn = quant4.quantize4(torch.randn(2, 128, 64)), quant4.quantize4(torch.randn(2, 64, 64))
    ids, w = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    ad = [torch.zeros(2, 4, 64), torch.zeros(2, 128, 4), torch.zeros(2, 4, 64), torch.zeros(2, 64, 4)]
    with pytest.raises(ValueError, match="must both be packed"):
        kernels.lora_routed_experts(torch.randn(3, 64), ids, w, gu, torch.randn(2, 64, 64), *ad, 1.0)
    ad[0] = torch.zeros(2, 4, 32)
    with pytest.raises(ValueError, match="A_gu"):
        kernels.lora_routed_experts(torch.randn(3, 64), ids, w, gu, dn, *ad, 1.0)


def _experts_case(T=19, D=64, I=64, E=5, K=2, kind="sparse", rank=4, seed=0):
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(T, D, I, E, K, kind, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ad = [torch.randn(E, rank, D, generator=g) / D**0.5, torch.randn(E, 2 * I, rank, generator=g),
          torch.randn(E, rank, I, generator=g) / I**0.5, torch.randn(E, D, rank, generator=g)]
    return x, ids, w, quant4.quantize4(gu), quant4.quantize4(dn), ad, dy


def _experts_truth(x, ids, w, gu, dn, ad, scale):
    """fp64, token by token: sum_k w * (Wd + s Bd Ad)(silu(g) * u), [g | u] = (Wgu + s Bgu Agu) x."""
    Wgu = quant4.dequantize4(gu, torch.float64) + scale * ad[1] @ ad[0]
    Wdn = quant4.dequantize4(dn, torch.float64) + scale * ad[3] @ ad[2]
    I = Wdn.shape[-1]
    h = torch.einsum("tkfd,td->tkf", Wgu[ids], x)
    act = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    return torch.einsum("tkdi,tki,tk->td", Wdn[ids], act, w)


def _experts_run(fn, case, dtype, scale=0.5):
    """[y, dx, dweights, dA_gu, dB_gu, dA_dn, dB_dn] of fn in dtype (fn None: the fp64 oracle)."""
    x, ids, w, gu, dn, ad, dy = case
    dt = torch.float64 if fn is None else dtype
    leaves = [x.to(dt), w.to(torch.float64 if fn is None else torch.float32)] + [a.to(dt) for a in ad]
    leaves = [t.detach().requires_grad_() for t in leaves]
    if fn is None:
        y = _experts_truth(leaves[0], ids, leaves[1], gu, dn, leaves[2:], scale)
    else:
        y = fn(leaves[0], ids, leaves[1], gu, dn, *leaves[2:], scale)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [t.detach().double() for t in (y, *grads)]


def _experts_table(fn, case, dtype):
    truth = _experts_run(None, case, dtype)
    got = _experts_run(fn, case, dtype)
    pt = _experts_run(quant4.lora_routed_experts, case, dtype)
    names = ["y", "dx", "dweights", "dA_gu", "dB_gu", "dA_dn", "dB_dn"]
    return [(n, float((a - t).abs().max()), float((b - t).abs().max())) for n, a, b, t in zip(names, got, pt, truth)]


def test_lora_routed_experts_seam_takes_packed_stacks_and_matches_fp64():
    case = _experts_case()
    got = _experts_run(kernels.lora_routed_experts, case, torch.float32)
    truth = _experts_run(None, case, torch.float32)
    for a, t in zip(got, truth):
        assert torch.allclose(a, t, rtol=1e-4, atol=1e-4)


def test_experts_prepass_route_is_taken_while_capturing_from_128_rows_an_expert(monkeypatch):
    """ANYSEEK_QUANT4_EXPERTS=auto: the 4-bit experts are dequantized first only inside a CUDA-graph capture (eager,
    its extra launches cost more host time than they save) and from 128 routed rows an expert on average."""
    from anyseek.kernels.triton import moe

    monkeypatch.delenv("ANYSEEK_QUANT4_EXPERTS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        assert [moe._prepass(M, 64) for M in (24576, 8192, 8191, 6)] == [capturing, capturing, False, False]
    monkeypatch.setenv("ANYSEEK_QUANT4_EXPERTS", "fused")
    assert not moe._prepass(24576, 64)
    monkeypatch.setenv("ANYSEEK_QUANT4_EXPERTS", "prepass")
    assert moe._prepass(6, 64)


# ---------------------------------------------------------------- the Triton kernels, in the interpreter


def _by_hand(out_f: int, in_f: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed W, its fp64 values) built from the format's definition, not from `quantize4`: random codes, code j
    of a row in byte j // 2, low nibble for even j; a power-of-two scale per (row, group) (exact products), the
    scales as bf16 bits after the codes. Packed inside a larger buffer whose next rows are 0xFF bytes (NaN scales):
    a kernel reading past a row's or the weight's end shows it as NaN."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_f, in_f), generator=g)
    scales = 2.0 ** torch.randint(-3, 4, (out_f, in_f // 64), generator=g).double()
    rows = torch.cat([(codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8),
                      scales.to(torch.bfloat16).view(torch.uint8)], 1)  # fmt: skip
    buf = torch.full((out_f + 2, rows.shape[1]), 0xFF, dtype=torch.uint8)
    buf[:out_f] = rows
    values = quant4.nf4_levels().double()[codes] * scales.repeat_interleave(64, 1)
    return buf[:out_f], values


# (out, in, tile): tails on purpose. Forward: rows past out (BLOCK_N 16 or 128 over 50 or 40), K past in (BLOCK_K
# 128 over 192, two scale groups per tile). Input gradient: its K (out) past 50, its columns past in (BLOCK_N 128
# over 192, two groups).
_DQ_CASES = [(50, 128, None), (40, 192, (16, 128, 16, 1, 1)), (24, 192, (16, 16, 128, 1, 1))]


def _dq_mode_results(results: dict) -> None:
    """Every lookup form (and the legacy one) on weights built by hand: x = I gives dq(W) itself, so each element and
    the nibble order are checked against the definition; then random x and the input gradient; then the dequantize
    pre-pass, which must equal dequantize4 exactly."""
    from anyseek.kernels.triton import quant4_dq, quant4_linear

    for name, mode in quant4_dq.MODES.items():
        err = []
        for out_f, in_f, tile in _DQ_CASES:
            W, ref = _by_hand(out_f, in_f)
            eye = torch.eye(in_f)
            err.append(float((quant4_linear.matmul_wt(eye, W, dq=mode, tile=tile).double() - ref.t()).abs().max()))
            x, gy = torch.randn(7, in_f), torch.randn(7, out_f)
            err.append(float((quant4_linear.matmul_wt(x, W, dq=mode, tile=tile).double() - x.double() @ ref.t())
                             .abs().max() / 10))  # fmt: skip
            err.append(float((quant4_linear.matmul_w(gy, W, dq=mode, tile=tile).double() - gy.double() @ ref)
                             .abs().max() / 10))  # fmt: skip
        exact = [bool(torch.equal(quant4_dq.dequantize(quantize, torch.float32, mode), quant4.dequantize4(quantize)))
                 for quantize in (quant4.quantize4(torch.randn(3, 37, 192)),)] if mode else [True]  # fmt: skip
        results[f"dq_{name}"] = {"pass": all(e < 1e-4 for e in err) and all(exact), "table": [err, exact]}  # (NaN: fails)
    os.environ["ANYSEEK_QUANT4_DENSE"] = "prepass"  # the dequantize-then-matmul route of the dense GEMMs
    W, ref = _by_hand(50, 192)
    x, gy = torch.randn(7, 192), torch.randn(7, 50)
    err = [float((quant4_linear.matmul_wt(x, W).double() - x.double() @ ref.t()).abs().max()),
           float((quant4_linear.matmul_w(gy, W).double() - gy.double() @ ref).abs().max())]
    results["dense_prepass"] = {"pass": all(e < 1e-3 for e in err), "table": err}
    del os.environ["ANYSEEK_QUANT4_DENSE"]
    os.environ["ANYSEEK_QUANT4_DQ"] = "bogus"
    try:
        quant4_dq.dq_mode()
        results["dq_env"] = {"pass": False, "table": "no error"}
    except ValueError as e:
        results["dq_env"] = {"pass": "legacy, select, gather" in str(e), "table": str(e)}
    del os.environ["ANYSEEK_QUANT4_DQ"]


def _experts_mode_results(results: dict) -> None:
    """The routed experts' four grouped GEMMs under the fused lookup form other than the default (which runs in
    _worker), picked through ANYSEEK_QUANT4_DQ: fp32, odd row counts, an empty expert. Each form's dequantization
    itself is checked by the dq_* cases; one form here checks that the choice reaches the experts' kernels (the CI
    suite's time: every form here cost ~25 s more in the interpreter)."""
    from anyseek.kernels.triton import quant4_moe

    case = _experts_case(T=9, E=3, kind="sparse")
    for name in ("select",):
        os.environ["ANYSEEK_QUANT4_DQ"] = name
        table = _experts_table(quant4_moe.lora_routed_experts, case, torch.float32)
        results[f"experts_{name}"] = {"pass": interpreter.passes(table, 1e-4), "table": table}
    os.environ.pop("ANYSEEK_QUANT4_DQ", None)
    # the pre-pass route (ANYSEEK_QUANT4_EXPERTS): experts dequantized a chunk at a time (here at most 2 a chunk:
    # the chunks' tiles renumbered, the offsets, adapters and per-token products read from the chunk's first
    # expert on), then the plain grouped GEMMs in the activations' dtype (fp32 and fp16 here); empty experts
    from anyseek.kernels.triton import moe

    chunks, dequantize, limit = [], moe.dequantize, moe.QUANT4_CHUNK_BYTES
    moe.dequantize = lambda packed, dtype: chunks.append(packed.shape[0]) or dequantize(packed, dtype)
    os.environ["ANYSEEK_QUANT4_EXPERTS"] = "prepass"
    try:
        case = _experts_case(T=13, E=5, kind="sparse")
        moe.QUANT4_CHUNK_BYTES = 2 * case[3].shape[1] * quant4.in_features(case[3]) * 4  # 2 gate|up experts in fp32
        rows = [_experts_table(quant4_moe.lora_routed_experts, case, dt) for dt in (torch.float32, torch.float16)]
    finally:
        moe.dequantize, moe.QUANT4_CHUNK_BYTES = dequantize, limit
        del os.environ["ANYSEEK_QUANT4_EXPERTS"]
    ok = interpreter.passes(rows[0], 1e-4) and interpreter.passes(rows[1], 1e-4) and 2 in chunks and 1 in chunks
    results["experts_prepass"] = {"pass": ok, "table": [rows, chunks]}
    os.environ["ANYSEEK_QUANT4_EXPERTS"] = "bogus"
    try:
        moe._prepass(1, 1)
        results["experts_env"] = {"pass": False, "table": "no error"}
    except ValueError as e:
        results["experts_env"] = {"pass": "auto, fused or prepass" in str(e), "table": str(e)}
    del os.environ["ANYSEEK_QUANT4_EXPERTS"]


def _worker() -> None:
    from anyseek.kernels.triton import quant4_linear, quant4_moe

    results = {}
    _dq_mode_results(results)
    _experts_mode_results(results)
    for dtype in (torch.float32, torch.float16):
        tag = str(dtype).removeprefix("torch.")
        table = _linear_table(quant4_linear.low_rank_linear, _linear_case(), dtype)
        results[f"linear_{tag}"] = {"pass": interpreter.passes(table, 1e-4), "table": table}
        # two of four experts empty ("sparse"); odd row counts
        table = _experts_table(quant4_moe.lora_routed_experts, _experts_case(T=11, E=4, kind="sparse"), dtype)
        results[f"experts_sparse_{tag}"] = {"pass": interpreter.passes(table, 1e-4), "table": table}
    x, W, *_ = _linear_case(rows=5)
    dq = quant4.dequantize4(W, torch.float64)
    plain = [quant4_linear.matmul_wt(x, W).double(), quant4_linear.matmul_w(x @ dq.float().t(), W).double()]
    truth = [x.double() @ dq.t(), (x.double() @ dq.t()) @ dq]
    err = [float((a - t).abs().max()) for a, t in zip(plain, truth)]
    results["matmuls"] = {"pass": max(err) < 1e-3, "table": err}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.parametrize("name", ["linear_float32", "linear_float16", "experts_sparse_float32",
                                  "experts_sparse_float16", "matmuls", "dq_legacy", "dq_select", "dq_gather", "dq_env",
                                  "dense_prepass", "experts_select", "experts_prepass", "experts_env"])  # fmt: skip
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(what, err kernel, err torch)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels(dtype):
    from anyseek.kernels.triton import quant4_linear, quant4_moe

    case = [t.cuda() if torch.is_tensor(t) else [(at, b.cuda()) for at, b in t] for t in _linear_case(rows=300)]
    assert interpreter.passes(_linear_table(quant4_linear.low_rank_linear, case, dtype), 1e-3)
    ex = _experts_case(T=200, D=256, I=128, E=8, K=3, kind="skewed", rank=16)
    ex = [t.cuda() if torch.is_tensor(t) else [a.cuda() for a in t] for t in ex]
    assert interpreter.passes(_experts_table(quant4_moe.lora_routed_experts, ex, dtype), 1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("form", ["legacy", "select", "gather"])
def test_gpu_every_lookup_form(form, monkeypatch):
    """Each lookup form compiled for the GPU (the interpreter lowers none of them): the dense GEMMs on weights built by
    hand, exact in fp32 for x = I, and the routed experts in bf16 within the 2x rule."""
    from anyseek.kernels.triton import quant4_dq, quant4_linear, quant4_moe

    monkeypatch.setenv("ANYSEEK_QUANT4_DQ", form)
    W, ref = _by_hand(300, 320)
    W, ref = W.cuda(), ref.cuda()
    got = quant4_linear.matmul_wt(torch.eye(320, device="cuda"), W, dq=quant4_dq.MODES[form])
    assert float((got.double() - ref.t()).abs().max()) == 0.0
    g = torch.randn(70, 300, device="cuda")
    assert float((quant4_linear.matmul_w(g, W).double() - g.double() @ ref).abs().max()) < 1e-3
    ex = _experts_case(T=200, D=256, I=128, E=8, K=3, kind="skewed", rank=16)
    ex = [t.cuda() if torch.is_tensor(t) else [a.cuda() for a in t] for t in ex]
    assert interpreter.passes(_experts_table(quant4_moe.lora_routed_experts, ex, torch.bfloat16), 1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_experts_prepass(dtype, monkeypatch):
    """The routed experts' pre-pass route (4-bit stacks dequantized a chunk of experts at a time, then the bf16
    grouped GEMMs) within the 2x rule, with chunks of 3 experts (the last one short) and a skewed routing."""
    from anyseek.kernels.triton import moe, quant4_moe

    monkeypatch.setenv("ANYSEEK_QUANT4_EXPERTS", "prepass")
    ex = _experts_case(T=300, D=256, I=128, E=8, K=3, kind="skewed", rank=16)
    monkeypatch.setattr(moe, "QUANT4_CHUNK_BYTES", 3 * 256 * 256 * 2)
    ex = [t.cuda() if torch.is_tensor(t) else [a.cuda() for a in t] for t in ex]
    assert interpreter.passes(_experts_table(quant4_moe.lora_routed_experts, ex, dtype), 1e-3)


if __name__ == "__main__":
    _worker()
