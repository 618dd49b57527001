"""Triton routed experts: on CPU under TRITON_INTERPRET=1 (in a subprocess, so the variable never leaks into
other tests that import triton), and on a GPU (marked cuda).

The rule (flash-attention's): max|kernel - fp32 ref| <= 2 * max|reference in the low precision - fp32 ref| (+ a
small atol), for the output and the gradients of x, the routing weights, gate_up_proj and down_proj.
"""

import os

import interpreter
import pytest
import torch

# (name, T, D, I, E, K, routing, dtype): small shapes, widths not a multiple of the 16-wide interpreter tiles
INTERP_CASES = [
    ("balanced_fp16", 37, 48, 40, 5, 2, "balanced", "float16"),
    ("skewed_fp16", 50, 32, 24, 8, 3, "skewed", "float16"),
    ("sparse_fp32", 29, 40, 20, 9, 2, "sparse", "float32"),
    ("one_expert_fp16", 40, 32, 16, 4, 1, "one_expert", "float16"),
    ("one_token_fp16", 1, 24, 16, 6, 4, "balanced", "float16"),
    ("no_tokens_fp32", 0, 16, 16, 3, 2, "balanced", "float32"),
] + [(f"top{k}_fp32", 6, 16, 24, 8, k, "balanced", "float32") for k in range(1, 9)]


