"""FP8 training (DeepSeek-V3's recipe): the reference twin against formulas written out here, the accumulator
emulation that shows why the GEMM promotes every 128 products, the Triton kernels under the interpreter (a child
process, tests/interpreter.py) against the twin, the autograd Function against the exact linear within the
quantization's error bound, and the transform (`train.precision = "fp8"`) on a tiny model on the CPU.
"""

from __future__ import annotations

import math

import interpreter
import pytest
import torch
from helpers import run, tiny_cfg, tiny_model, train_losses

from anyseek import kernels
from anyseek.kernels import registry
from anyseek.kernels.reference import fp8 as ref
from anyseek.train.config import ConfigError, load_run_config

U = 2.0 ** -4  # E4M3's largest relative rounding error of a normal number (3 stored mantissa bits)


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv("ANYSEEK_FP8", raising=False)
    yield
    registry.set_backend("fp8", None)


def _all_e4m3() -> torch.Tensor:
    """Every finite E4M3 value, from its 256 bit patterns (NaNs dropped)."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)].unique()


def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value by search over all of them, ties to the even bit pattern."""
    grid = _all_e4m3().double()
    d = (y.double().reshape(-1, 1) - grid).abs()
    best = d.min(dim=1, keepdim=True).values
    ties = d == best
    codes = grid.float().to(torch.float8_e4m3fn).view(torch.uint8).long()
    pick = torch.where(ties, (codes % 2 == 0).double() + 1, torch.zeros_like(d)).argmax(dim=1)  # even code wins ties
    return grid[pick].reshape(y.shape).float()


def _ties() -> torch.Tensor:
    """Rows of 128 whose amax is 448 (scale 1), the rest exact midpoints between neighbouring E4M3 values (normal
    and subnormal, both signs): rounding has to break every tie, to the even bit pattern."""
    grid = _all_e4m3()
    mids = (grid[1:] + grid[:-1]) / 2
    mids = mids[mids.abs() < 440][:-1]
    n = math.ceil(len(mids) / 127) * 127
    rows = torch.cat([mids, torch.zeros(n - len(mids))]).view(-1, 127)
    return torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1)


def _spread(*shape, seed=0) -> torch.Tensor:
    """Random values across 8 decades (subnormal E4M3 after scaling included), some tiles all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.empty(*shape).uniform_(-14, 4, generator=g))
    x[0, :min(shape[1], 128)] = 0
    return x


def _bounded(*shape, seed=0) -> torch.Tensor:
    """Random signs times magnitudes in [0.5, 1.5]: no value in a tile falls below E4M3's normal range once scaled."""
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0) * (0.5 + torch.rand(*shape, generator=g))


# ------------------------------------------------------------------------------------------ the reference twin


@pytest.mark.parametrize("shape", [(5, 300), (130, 128), (3, 7)])
def test_rows_are_amax_scaled_and_rounded_to_nearest(shape):
    x = _spread(*shape)
    q, s = ref.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (shape[0], math.ceil(shape[1] / 128))
    for r in range(shape[0]):
        for kb in range(s.shape[1]):
            tile = x[r, kb * 128:(kb + 1) * 128]
            amax = tile.abs().max()
            want = amax / 448 if amax > 0 else torch.tensor(1.0)
            assert s[r, kb] == want, (r, kb)
            assert torch.equal(q[r, kb * 128:(kb + 1) * 128].float(), _nearest_e4m3(tile / want)), (r, kb)


