"""LoRA's two seams, `kernels.low_rank_linear` and `kernels.lora_routed_experts`: each default backend against its
reference twin (the 2x rule of `anyseek.kernels.accuracy` in bf16, fp32 to within rounding), the twins against
formulas written out here, and the registry's choice for both. The Triton LoRA experts are in test_moe_triton.py.
"""

from __future__ import annotations

import pytest
import torch

from anyseek import kernels
from anyseek.kernels import accuracy, registry
from anyseek.kernels.reference import lowrank as ref_lowrank

IN, OUT = 24, 40
BLOCKS = {"one": [(0, (OUT, 6))], "partial": [(3, (10, 2)), (20, (12, 4))]}  # partial: rows 0-2, 13-19, 32+ uncovered


@pytest.fixture(autouse=True)
def _auto_backends(monkeypatch):
    for var in ("ANYSEEK_MOE", "ANYSEEK_LOWRANK_LINEAR"):
        monkeypatch.delenv(var, raising=False)
    yield
    registry.set_backend("moe", None)
    registry.set_backend("low_rank_linear", None)


def _linear_inputs(rows: int, blocks: str, dropout: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(rows, IN), (OUT, IN), (sum(s[1] for _, s in BLOCKS[blocks]), IN)] + [s for _, s in BLOCKS[blocks]]
    ts = [torch.randn(*s, generator=g) for s in shapes]
    xd = torch.randn(rows, IN, generator=g) if dropout else None
    return ts, xd, [at for at, _ in BLOCKS[blocks]], torch.randn(rows, OUT, generator=g)


def _run_linear(fn, ts, xd, starts, dy, dtype):
    """[y, dx, dW, dA, dB_i..., (dxd)] in fp64 for fn in `dtype`, every input wanting a gradient."""
    leaves = [t.to(dtype).requires_grad_() for t in ts + ([xd] if xd is not None else [])]
    x, W, A, *Bs = leaves[:len(ts)]
    y = fn(x, W, A, list(zip(starts, Bs)), leaves[-1] if xd is not None else None, 0.75)
    grads = torch.autograd.grad(y, leaves, dy.to(y.dtype))
    return [y.double()] + [gr.double() for gr in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [10, 50])  # fewer rows than input features: the term added; more: merged weight
@pytest.mark.parametrize("blocks", ["one", "partial"])
@pytest.mark.parametrize("dropout", [False, True])
def test_low_rank_linear_default_backend_matches_reference_twin(dtype, rows, blocks, dropout):
    """The seam's default backend (`torch`, on the CPU) against the reference twin: the output and the gradients of
    x, W, A, each B block and the dropout input within twice the twin's own error in that dtype (both against the
    twin in fp64), plus the table's atol."""
    ts, xd, starts, dy = _linear_inputs(rows, blocks, dropout)
    assert registry.choose("low_rank_linear", ts[0].to(dtype))[1] == "torch"
    truth = _run_linear(ref_lowrank.low_rank_linear, ts, xd, starts, dy, torch.float64)
    got = _run_linear(kernels.low_rank_linear, ts, xd, starts, dy, dtype)
    pt = _run_linear(ref_lowrank.low_rank_linear, ts, xd, starts, dy, dtype)
    names = ["y", "dx", "dW", "dA"] + [f"dB{i}" for i in range(len(starts))] + (["dxd"] if dropout else [])
    table = [(n, (a - t).abs().max().item(), (b - t).abs().max().item()) for n, a, b, t in zip(names, got, pt, truth)]
    assert accuracy.passes(table, dtype), table


def test_low_rank_linear_reference_twin_is_the_formula():
    """The twin against x W^T + s (xd A^T) B^T written with a dense block-diagonal B, fp64, under autocast too
    (computed in the autocast dtype, as F.linear would)."""
    ts, xd, _, _ = _linear_inputs(7, "partial", True, seed=1)
    x, W, A, B1, B2 = (t.double() for t in ts)
    B = torch.zeros(OUT, 6, dtype=torch.float64)
    B[3:13, :2], B[20:32, 2:] = B1, B2
    want = x @ W.t() + 0.5 * (xd.double() @ A.t()) @ B.t()
    got = ref_lowrank.low_rank_linear(x, W, A, [(3, B1), (20, B2)], xd.double(), 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ref_lowrank.low_rank_linear(ts[0], ts[1], ts[2], [(3, ts[3]), (20, ts[4])], xd, 0.5)
    assert low.dtype == torch.bfloat16


def test_low_rank_linear_seam_names_bad_shapes():
    x, W, A, B = torch.randn(5, 8), torch.randn(6, 8), torch.randn(3, 8), torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"low_rank_linear: x \[\.\.\., in\], W \[out, in\], A \[r, in\]"):
        kernels.low_rank_linear(x, W, torch.randn(3, 7), B)
    with pytest.raises(ValueError, match=r"xd \(5, 7\) must have x's shape \(5, 8\)"):
        kernels.low_rank_linear(x, W, A, B, torch.randn(5, 7))
    with pytest.raises(ValueError, match="output column 4 must lie within W's 6 rows"):
        kernels.low_rank_linear(x, W, A, [(0, torch.randn(2, 1)), (4, torch.randn(3, 2))])
    with pytest.raises(ValueError, match="B's ranks add up to 2, A has 3 rows"):
        kernels.low_rank_linear(x, W, A, [(0, torch.randn(6, 2))])


