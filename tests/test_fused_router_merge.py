"""The fused router (`kernels.route_topk`, group-limited top-k) and the low-rank merge (`kernels.low_rank_merge`,
W + s B A, into rows or a strip of a bigger buffer): the Triton backends against their pure-PyTorch twins, on CPU
under TRITON_INTERPRET=1 (in a subprocess: the variable never leaks; tests/interpreter.py) and on a GPU (marked
cuda); the router's twin is the model's old routing, the merge's seam checks its shapes.

The rules: the router picks exactly the twin's experts; max|merge - fp64 reference| <= 2 * max|PyTorch at the same
precision - fp64 reference| + a small atol.
"""

import interpreter
import pytest
import torch
from interpreter import passes

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


# the router's whole decision from its logits (decoding): (name, T, E, n_group, topk_group, top_k, top2, sigmoid,
# norm_topk_prob, scale)
WEIGHTS_CASES = [
    ("v3_sigmoid_norm", 37, 64, 8, 4, 6, True, True, True, 2.5),
    ("v2_softmax", 23, 160, 8, 3, 6, False, False, False, 1.0),
    ("softmax_norm_not_pow2", 11, 24, 1, 1, 5, True, False, True, 16.0),
    ("one_token_top1", 1, 64, 8, 1, 1, True, True, True, 1.0),
]


def weights_errors(T, E, G, TG, K, top2, sigmoid, norm, scale, device, seed=0):
    """[(what, err, 0)]: the fused router's experts per token against the twin's (as sets), and their weights
    (matched by expert) relative to the largest."""
    from anyseek.kernels.reference.router import route_weights as ref
    from anyseek.kernels.triton.router import route_weights as fused

    g = torch.Generator().manual_seed(seed)
    logits, bias = torch.randn(T, E, generator=g) * 2, (torch.rand(E, generator=g) - 0.5) * 0.2
    want_ids, want_w = ref(logits, bias, K, G, TG, top2, sigmoid, norm, scale)
    got_ids, got_w = fused(logits.to(device), bias.to(device), K, G, TG, top2, sigmoid, norm, scale)
    assert got_ids.shape == got_w.shape == (T, K) and got_w.dtype == torch.float32
    (want_ids, o1), (got_ids, o2) = want_ids.sort(dim=1), got_ids.cpu().sort(dim=1)
    wrong = (got_ids != want_ids).any(dim=1).sum().item()
    err = ((got_w.cpu().gather(1, o2) - want_w.gather(1, o1)).abs().max() / want_w.abs().max()).item()
    return [("ids", wrong, 0), ("weights", err if err > 1e-6 else 0, 0)]


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


def _worker() -> None:
    """Runs in the subprocess: every case of this module; reports one JSON line."""
    results = {}
    for name, O, I, r, dt, out in MERGE_CASES:
        table = merge_errors(O, I, r, getattr(torch, dt), out, "cpu")
        results[f"merge_{name}"] = {"pass": passes(table), "table": table}
    for name, *case in ROUTER_CASES:
        table = router_errors(*case, "cpu")
        results[f"router_{name}"] = {"pass": all(err == 0 for _, err, _ in table), "table": table}
    for name, *case in WEIGHTS_CASES:
        table = weights_errors(*case, "cpu")
        results[f"weights_{name}"] = {"pass": all(err == 0 for _, err, _ in table), "table": table}
    from anyseek.kernels.triton.router import route_topk

    ids = route_topk(torch.full((5, 32), float("nan")), torch.zeros(32), 4, 4, 2, True)  # a non-finite step
    results["router_nan_rows_stay_valid"] = {"pass": bool(ids.min() >= 0 and ids.max() < 32), "table": ids.tolist()}
    interpreter.report(results)


@pytest.fixture(scope="module")
def interp_results():
    return interpreter.run_worker(__file__)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"router_{c[0]}" for c in ROUTER_CASES] + ["router_nan_rows_stay_valid"]
                         + [f"weights_{c[0]}" for c in WEIGHTS_CASES] + [f"merge_{c[0]}" for c in MERGE_CASES])
def test_interpreter(interp_results, name):
    interpreter.check(interp_results, name, "(what, err, err_torch)")


@pytest.mark.parametrize("flavor", ["16B", "tiny"])
def test_route_weights_twin_is_the_models_router(flavor):
    """`kernels.route_weights` (the decode step's router) on the Router's own logits gives the Router's experts and
    weights: sigmoid, groups, normalization and scale as the flavor sets them (the model's code as the yardstick)."""
    from anyseek.kernels.reference.router import route_weights
    from anyseek.model.config import ModelConfig
    from anyseek.model.matmul import linear_fp32
    from anyseek.model.moe import Router

    cfg = ModelConfig.from_name(flavor, vocab_size=64)
    torch.manual_seed(0)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.05)
    router.e_score_correction_bias.uniform_(-0.05, 0.05)
    x = torch.randn(13, cfg.hidden_size)
    _, ids, w = router(x)
    got_ids, got_w = route_weights(linear_fp32(x, router.weight), router.e_score_correction_bias, router.top_k,
                                   router.n_group, router.topk_group, router.scoring_func == "sigmoid",
                                   router.scoring_func == "sigmoid", router.norm_topk_prob,
                                   router.routed_scaling_factor)  # fmt: skip
    assert torch.equal(got_ids, ids) and torch.allclose(got_w, w, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("case", WEIGHTS_CASES, ids=[c[0] for c in WEIGHTS_CASES])
def test_gpu_route_weights(case):
    table = weights_errors(*case[1:], "cuda")
    assert all(err == 0 for _, err, _ in table), table


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


if __name__ == "__main__":
    _worker()