@pytest.mark.parametrize("shape", [(5, 300), (3, 7)])
def test_pow2_scales_are_the_power_of_two_above_and_survive_a_round_trip(shape):
    """The rows expert parallelism sends: scale = the least power of two >= amax / 448 (frexp, independently of the
    bit trick), the codes x / scale rounded; unpacked in bf16 they are exact, and quantizing them again (what the
    FP8 experts do on arrival) gives the same values."""
    x = _spread(*shape, seed=3)
    q, s = ref.quantize_rows(x, pow2=True)
    for r in range(shape[0]):
        for kb in range(s.shape[1]):
            tile = x[r, kb * 128:(kb + 1) * 128]
            amax = tile.abs().max()
            if amax == 0:
                assert s[r, kb] == 1
                continue
            m, e = math.frexp((amax / 448).item())  # amax/448 (fp32) = m * 2^e, m in [0.5, 1)
            want = 2.0 ** (e - 1 if m == 0.5 else e)
            assert s[r, kb].item() == want, (r, kb, s[r, kb].item(), want)
            assert torch.equal(q[r, kb * 128:(kb + 1) * 128].float(), _nearest_e4m3(tile / want)), (r, kb)
    codes, scales = ref.pack_rows(x)
    assert codes.dtype == torch.uint8 and torch.equal(scales, s)
    values = ref.unpack_rows(codes, scales, torch.bfloat16)
    assert torch.equal(values.float(), ref.dequantize_rows(q, s))
    assert torch.equal(ref.dequantize_rows(*ref.quantize_rows(values, pow2=True)), values.float())


def test_ties_round_to_even():
    x = _ties()
    q, s = ref.quantize_rows(x)
    assert torch.equal(s, torch.ones_like(s)) and torch.equal(q.float(), _nearest_e4m3(x))


def test_blocks_and_transposed_tiles():
    w = _spread(200, 300, seed=1)
    q, s = ref.quantize_blocks(w)
    assert s.shape == (2, 3)
    for nb in range(2):
        for kb in range(3):
            blk = w[nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128]
            assert s[nb, kb] == blk.abs().max() / 448
            got = q[nb * 128:(nb + 1) * 128, kb * 128:(kb + 1) * 128].float()
            assert torch.equal(got, _nearest_e4m3(blk / s[nb, kb]))
    qt, st = ref.quantize_rows_t(w)  # 128x1 tiles of w: column c, rows 128 at a time
    assert qt.shape == (300, 200) and st.shape == (300, 2)
    assert st[7, 1] == w[128:, 7].abs().max() / 448
    assert torch.equal(qt[7, 128:].float(), _nearest_e4m3(w[128:, 7] / st[7, 1]))


def _dequant_b(q, s):
    return ref.dequantize_rows(q, s) if s.shape[0] == q.shape[0] else ref.dequantize_blocks(q, s)


def _gemm_table(fn, a, b, out_dtype, b_blocks, tensor_cores=False):
    """(what, err, err_pt): fn's a @ b^T on the quantized operands against fp64 on the same, beside PyTorch's fp32
    matmul of the dequantized operands rounded to out_dtype. tensor_cores (a GPU kernel): err_pt is the larger of
    that and the error of `ref.gemm_emulated` (FP8 tensor cores' ~14-bit sums within each promoted K-block)."""
    qa, sa = ref.quantize_rows(a)
    qb, sb = ref.quantize_blocks(b) if b_blocks else ref.quantize_rows(b)
    da, db = ref.dequantize_rows(qa, sa), _dequant_b(qb, sb)
    exact = da.double() @ db.double().t()
    err_pt = ((da @ db.t()).to(out_dtype).double() - exact).abs().max().item()
    if tensor_cores:
        err_pt = max(err_pt, (ref.gemm_emulated(qa, sa, qb, sb) - exact).abs().max().item())
    got = fn(qa, sa, qb, sb, out_dtype).double()
    return [("out", (got - exact).abs().max().item(), err_pt)]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_blocks", [False, True])
def test_reference_gemm_is_within_2x_of_fp64_on_the_same_operands(out_dtype, b_blocks):
    a, b = _spread(70, 300, seed=2), _spread(45, 300, seed=3)
    table = _gemm_table(ref.gemm, a, b, out_dtype, b_blocks)
    assert interpreter.passes(table, atol=1e-6), table