def _lora_case(inputs, rank: int, scale: float, seed: int):
    """run(merged, dtype) -> [y, dx, dw, dA_gu, dB_gu, dA_dn, dB_dn] in fp32 for LoRA routed experts (adapter scale
    0.5) on `inputs` (accuracy.moe_inputs) with random adapters: through the Triton LoRA path, or (merged) the
    Triton experts on the effective weights W + s B A."""
    from anyseek.kernels.ops import moe

    x, ids, w, gu, dn, dy = inputs
    E, F, D = gu.shape
    g = torch.Generator(device=x.device).manual_seed(seed)
    ad = [torch.randn(*shape, generator=g, device=x.device) * scale
          for shape in ((E, rank, D), (E, F, rank), (E, rank, F // 2), (E, D, rank))]

    def run(merged: bool, dtype):
        xs = [t.to(dtype).detach().requires_grad_() for t in (x, w, *ad)]
        a_gu, b_gu, a_dn, b_dn = xs[2:]
        if merged:
            y = moe.routed_experts(xs[0], ids, xs[1], torch.baddbmm(gu.to(dtype), b_gu, a_gu, alpha=0.5),
                                   torch.baddbmm(dn.to(dtype), b_dn, a_dn, alpha=0.5))  # fmt: skip
        else:
            y = moe.lora_routed_experts(xs[0], ids, xs[1], gu.to(dtype), dn.to(dtype), a_gu, b_gu, a_dn, b_dn, 0.5)
        (y.float() * dy).sum().backward()
        return [y.float()] + [t.grad.float() for t in xs]

    return run


def _inference_case(inputs, dtype, device) -> tuple[list[str], float, float]:
    """The forward without gradients (decoding), where few rows take the "small_" launch settings and a plan of
    their row tile: -> (the launch settings the experts asked for, err, err_pt) of y against the fp32 reference,
    next to the reference in `dtype`; an addend (the shared experts' output) summed in the combine."""
    from anyseek.kernels.ops import moe
    from anyseek.kernels.reference.moe import routed_experts as ref_fn
    from anyseek.kernels.triton import moe as tri

    x, ids, w, gu, dn, _ = (t.to(device) for t in inputs)
    add = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(device)
    asked, config = [], tri._config
    tri._config = lambda dev, kind: asked.append(kind) or config(dev, kind)
    try:
        with torch.no_grad():  # weights that require gradients, as a model's parameters do while it decodes
            gu_p, dn_p = gu.to(dtype).requires_grad_(), dn.to(dtype).requires_grad_()
            y = moe.routed_experts(x.to(dtype), ids, w, gu_p, dn_p, add_TD=add.to(dtype)).float()
    finally:
        tri._config = config
    with torch.no_grad():
        ref = ref_fn(x, ids, w, gu, dn) + add
        pt = ref_fn(x.to(dtype), ids, w, gu.to(dtype), dn.to(dtype)).float() + add.to(dtype).float()
    return asked, (y - ref).abs().max().item(), (pt - ref).abs().max().item()


def _worker() -> None:
    """Runs in the subprocess: every case, determinism, torch.compile, the registry; prints one JSON line."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import moe
    from anyseek.kernels.triton import moe_plan

    results = {}
    for name, T, D, I, E, K, routing, dtype in INTERP_CASES:
        dt = getattr(torch, dtype)
        table = accuracy.moe_error_table(moe.routed_experts, accuracy.moe_inputs(T, D, I, E, K, routing, 1), dt, "cpu")
        results[name] = {"pass": accuracy.passes(table, dt), "table": table}
    # decoding (no gradients, few rows): the "small_" settings, whose row tile (32 here) differs from the plan's
    # usual one (16): a plan built for a wider tile would leave rows out (45 tokens over 3 experts: more rows an
    # expert than one tile)
    rows = []
    for T, E, K, routing, dt in [(1, 6, 4, "balanced", torch.float16), (45, 3, 2, "skewed", torch.float16),
                                 (13, 9, 3, "sparse", torch.float32)]:  # fmt: skip
        asked, err, err_pt = _inference_case(accuracy.moe_inputs(T, 40, 24, E, K, routing, 3), dt, "cpu")
        rows.append((asked, err, err_pt, err <= 2 * err_pt + 1e-4))
    ok = all(r[-1] and r[0] == ["small_gemm", "small_swiglu", "small_gemm"] for r in rows)
    results["inference_small"] = {"pass": ok, "table": rows}
    # the routing plan: rows grouped by expert, stable, tiles inside one expert, every row in exactly one tile
    ids = accuracy.moe_routing(40, 7, 3, "skewed", torch.Generator().manual_seed(2))
    slot, tok, offs, tile_e, tile_row = moe_plan.build_plan(ids, 7, 16)
    flat = ids.reshape(-1)
    grouped = torch.equal(flat[slot.long()], flat.sort(stable=True).values) and torch.equal(tok, slot // 3)
    stable = all(torch.equal(s, s.sort().values) for s in (slot[offs[e] : offs[e + 1]] for e in range(7)))
    covered = torch.zeros(120, dtype=torch.long)
    for e, r in zip(tile_e.tolist(), tile_row.tolist()):
        if e >= 0:
            covered[r : min(r + 16, offs[e + 1].item())] += 1
            grouped &= offs[e].item() <= r < offs[e + 1].item()
    ok = bool(grouped and stable and torch.equal(covered, torch.ones(120, dtype=torch.long)))
    results["plan"] = {"pass": ok and len(tile_e) == 120 // 16 + 1 + 7, "table": []}
    # the counting sort equals the stable torch.sort plan bit for bit, any shape and routing
    same = []
    for i, (T, K, E, bm, routing) in enumerate([(999, 3, 16, 16, "skewed"), (1, 8, 16, 16, "balanced"),
                                                (513, 1, 8, 16, "one_expert"), (0, 2, 4, 16, "balanced"),
                                                (3000, 6, 64, 64, "sparse"), (40000, 2, 8, 128, "skewed")]):
        ids = accuracy.moe_routing(T, E, K, routing, torch.Generator().manual_seed(i))
        got, want = moe_plan.build_plan(ids, E, bm), moe_plan.build_plan_torch(ids, E, bm)
        same.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    results["plan_is_stable_sort"] = {"pass": all(same), "table": same}
    # slots no expert takes (id E: expert parallelism's empty receive rows): placed after every expert, in no tile;
    # the experts' output and gradients on the other rows as if those slots were not there (the reference's), and
    # zero routing-weight gradients on them
    x, _, w, gu, dn, dy = accuracy.moe_inputs(45, 32, 24, 5, 1, "balanced", 11)
    ids = torch.randint(0, 5, (45, 1), generator=torch.Generator().manual_seed(3))
    ids[torch.tensor([0, 7, 8, 9, 30, 44])] = 5
    got = moe_plan.build_plan(ids, 5, 16)
    same_plan = all(torch.equal(a, b) for a, b in zip(got, moe_plan.build_plan_torch(ids, 5, 16)))
    sentinel_rows_last = bool(got[2][5] == 39 and (ids.reshape(-1)[got[0][39:].long()] == 5).all())
    from anyseek.kernels.reference import moe as moe_ref

    def both(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
        y = fn(leaves[0], ids, leaves[1], *leaves[2:])
        (y * dy).sum().backward()
        return [y.detach()] + [t.grad for t in leaves]

    tri, ref = both(moe.routed_experts), both(moe_ref.routed_experts)
    real = ids[:, 0] < 5
    close = [torch.allclose(tri[i][real], ref[i][real], atol=1e-5) for i in (0, 1, 2)]
    close += [torch.allclose(a, b, atol=1e-5) for a, b in zip(tri[3:], ref[3:])]
    close += [bool((tri[2][~real] == 0).all()), same_plan, sentinel_rows_last]
    results["no_expert_rows"] = {"pass": all(close), "table": close}
    # weight gradients written straight into their destinations (the working copy's flat buffer), same values
    from anyseek import kernels as kernels_mod

    x, ids, w, gu, dn, dy = accuracy.moe_inputs(37, 32, 24, 6, 3, "skewed", 5)
    flat_w = torch.cat([gu.reshape(-1), dn.reshape(-1)])
    flat_g = torch.full_like(flat_w, float("nan"))  # every element must be written
    pg = torch.nn.Parameter(flat_w[:gu.numel()].view(gu.shape))
    pd = torch.nn.Parameter(flat_w[gu.numel():].view(dn.shape))
    kernels_mod.set_grad_destination(pg, flat_g, 0)
    kernels_mod.set_grad_destination(pd, flat_g, gu.numel())
    (moe.routed_experts(x, ids, w, pg, pd) * dy).sum().backward()
    in_place = pg.grad.data_ptr() == flat_g.data_ptr() and pd.grad.data_ptr() == flat_g[gu.numel():].data_ptr()
    qg, qd = (t.detach().clone().requires_grad_() for t in (gu, dn))
    (moe.routed_experts(x, ids, w, qg, qd) * dy).sum().backward()
    same = torch.equal(flat_g, torch.cat([qg.grad.reshape(-1), qd.grad.reshape(-1)]))
    results["grad_destination"] = {"pass": bool(in_place and same), "table": [in_place, same]}
    # LoRA experts: the adapters' gradients from rank-r products equal the merged-weight path's (fp32), and in fp16
    # both land as close to the fp32 truth (the 2x rule against the merged path in fp16)
    lora_run = _lora_case(accuracy.moe_inputs(37, 32, 24, 6, 3, "skewed", 7), rank=4, scale=0.2, seed=3)
    truth, lora32 = lora_run(True, torch.float32), lora_run(False, torch.float32)
    close32 = [torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(lora32, truth)]
    lora16, merged16 = lora_run(False, torch.float16), lora_run(True, torch.float16)
    table = [((a - t).abs().max().item(), (m - t).abs().max().item()) for a, m, t in zip(lora16, merged16, truth)]
    rule16 = [e <= 2 * e_pt + 1e-3 for e, e_pt in table]
    results["lora"] = {"pass": all(close32) and all(rule16), "table": [close32, table]}
    # the adapters' gradients written straight into their destinations (four parameters back to back in the
    # working copy's buffer, fp16 as the computation): in place, the same values as without destinations, B's
    # gradient scaled once; fp32 adapters under fp16 compute (no destination: cast) give the merged path's too
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(29, 32, 24, 5, 2, "skewed", 11)
    g = torch.Generator().manual_seed(6)
    ad = [torch.randn(*s, generator=g) * 0.2 for s in ((5, 4, 32), (5, 48, 4), (5, 4, 24), (5, 32, 4))]
    buf = torch.full((sum(t.numel() for t in ad),), float("nan"), dtype=torch.float16)
    ps = [torch.nn.Parameter(t.half()) for t in ad]
    at = 0
    for p_ in ps:
        kernels_mod.set_grad_destination(p_, buf, at)
        at += p_.numel()
    xh, wh = x.half(), w.half()
    (moe.lora_routed_experts(xh, ids, wh, gu.half(), dn.half(), *ps, 0.5).float() * dy).sum().backward()
    starts = [0] + [int(v) for v in torch.tensor([t.numel() for t in ad]).cumsum(0)[:-1]]
    in_place = all(p_.grad.data_ptr() == buf[s0:].data_ptr() for p_, s0 in zip(ps, starts))
    qs = [t.half().requires_grad_() for t in ad]
    (moe.lora_routed_experts(xh, ids, wh, gu.half(), dn.half(), *qs, 0.5).float() * dy).sum().backward()
    same = torch.equal(buf, torch.cat([q.grad.reshape(-1) for q in qs]))
    rs = [t.clone().requires_grad_() for t in ad]  # fp32 adapters, fp16 compute: B scaled in fp32, cast back
    (moe.lora_routed_experts(xh, ids, wh, gu.half(), dn.half(), *rs, 0.5).float() * dy).sum().backward()
    cast = all(r.grad.dtype == torch.float32 and torch.allclose(r.grad.half(), q.grad, rtol=1e-2, atol=1e-3)
               for r, q in zip(rs, qs))  # fmt: skip
    results["lora_grad_destination"] = {"pass": bool(in_place and same and cast), "table": [in_place, same, cast]}
    # a rank that is not a power of two (the rank tiles padded to 32), every expert busy
    lora_run = _lora_case(accuracy.moe_inputs(41, 48, 40, 4, 2, "balanced", 8), rank=20, scale=0.1, seed=4)
    truth, lora32 = lora_run(True, torch.float32), lora_run(False, torch.float32)
    close32 = [torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(lora32, truth)]
    results["lora_rank20"] = {"pass": all(close32), "table": close32}
    # LoRA experts with an addend summed inside the combine: experts + add, add's gradient dy, the others unchanged
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(23, 32, 24, 5, 2, "skewed", 9)
    g = torch.Generator().manual_seed(5)
    ad = [torch.randn(*s, generator=g) * 0.2 for s in ((5, 4, 32), (5, 48, 4), (5, 4, 24), (5, 32, 4))]
    add = torch.randn(23, 32, generator=g)
    runs = []
    for with_add in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, w, *ad, add)]
        y = moe.lora_routed_experts(leaves[0], ids, leaves[1], gu, dn, *leaves[2:6], 0.5,
                                    leaves[6] if with_add else None)  # fmt: skip
        (y * dy).sum().backward()
        runs.append((y.detach(), leaves))
    (y1, l1), (y0, l0) = runs
    close = [torch.allclose(y1, y0 + add, atol=1e-5), torch.equal(l1[6].grad, dy)]
    close += [torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(l1[:6], l0[:6])]
    results["lora_addend"] = {"pass": all(close), "table": close}
    # bitwise deterministic, output and gradients
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(33, 32, 24, 6, 3, "skewed", 4)
    runs = [accuracy._run_moe(moe.routed_experts, [x, ids, w, gu, dn, dy], torch.float16, "cpu") for _ in range(2)]
    results["deterministic"] = {"pass": all(torch.equal(a, b) for a, b in zip(*runs)), "table": []}
    # torch.compile traces the custom ops through their fake implementations (aot_eager: no C++ compiler)
    xs = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    fn = torch.compile(lambda a, b, c, d: moe.routed_experts(a, ids, b, c, d).square().sum(), backend="aot_eager",
                       fullgraph=True)  # fmt: skip
    fn(*xs).backward()
    compiled = [t.grad.clone() for t in xs]
    for t in xs:
        t.grad = None
    moe.routed_experts(xs[0], ids, *xs[1:]).square().sum().backward()
    results["compile"] = {"pass": all(torch.allclose(a, t.grad, atol=1e-5) for a, t in zip(compiled, xs)), "table": []}
    # an addend (the shared experts' output) summed inside the combine: the output is experts + add, add's gradient
    # is dy, the others' unchanged; an fp16 addend beside an fp32 computation is added after (same values); and
    # through torch.compile's fake implementations
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(29, 32, 24, 6, 3, "skewed", 6)
    add = torch.randn(29, 32)
    leaves = [t.clone().requires_grad_() for t in (x, w, gu, dn, add)]
    y = moe.routed_experts(*leaves[:1], ids, *leaves[1:4], add_TD=leaves[4])
    (y * dy).sum().backward()
    plain = [t.clone().requires_grad_() for t in (x, w, gu, dn)]
    y0 = moe.routed_experts(plain[0], ids, *plain[1:])
    (y0 * dy).sum().backward()
    close = [torch.allclose(y, y0 + add, atol=1e-5), torch.equal(leaves[4].grad, dy)]
    close += [torch.allclose(a.grad, b.grad, atol=1e-5) for a, b in zip(leaves[:4], plain)]
    y16 = moe.routed_experts(x, ids, w, gu, dn, add_TD=add.half())
    close.append(y16.dtype == torch.float32 and torch.allclose(y16, y0 + add.half().float(), atol=1e-5))
    fn = torch.compile(lambda a, b: moe.routed_experts(a, ids, w, gu, dn, add_TD=b).square().sum(),
                       backend="aot_eager", fullgraph=True)  # fmt: skip
    xa = [t.clone().requires_grad_() for t in (x, add)]
    fn(*xa).backward()
    close.append(torch.allclose(xa[1].grad, 2 * (y0 + add).detach(), atol=1e-4))
    results["addend"] = {"pass": all(close), "table": close}
    # ANYSEEK_MOE=triton hands out the triton backend of both expert seams, here on CPU under the interpreter
    from anyseek.kernels import registry

    os.environ["ANYSEEK_MOE"] = "triton"
    picked = [registry.choose(op, x) for op in ("routed_experts", "lora_routed_experts")]
    ok = [name == "triton" for _, name, _ in picked] + [picked[1][0] is moe.lora_routed_experts]
    results["registry"] = {"pass": all(ok), "table": ok}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in INTERP_CASES]
                         + ["inference_small", "plan", "plan_is_stable_sort", "no_expert_rows", "grad_destination", "lora_grad_destination", "lora", "lora_rank20", "lora_addend",
                            "deterministic",
                            "compile", "addend", "registry"])
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(grad, err, err_pt)")


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,rank", [((2048, 256, 128, 16, 4), 16), ((777, 200, 136, 16, 6), 8),
                                        ((1000, 256, 96, 8, 2), 64)])  # fmt: skip
def test_gpu_lora_experts(shape, rank, dtype):
    """LoRA routed experts (adapters inside the Triton path) against the fp32 merged-weight truth, within twice the
    error of the merged-weight path in the same low precision: output, dx, routing weights, the four adapters.
    Widths that are no multiple of the tiles, ranks below and above the 16-wide rank tile."""
    from anyseek.kernels import accuracy

    run = _lora_case([t.cuda() for t in accuracy.moe_inputs(*shape, "skewed", 11)], rank=rank,
                     scale=0.05, seed=5)  # fmt: skip
    truth, got, pt = run(True, torch.float32), run(False, dtype), run(True, dtype)
    table = [((a - t).abs().max().item(), (b - t).abs().max().item()) for a, b, t in zip(got, pt, truth)]
    assert all(e <= 2 * e_pt + 1e-3 for e, e_pt in table), table


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [(1000, 256, 96, 8, 2), (777, 200, 136, 16, 6), (1, 256, 128, 8, 8), (2048, 512, 256, 32, 4), (300, 128, 64, 64, 8)],
)
@pytest.mark.parametrize("routing", ["balanced", "skewed", "sparse", "one_expert"])
def test_gpu_routed_experts(shape, routing, dtype):
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import moe

    T, D, I, E, K = shape
    table = accuracy.moe_error_table(moe.routed_experts, accuracy.moe_inputs(T, D, I, E, K, routing, 0), dtype, "cuda")
    assert accuracy.passes(table, dtype), table


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(8192, 4, 32, 128), (8192, 8, 256, 128), (32768, 6, 64, 128), (1, 8, 256, 128),
                                   (0, 4, 32, 128), (65536, 8, 256, 64)])
@pytest.mark.parametrize("routing", ["balanced", "skewed", "one_expert"])
def test_gpu_plan_is_stable_sort(shape, routing):
    from anyseek.kernels import accuracy
    from anyseek.kernels.triton import moe_plan

    T, K, E, bm = shape
    if routing == "one_expert" and K > 1:
        K = 1
    ids = accuracy.moe_routing(T, E, K, routing, torch.Generator().manual_seed(T)).cuda()
    got, want = moe_plan.build_plan(ids, E, bm), moe_plan.build_plan_torch(ids, E, bm)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2048, 1408, 64, 6), (64, 2048, 1408, 64, 6), (170, 2048, 1408, 64, 6),
                                   (3, 200, 136, 16, 6), (40, 256, 96, 8, 2)])  # fmt: skip
@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_gpu_inference_small(shape, routing, dtype):
    """Decoding's forward (no gradients, at most SMALL_ROWS rows: narrow row tiles) against the fp32 reference:
    the 16B expert shapes at batch 1, 64 and 170 (1,020 rows), and widths no multiple of the tiles."""
    from anyseek.kernels import accuracy

    T, D, I, E, K = shape
    asked, err, err_pt = _inference_case(accuracy.moe_inputs(T, D, I, E, K, routing, 2), dtype, "cuda")
    assert asked == ["small_gemm", "small_swiglu", "small_gemm"], asked
    assert err <= 2 * err_pt + 1e-3, (err, err_pt)


@pytest.mark.cuda
def test_gpu_no_recompile_and_deterministic():
    """New per-expert counts reuse the compiled kernels; two runs agree bit for bit."""
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import moe
    from anyseek.kernels.triton import moe_gemm

    def n_compiled():  # kernels compiled so far ({} where this Triton keeps its cache elsewhere)
        caches = getattr(moe_gemm._grouped_gemm_kernel, "device_caches", {})
        return sum(len(v[0]) for v in caches.values())

    outs = []
    for seed, routing in ((0, "balanced"), (1, "skewed"), (2, "sparse"), (2, "sparse")):
        x, ids, w, gu, dn, dy = accuracy.moe_inputs(512, 256, 128, 16, 4, routing, seed)
        outs.append(accuracy._run_moe(moe.routed_experts, [x, ids, w, gu, dn, dy], torch.bfloat16, "cuda"))
        if seed == 0:
            first = n_compiled()
    assert all(torch.equal(a, b) for a, b in zip(outs[2], outs[3]))
    assert n_compiled() == first


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_addend_in_the_combine(dtype):
    """The shared experts' output summed inside the combine: against the fp32 experts + addend, within 2x the error of
    adding it after (two roundings); the addend's gradient is dy, the others as without it."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from anyseek.kernels import accuracy
    from anyseek.kernels.ops import moe

    x, ids, w, gu, dn, dy = (t.cuda() for t in accuracy.moe_inputs(3001, 256, 128, 16, 4, "skewed", 9))
    add = torch.randn(3001, 256, device="cuda")
    truth = moe.routed_experts(x, ids, w, gu, dn).double() + add.double()  # fp32 everywhere
    low = [t.to(dtype).requires_grad_() for t in (x, gu, dn, add)]
    y = moe.routed_experts(low[0], ids, w, low[1], low[2], add_TD=low[3])
    xd, gd, dd, ad = (t.detach() for t in low)
    after = moe.routed_experts(xd, ids, w, gd, dd) + ad  # rounded, then added and rounded again
    err, err_after = (y.double() - truth).abs().max().item(), (after.double() - truth).abs().max().item()
    assert err <= 2 * err_after + 1e-6, (err, err_after)
    (y * dy.to(dtype)).sum().backward()
    assert torch.equal(low[3].grad, dy.to(dtype))
    plain = [t.detach().clone().requires_grad_() for t in low[:3]]
    (moe.routed_experts(plain[0], ids, w, plain[1], plain[2]) * dy.to(dtype)).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(low[:3], plain))


if __name__ == "__main__":
    _worker()