# ---------------------------------------------------------------------------------------------------- experts


def _expert_inputs(T=23, D=16, I=8, E=5, K=2, r=3, seed=0):
    x, ids, w, gu, dn, dy = accuracy.moe_inputs(T, D, I, E, K, "skewed", seed)
    g = torch.Generator().manual_seed(seed + 1)
    ad = [torch.randn(*s, generator=g) * 0.3 for s in ((E, r, D), (E, 2 * I, r), (E, r, I), (E, D, r))]
    return x, ids, w, gu, dn, ad, torch.randn(T, D, generator=g), dy


def test_lora_routed_experts_reference_twin_is_the_per_token_formula():
    """The seam on the CPU (its reference twin) against each token's sum over its experts of
    down_e(silu(gate_e x) * up_e x) with every projection W x + s B (A x), written token by token (fp64): the
    output and the gradients of x, the routing weights, the four adapters and the addend."""
    x, ids, w, gu, dn, ad, add, dy = (t.double() if torch.is_tensor(t) and t.is_floating_point() else t
                                      for t in _expert_inputs())  # fmt: skip
    ad = [a.double() for a in ad]
    s, I = 1.5, dn.shape[-1]
    assert registry.choose("lora_routed_experts", x)[1] == "reference"

    def per_token(x, w, a_gu, b_gu, a_dn, b_dn, add):
        rows = []
        for t in range(x.shape[0]):
            y = add[t]
            for k in range(ids.shape[1]):
                e = ids[t, k]
                h = gu[e] @ x[t] + s * b_gu[e] @ (a_gu[e] @ x[t])
                act = torch.nn.functional.silu(h[:I]) * h[I:]
                y = y + w[t, k] * (dn[e] @ act + s * b_dn[e] @ (a_dn[e] @ act))
            rows.append(y)
        return torch.stack(rows)

    leaves = [t.clone().requires_grad_() for t in (x, w, *ad, add)]
    got = kernels.lora_routed_experts(leaves[0], ids, leaves[1], gu, dn, *leaves[2:6], s, leaves[6])
    want_leaves = [t.clone().requires_grad_() for t in (x, w, *ad, add)]
    want = per_token(*want_leaves)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # (the combine sums in fp32)
    for a, b in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, want_leaves, dy)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_lora_routed_experts_reference_keeps_the_effective_weight_path_bit_for_bit():
    """What LoRAExperts ran before the seam: routed_experts on W + s B A (one baddbmm each; a bf16 base as apply_lora
    holds it, fp32 adapters). The twin gives the same output and gradients, bit for bit."""
    x, ids, w, gu, dn, ad, add, dy = _expert_inputs(seed=3)
    x, gu, dn, add = x.bfloat16(), gu.bfloat16(), dn.bfloat16(), add.bfloat16()
    leaves = [t.clone().requires_grad_() for t in (x, w, *ad)]
    y = kernels.lora_routed_experts(leaves[0], ids, leaves[1], gu, dn, *leaves[2:], 2.0, add)
    old = [t.clone().requires_grad_() for t in (x, w, *ad)]
    egu = torch.baddbmm(gu, old[3].to(gu.dtype), old[2].to(gu.dtype), alpha=2.0)
    edn = torch.baddbmm(dn, old[5].to(dn.dtype), old[4].to(dn.dtype), alpha=2.0)
    y_old = kernels.routed_experts(old[0], ids, old[1], egu, edn, add)
    assert torch.equal(y, y_old)
    grads, grads_old = torch.autograd.grad(y, leaves, dy.to(y.dtype)), torch.autograd.grad(y_old, old, dy.to(y.dtype))
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_old))


def test_lora_routed_experts_seam_names_bad_shapes():
    x, ids, w, gu, dn, ad, add, _ = _expert_inputs()
    with pytest.raises(ValueError, match=r"B_dn \(5, 16, 2\) \(want \(5, 16, 3\)\)"):
        kernels.lora_routed_experts(x, ids, w, gu, dn, *ad[:3], ad[3][..., :2], 1.0)
    with pytest.raises(ValueError, match=r"add_TD \(22, 16\) must have x's shape \(23, 16\)"):
        kernels.lora_routed_experts(x, ids, w, gu, dn, *ad, 1.0, add[1:])


def test_moe_backend_request_covers_the_lora_experts(monkeypatch):
    """ANYSEEK_MOE and set_backend("moe", ...) pick one backend for routed_experts and lora_routed_experts (their
    backends bear the same names), as the trainer's train.moe_backend did for LoRA before the seam."""
    x = torch.randn(2, 16)
    assert [b.name for b in registry.backends("lora_routed_experts")] == ["triton", "grouped_mm", "reference"]
    registry.set_backend("moe", "grouped_mm")
    assert registry.requested("lora_routed_experts") == ("grouped_mm", "set_backend")
    registry.set_backend("moe", None)
    monkeypatch.setenv("ANYSEEK_MOE", "reference")
    assert registry.choose("lora_routed_experts", x)[1] == registry.choose("routed_experts", x)[1] == "reference"
    monkeypatch.setenv("ANYSEEK_MOE", "triton")
    with pytest.raises(RuntimeError, match="backend 'triton' for op 'lora_routed_experts' was requested"):
        registry.choose("lora_routed_experts", x)