def test_promotion_every_128_is_what_keeps_k4096_within_the_bound():
    """The tensor cores' ~14-bit FP8 accumulator (`ref.accumulate_limited`) over K = 4096 same-sign products (the
    worst case for an accumulator that truncates): without promotion the result is off by more than twice bf16's
    rounding of the exact result (the bf16 output the GEMM is rounded to anyway); promoting every 128 products into
    fp32 stays within it."""
    g = torch.Generator().manual_seed(4)
    qa, _ = ref.quantize_rows(torch.rand(8, 4096, generator=g))
    qb, _ = ref.quantize_rows(torch.rand(8, 4096, generator=g))
    exact = qa.double() @ qb.double().t()
    err_bf16 = (exact.to(torch.bfloat16).double() - exact).abs().max().item()
    err = {p: (ref.accumulate_limited(qa, qb, p) - exact).abs().max().item() for p in (None, 128)}
    assert err[128] <= 2 * err_bf16 < err[None], (err, err_bf16)


def test_linear_gradients_are_within_the_quantization_bound():
    """y, dx and dW of `kernels.fp8_linear` (reference backend) against the fp64 linear: each product carries at
    most U relative error per rounding (operands away from E4M3's subnormals), so |err| <= ((1+U)^n - 1) |a| @ |b|
    with n = 2 roundings for y and dx and 3 for dW (x is rounded again along the tokens for Wgrad)."""
    x, w, dy = _bounded(150, 300, seed=5), _bounded(200, 300, seed=6), _bounded(150, 200, seed=7)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    registry.set_backend("fp8", "reference")
    y = kernels.fp8_linear(xg, wg)
    y.backward(dy)
    xd, wd, dyd = x.double(), w.double(), dy.double()
    cases = [("y", y, xd @ wd.t(), xd.abs() @ wd.abs().t(), 2), ("dx", xg.grad, dyd @ wd, dyd.abs() @ wd.abs(), 2),
             ("dW", wg.grad, dyd.t() @ xd, dyd.abs().t() @ xd.abs(), 3)]  # fmt: skip
    for what, got, exact, mag, n in cases:
        excess = (got.double() - exact).abs() - ((1 + U) ** n - 1) * mag
        assert excess.max() <= 1e-4, (what, excess.max().item())
        assert (got.double() - exact).norm() / exact.norm() < 4 * U, what  # and not exact: it was quantized
        assert (got.double() - exact).abs().max() > 0, what
    assert wg.grad.dtype == torch.float32 and y.dtype == torch.float32


def _experts_case(seed=30):
    """40 tokens, top-2 of 4 experts (expert 2 empty, one slot no expert takes), D = 136, I = 128: gate|up's rows a
    multiple of 128 (stacked quantization), down's not (one expert at a time)."""
    g = torch.Generator().manual_seed(seed)
    T, K, E, D, I = 40, 2, 4, 136, 128
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = torch.where(ids == 2, 1 + 0 * ids, ids)
    ids[0, 0] = E
    ts = [torch.randn(T, D, generator=g), torch.rand(T, K, generator=g), 0.1 * torch.randn(E, 2 * I, D, generator=g),
          0.1 * torch.randn(E, D, I, generator=g)]  # fmt: skip
    return ids, ts, torch.randn(T, D, generator=g)


def _run_experts(fn, ids, ts, dy):
    """-> [y, dx, d weights, d gate_up, d down]; y and dx of a token with a slot no expert takes are left out (set
    to 0): the seam leaves them unspecified (such slots come with one slot a row, from expert parallelism)."""
    leaves = [t.clone().requires_grad_() for t in ts]
    y = fn(leaves[0], ids, *leaves[1:])
    y.backward(dy)
    keep = (ids < ts[2].shape[0]).all(1)[:, None]
    return [torch.where(keep, y, 0.0), torch.where(keep, leaves[0].grad, 0.0)] + [t.grad for t in leaves[1:]]


def test_reference_experts_track_the_exact_experts():
    """The FP8 routed experts' twin against PyTorch's routed experts in fp32 (slot id E: no expert, weight 0): the
    output and every gradient within 3U relative (four E4M3 roundings compound along the chain: ~6.5% measured), not
    exact, and the weight gradients of the empty expert exactly zero."""
    from anyseek.kernels import fp8 as fp8_autograd
    from anyseek.kernels.reference import moe as ref_moe

    ids, ts, dy = _experts_case()
    E = ts[2].shape[0]
    got = _run_experts(fp8_autograd.fp8_routed_experts_reference, ids, ts, dy)
    exact = _run_experts(lambda x, i, w, gu, dn: ref_moe.routed_experts(x, i.clamp(max=E - 1), w * (i < E), gu, dn),
                         ids, ts, dy)  # fmt: skip
    exact[2] = exact[2] * (ids < E)  # (the slot no expert takes: no gradient)
    for name, a, b in zip(["y", "dx", "d weights", "d gate_up", "d down"], got, exact):
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < 3 * U, (name, rel)
    assert not got[3][2].any() and not got[4][2].any()


def test_seam_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="fp8_linear"):
        kernels.fp8_linear(torch.zeros(4, 8), torch.zeros(3, 9))


# ------------------------------------------------------------------------------ the Triton kernels (interpreter)


def _grouped_cases() -> dict:
    """The grouped GEMM (interpreter) on 37 tokens, top-3 of 5 experts (expert 3 empty, one slot no expert takes),
    K = 300 (a tail), N = 200: gathered rows in plan order (fp32), scattered to token order (bf16), rows given in plan
    order; each within 2x of fp64 on the same operands, beside PyTorch's fp32 matmul rounded to the output dtype."""
    from anyseek.kernels.triton import fp8_grouped, moe_plan

    T, K, E, D, N, bm = 37, 3, 5, 300, 200, 16
    g = torch.Generator().manual_seed(20)
    x, w = _spread(T, D, seed=21), torch.randn(E, N, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = torch.where(ids == 3, 2 + 0 * ids, ids)  # expert 3 empty (expert 2 may appear twice for a token)
    ids[0, 0] = E
    plan = moe_plan.build_plan(ids, E, bm)
    slot, tok = plan[0].long(), plan[1].long()
    expert_M = ids.flatten()[slot]
    valid = expert_M < E
    qx, sx = ref.quantize_rows(x)
    qw, sw = ref.quantize_expert_blocks(w)
    dx, dw = ref.dequantize_rows(qx, sx), torch.stack([ref.dequantize_blocks(q, s) for q, s in zip(qw, sw)])
    exact = torch.einsum("md,mnd->mn", dx[tok].double(), dw[expert_M.clamp(max=E - 1)].double())
    fp32 = torch.einsum("md,mnd->mn", dx[tok], dw[expert_M.clamp(max=E - 1)])
    qa, sa = ref.quantize_rows(x[tok])  # rows in plan order, for the case without gather
    cases = {"gathered": (fp8_grouped.grouped_gemm(qx, sx, qw, sw, plan, bm, torch.float32, gather=True),
                          torch.float32, None),
             "scattered_bf16": (fp8_grouped.grouped_gemm(qx, sx, qw, sw, plan, bm, torch.bfloat16, gather=True,
                                                         scatter=True)[slot], torch.bfloat16, None),
             "plan_rows": (fp8_grouped.grouped_gemm(qa, sa, qw, sw, plan, bm, torch.float32), torch.float32,
                           ref.grouped_gemm(qa, sa, qw, sw, expert_M, torch.arange(len(tok)))),
             # the GPU's 128-wide column tiles: one scale of b a tile, the one-FMA promotion
             "bn128": (fp8_grouped.grouped_gemm(qx, sx, qw, sw, plan, bm, torch.float32, gather=True,
                                                config={"BN": 128, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}),
                       torch.float32, None)}  # fmt: skip
    out = {}
    for name, (got, dtype, twin) in cases.items():
        err_pt = (fp32.to(dtype).double() - exact)[valid].abs().max().item()
        table = [("out", (got.double() - exact)[valid].abs().max().item(), err_pt)]
        if twin is not None:  # the twin as an oracle too (same row semantics, independent loop over experts)
            table.append(("vs twin", (got - twin)[valid].abs().max().item(), err_pt))
        out[f"grouped_{name}"] = {"pass": interpreter.passes(table, atol=1e-6), "table": table}
    return out


def _worker() -> None:
    from anyseek.kernels import fp8 as fp8_autograd
    from anyseek.kernels.ops import fp8 as fp8_ops
    from anyseek.kernels.triton import fp8_gemm, fp8_quant

    def same(a, b):
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))

    results = {}
    for shape in [(130, 300), (5, 40), "ties"]:
        x = _ties() if shape == "ties" else _spread(*shape, seed=8)
        q0, s0 = ref.quantize_rows(x)
        cases = {"rows": (fp8_quant.quantize_rows(x), (q0, s0)),
                 "rows_t": (fp8_quant.quantize_rows_t(x), ref.quantize_rows_t(x)),
                 "requantize_t": (fp8_quant.requantize_t(q0, s0), ref.requantize_t(q0, s0)),
                 "both": (fp8_quant.quantize_both(x), ref.quantize_both(x)),
                 "rows_pow2": (fp8_quant.quantize_rows(x, pow2=True), ref.quantize_rows(x, pow2=True)),
                 "pack": (fp8_quant.pack_rows(x), ref.pack_rows(x)),
                 "unpack": ([fp8_quant.unpack_rows(*ref.pack_rows(x), d) for d in (torch.bfloat16, torch.float32)],
                            [ref.unpack_rows(*ref.pack_rows(x), d) for d in (torch.bfloat16, torch.float32)]),
                 "blocks": (fp8_quant.quantize_blocks(x), (*ref.quantize_blocks(x), ref.quantize_blocks(x)[0].t()))}
        for name, (got, want) in cases.items():
            ok = all(same(g, w) if g.dtype == torch.float8_e4m3fn else torch.equal(g, w) for g, w in zip(got, want))
            results[f"{name}{shape}"] = {"pass": ok, "table": [name, str(shape)]}
    a, b = _spread(70, 300, seed=9), _spread(45, 300, seed=10)
    for out_dtype in (torch.float32, torch.bfloat16):
        for blocks in (False, True):
            table = _gemm_table(fp8_gemm.gemm, a, b, out_dtype, blocks)
            results[f"gemm_{str(out_dtype)[6:]}_{'blocks' if blocks else 'rows'}"] = {
                "pass": interpreter.passes(table, atol=1e-6), "table": table}
    table = _gemm_table(lambda *args: fp8_gemm.gemm(*args, scaled=True), a, b, torch.float32, True)  # (sm_120's)
    results["gemm_dot_scaled"] = {"pass": interpreter.passes(table, atol=1e-6), "table": table}
    for blocks, scales_t in ((True, False), (True, True), (False, False)):  # the GPU's 128-wide tiles, both scale
        cfg = {"BM": 32, "BN": 128, "GROUP_M": 2, "num_warps": 4, "num_stages": 1, "SCALES_T": scales_t}  # layouts
        table = _gemm_table(lambda *args: fp8_gemm.gemm(*args, config=cfg), a, b, torch.float32, blocks)
        results[f"gemm_bn128_{'blocks' if blocks else 'rows'}_{'t' if scales_t else 'strided'}"] = {
            "pass": interpreter.passes(table, atol=1e-6), "table": table}
    x, w, dy = _spread(3, 50, 300, seed=11), _spread(200, 300, seed=12), _spread(3, 50, 200, seed=13)
    outs = []
    results.update(_grouped_cases())
    # the custom ops traced by torch.compile through their fake implementations (aot_eager: no C++ compiler)
    compiled = torch.compile(fp8_ops.fp8_linear, backend="aot_eager", fullgraph=True)
    for fn in (fp8_ops.fp8_linear, fp8_autograd.fp8_linear_reference, compiled):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xg, wg)
        y.backward(dy)
        outs.append([y, xg.grad, wg.grad])
    for name, (got, want) in {"linear_vs_reference": (outs[0], outs[1]), "compile": (outs[2], outs[0])}.items():
        table = [(n, ((t - r).norm() / r.norm()).item(), 0.0) for n, t, r in zip(["y", "dx", "dW"], got, want)]
        results[name] = {"pass": interpreter.passes(table, atol=1e-6), "table": table}
    ids, ts, dy = _experts_case()  # (every buffer the kernels allocate starts as NaN: `interpreter._poison`)
    got = _run_experts(fp8_ops.fp8_routed_experts, ids, ts, dy)
    want = _run_experts(fp8_autograd.fp8_routed_experts_reference, ids, ts, dy)
    table = [(n, ((t - r).norm() / r.norm()).item(), 0.0)
             for n, t, r in zip(["y", "dx", "d weights", "d gate_up", "d down"], got, want)]  # fmt: skip
    results["experts_vs_reference"] = {"pass": interpreter.passes(table, atol=1e-6), "table": table}
    interpreter.report(results)


INTERP_CASES = ([f"{n}{s}" for s in [(130, 300), (5, 40), "ties"]
                 for n in ("rows", "rows_t", "requantize_t", "both", "blocks", "rows_pow2", "pack", "unpack")]
                + [f"gemm_{d}_{b}" for d in ("float32", "bfloat16") for b in ("rows", "blocks")]
                + ["gemm_bn128_blocks_strided", "gemm_bn128_blocks_t", "gemm_bn128_rows_strided"]
                + ["gemm_dot_scaled", "linear_vs_reference", "compile", "grouped_gathered", "grouped_scattered_bf16", "grouped_plan_rows",
                   "grouped_bn128",
                   "experts_vs_reference"])


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.parametrize("name", INTERP_CASES)
def test_interpreter(interp_results, name):
    """Quantize kernels bit for bit as the twin; the GEMM within 2x of fp64 on the same operands; the autograd
    Function on the Triton kernels as on the twin's (to fp32 rounding), and the same under torch.compile."""
    interpreter.check(interp_results, name, "(what, err, err_torch)")


@pytest.mark.cuda
def test_cuda_quantizers_give_the_twins_bits():
    """On the GPU each Triton quantizer writes the twin's E4M3 codes and scales bit for bit (the interpreter cannot
    tell: it rounds as PyTorch does): 1x128 rows, x^T's tiles, Wgrad's re-tiling of the FP8 x, dy's two layouts at
    once, 128x128 blocks; 2,000 tokens (a short last tile), the 16B expert width. At stop 46 on an H200 fp8_linear's
    output was 0.33% (relative L2) from its twin and its fp32 dW 2.56 from fp64 on the twin's operands (bound
    0.039), while the GEMM on the twin's operands was within its bound: so the operands differ."""
    from anyseek.kernels.triton import fp8_quant as tq

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm_89 or later")
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(2000, 2048, generator=g) * torch.rand(2000, 1, generator=g) * 4).cuda().bfloat16()
    w = (torch.randn(1408, 2048, generator=g) * 0.02).cuda()

    def same(got, want, what):
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape, (what, i, a.shape, b.shape)
            a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
            bad = (a != b).sum().item()
            assert bad == 0, f"{what} output {i}: {bad} of {a.numel()} differ"

    same(tq.quantize_rows(x), ref.quantize_rows(x), "quantize_rows")
    same(tq.quantize_rows(x, pow2=True), ref.quantize_rows(x, pow2=True), "quantize_rows pow2")
    same([tq.unpack_rows(*tq.pack_rows(x), torch.bfloat16)], [ref.unpack_rows(*ref.pack_rows(x), torch.bfloat16)],
         "pack_rows, unpack_rows")
    same(tq.quantize_rows_t(x), ref.quantize_rows_t(x), "quantize_rows_t")
    same(tq.quantize_both(x), ref.quantize_both(x), "quantize_both")
    q, sc = ref.quantize_rows(x)
    same(tq.requantize_t(q, sc), ref.requantize_t(q, sc), "requantize_t")
    got = tq.quantize_blocks(w)
    same(got[:2], ref.quantize_blocks(w), "quantize_blocks")


@pytest.mark.cuda
@pytest.mark.parametrize("M,N,K", [(200, 136, 4096 + 77), (130, 200, 300)])
def test_cuda_gemm_and_linear(M, N, K):
    """The GEMM on the GPU within 2x of fp64 on the same operands (beside the emulated promoted tensor-core sum for
    fp32 out: without the promotion, K = 4096 falls well outside); the linear layer as its twin to bf16 rounding."""
    from anyseek.kernels import fp8 as fp8_autograd
    from anyseek.kernels.ops import fp8 as fp8_ops
    from anyseek.kernels.triton import fp8_gemm

    a, b = _spread(M, K, seed=14).cuda(), _spread(N, K, seed=15).cuda()
    for out_dtype in (torch.float32, torch.bfloat16):
        for blocks in (False, True):
            table = _gemm_table(fp8_gemm.gemm, a, b, out_dtype, blocks, tensor_cores=True)
            assert interpreter.passes(table, atol=1e-6), (out_dtype, blocks, table)
    x, w = _bounded(M, K, seed=16).cuda().bfloat16(), _bounded(N, K, seed=17).cuda()
    y = fp8_ops.fp8_linear(x, w)
    y_ref = fp8_autograd.fp8_linear_reference(x, w)
    assert y.dtype == torch.bfloat16 and ((y.float() - y_ref.float()).norm() / y_ref.float().norm()) < 2 ** -8


def test_gemm_compiles_for_sm89_and_sm120():
    """The promoted GEMM compiled (not run) for Ada and consumer Blackwell, which no test machine has: FP8 MMAs in
    the PTX, on sm_120 the block-scaled one (`benchmarks/fp8.py --only compile` does every kernel for sm_89, sm_90
    and sm_120)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from anyseek.kernels.triton import fp8_gemm

    sig = {"A": "*fp8e4nv", "SA": "*fp32", "B": "*fp8e4nv", "SB": "*fp32", "C": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "stride_a": "i32", "stride_b": "i32", "stride_c": "i32", "stride_sa": "i32", "stride_sb": "i32"}
    for cap, mma in ((89, "e4m3.e4m3.f32"), (120, "kind::mxf8f6f4")):  # sm_120: the block-scaled MMA (`block_dot`)
        const = {"B_BLOCKS": True, "BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "SCALED": cap == 120,
                 "SCALES_T": True}
        k = triton.compile(ASTSource(fp8_gemm._gemm_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const),
                           target=GPUTarget("cuda", cap, 32), options={"num_warps": 8, "num_stages": 4})
        assert "mma.sync" in k.asm["ptx"] and mma in k.asm["ptx"] and k.asm["cubin"], cap


# --------------------------------------------------------------------------------------------------- the transform


def test_config_key():
    assert load_run_config("tiny", []).train.precision == "bf16"
    assert load_run_config("tiny", ["--train.precision=fp8"]).train.precision == "fp8"
    with pytest.raises(ConfigError, match="train.precision"):
        load_run_config("tiny", ["--train.precision=fp16"])


def _tiny_model():
    return tiny_model(num_hidden_layers=2)


def test_cpu_without_the_emulation_is_an_error_that_says_why():
    from anyseek.transforms.fp8 import FP8

    with pytest.raises(RuntimeError, match="ANYSEEK_FP8=reference"):
        FP8().apply(_tiny_model())


def test_apply_converts_the_recipe_layers_and_revert_gives_the_plain_model(monkeypatch):
    from anyseek.model.moe import Experts
    from anyseek.transforms.fp8 import FP8, FP8Experts, FP8Linear

    monkeypatch.setenv("ANYSEEK_FP8", "reference")
    model = _tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, model.config.vocab_size, (1, 40))
    FP8().apply(model)
    converted = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert converted and all(n.rsplit(".", 1)[-1] in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
                                                       "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                             for n in converted)  # fmt: skip
    assert not any("lm_head" in n or "embed" in n or n.endswith(".gate") for n in converted)
    experts = [n for n, m in model.named_modules() if isinstance(m, FP8Experts)]
    assert experts and len(experts) == len(model.moe_layers())
    assert any("shared_experts" in n for n in converted) and any("mlp.gate_proj" in n for n in converted)
    assert set(model.state_dict()) == set(before)
    calls = []
    real = kernels.fp8_linear
    monkeypatch.setattr(FP8Linear, "fused_matmul", staticmethod(lambda x, w: calls.append(w.shape) or real(x, w)))
    model(tokens)
    assert len(calls) >= 4  # q_a|kv_a and gate|up, per layer that has them: the joined layers go through FP8 too
    FP8().revert(model)
    assert not any(isinstance(m, (FP8Linear, FP8Experts)) for m in model.modules())
    assert all(type(m.experts) is Experts for m in model.moe_layers())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fp8_with_lora_is_a_config_error():
    with pytest.raises(ConfigError, match="precision=fp8"):
        load_run_config("tiny", ["--train.precision=fp8", "--train.lora_rank=4", "--train.init=x"])


def test_tiny_model_trains_in_fp8_close_to_full_precision(data_dir, tmp_path, monkeypatch):
    """Four steps of the tiny model through the PyTorch emulation: every loss within 0.5% of the unconverted run's
    (the issue's bar for the 1,000-step comparison; measured here: <= 0.04%), and not identical to it (the layers
    did change)."""
    from anyseek.transforms.fp8 import FP8Experts, FP8Linear

    monkeypatch.setenv("ANYSEEK_FP8", "reference")
    calls = []
    for cls in (FP8Linear, FP8Experts):  # the trainer's model really runs the converted layers
        monkeypatch.setattr(cls, "forward", lambda self, *a, _f=cls.forward, **k: calls.append(type(self)) or
                            _f(self, *a, **k))  # fmt: skip
    run(tiny_cfg(data_dir, "--train.max_steps=4", "--train.device=cpu"), tmp_path / "a")
    assert not calls
    run(tiny_cfg(data_dir, "--train.max_steps=4", "--train.device=cpu", "--train.precision=fp8"), tmp_path / "b")
    assert set(calls) == {FP8Linear, FP8Experts}
    base, fp8 = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert len(base) == len(fp8) == 4
    rel = [abs(base[s] - fp8[s]) / base[s] for s in base]
    assert max(rel) < 0.005 and max(rel) > 0, rel


@pytest.mark.cuda
def test_cuda_experts_match_their_twin():
    """The Triton FP8 routed experts on the GPU against the PyTorch twin on the same inputs (bf16 activations): the
    output and every gradient to within bf16 rounding (they differ only in the order and precision of the sums)."""
    from anyseek.kernels import fp8 as fp8_autograd
    from anyseek.kernels.ops import fp8 as fp8_ops

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+")
    ids, ts, dy = _experts_case()
    ids, ts, dy = ids.cuda(), [t.cuda() for t in ts], dy.cuda().bfloat16()
    ts[0] = ts[0].bfloat16()
    got = _run_experts(fp8_ops.fp8_routed_experts, ids, ts, dy)
    want = _run_experts(fp8_autograd.fp8_routed_experts_reference, ids, ts, dy)
    for name, a, b in zip(["y", "dx", "d weights", "d gate_up", "d down"], got, want):
        assert ((a.float() - b.float()).norm() / b.float().norm()) < 2 ** -7, name


@pytest.mark.cuda
def test_cuda_trainer_fp8_steps_close_to_bf16(data_dir, tmp_path):
    """On a GPU with FP8 tensor cores: the tiny model's `anyseek train` step (CUDA graphs, bf16 working copy) with
    train.precision=fp8 through the Triton kernels, every loss within 0.5% of the bf16 run's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+")
    run(tiny_cfg(data_dir, "--train.max_steps=6", "--train.device=cuda"), tmp_path / "a")
    run(tiny_cfg(data_dir, "--train.max_steps=6", "--train.device=cuda", "--train.precision=fp8"), tmp_path / "b")
    base, fp8 = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert registry.choose("fp8_linear", torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16))[1] == "triton"
    rel = [abs(base[s] - fp8[s]) / base[s] for s in base]
    assert len(rel) == 6 and max(rel) < 0.005 and max(rel) > 0, rel


if __name__ == "__main__":
    _worker()
