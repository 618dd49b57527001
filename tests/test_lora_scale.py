"""LoRA's update is (alpha / r) B A, checked against the formula written out by hand (not against the module's own
`.weight` or `.scale`): y = x W^T + (alpha / r) (x A^T) B^T for a LoRALinear, for the pairs the model joins into one
matmul (`model.concat.fused_linear`: q_a|kv_a, gate|up), and per expert for the routed experts on the reference
path; outputs and the gradients of x, A and B (autograd through the hand-written formula). Ranks other than 1 and
alpha != r, so that alpha / sqrt(r), alpha, or 1 in place of alpha / r all fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anyseek.model.concat import fused_linear
from anyseek.model.config import ModelConfig
from anyseek.model.moe import Experts
from anyseek.transforms import lora as lora_lib


def _lora_linear(fan_in: int, fan_out: int, rank: int, alpha: float, g: torch.Generator) -> lora_lib.LoRALinear:
    """A LoRALinear in fp64 with a random base and random (non-zero) adapters."""
    lin = lora_lib.LoRALinear(torch.nn.Linear(fan_in, fan_out, bias=False), lora_lib.LoRASpec(rank=rank, alpha=alpha))
    lin = lin.double()
    with torch.no_grad():
        for p in (lin.base.weight, lin.lora_A, lin.lora_B):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return lin


def _by_hand(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, alpha: float, rank: int):
    return x @ W.T + (alpha / rank) * (x @ A.T) @ B.T


def _grads(y: torch.Tensor, dy: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, tensors, dy))


# rows: fewer than the 24 input features (the term added to the base matmul's output) and more (the merged weight
# W + s B A formed for each matmul): `model.concat.merge_wanted`
@pytest.mark.parametrize("rows", [5, 60])
def test_lora_linear_is_base_plus_alpha_over_r(rows):
    g = torch.Generator().manual_seed(0)
    rank, alpha = 4, 6.0
    lin = _lora_linear(24, 40, rank, alpha, g)
    x = torch.randn(rows, 24, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(rows, 40, generator=g, dtype=torch.float64)
    params = [x, lin.lora_A, lin.lora_B]
    got = lin(x)
    got_grads = _grads(got, dy, params)
    want = _by_hand(x, lin.base.weight.detach(), lin.lora_A, lin.lora_B, alpha, rank)
    want_grads = _grads(want, dy, params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)  # fp64: other summation orders only
    for name, a, b in zip(("dx", "dA", "dB"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(lin.weight, lin.base.weight + alpha / rank * lin.lora_B @ lin.lora_A)  # for readers


@pytest.mark.parametrize("specs", [((4, 6.0), (4, 6.0)), ((4, 6.0), (2, 5.0))], ids=["one_spec", "two_specs"])
@pytest.mark.parametrize("rows", [5, 60])
def test_fused_pair_adds_each_adapter_with_alpha_over_r(rows, specs):
    """fused_linear over two adapted layers reading the same x ([16 | 10] outputs): each layer's columns are its own
    x W_i^T + (alpha_i / r_i) (x A_i^T) B_i^T, the terms joined beside the base weights; with two scales (each B
    carries its own) too; 5 rows add the term, 60 go through the merged weight (`merge_wanted`)."""
    g = torch.Generator().manual_seed(1)
    layers = [_lora_linear(24, out, rank, alpha, g) for out, (rank, alpha) in zip((16, 10), specs)]
    x = torch.randn(rows, 24, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(rows, 26, generator=g, dtype=torch.float64)
    params = [x] + [p for lin in layers for p in (lin.lora_A, lin.lora_B)]
    got = fused_linear(x, layers)
    got_grads = _grads(got, dy, params)
    want = torch.cat([_by_hand(x, lin.base.weight.detach(), lin.lora_A, lin.lora_B, alpha, rank)
                      for lin, (rank, alpha) in zip(layers, specs)], dim=-1)  # fmt: skip
    want_grads = _grads(want, dy, params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(("dx", "dA_1", "dB_1", "dA_2", "dB_2"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


@pytest.fixture
def reference_moe():
    from anyseek.kernels import registry

    registry.set_backend("moe", "reference")
    yield
    registry.set_backend("moe", None)


def test_routed_expert_adapters_are_alpha_over_r_per_expert(reference_moe):
    """LoRAExperts on the reference routed-experts path, token by token and expert by expert:
    h = x G_e^T + s (x A_e^T) B_e^T, a = silu(h[:I]) * h[I:], y += w (a D_e^T + s (a A'_e^T) B'_e^T), s = alpha / r;
    output and the gradients of x and of every adapter."""
    g = torch.Generator().manual_seed(2)
    E, D, I, K, T, rank, alpha = 6, 16, 8, 2, 19, 3, 2.0
    cfg = ModelConfig.from_name("tiny", n_routed_experts=E, moe_intermediate_size=I, hidden_size=D, n_group=1,
                                topk_group=1, num_experts_per_tok=K)  # fmt: skip
    lo = lora_lib.LoRAExperts(Experts(cfg), lora_lib.LoRASpec(rank=rank, alpha=alpha))
    with torch.no_grad():
        for p in (lo.base.gate_up_proj, lo.base.down_proj, lo.gate_up_lora_A, lo.gate_up_lora_B, lo.down_lora_A,
                  lo.down_lora_B):  # fmt: skip
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # expert E-1 gets no token
    w = torch.rand(T, K, generator=g)
    dy = torch.randn(T, D, generator=g)
    adapters = [lo.gate_up_lora_A, lo.gate_up_lora_B, lo.down_lora_A, lo.down_lora_B]
    got = lo(x, ids, w)
    got_grads = _grads(got, dy, [x, *adapters])
    Gu, Dn = lo.base.gate_up_proj.detach(), lo.base.down_proj.detach()
    rows = []
    for t in range(T):
        y = torch.zeros(D)
        for k in range(K):
            e = ids[t, k]
            h = _by_hand(x[t], Gu[e], lo.gate_up_lora_A[e], lo.gate_up_lora_B[e], alpha, rank)
            a = F.silu(h[:I]) * h[I:]
            y = y + w[t, k] * _by_hand(a, Dn[e], lo.down_lora_A[e], lo.down_lora_B[e], alpha, rank)
        rows.append(y)
    want = torch.stack(rows)
    want_grads = _grads(want, dy, [x, *adapters])
    # fp32, sums of <= 2I = 16 products of O(1) terms, two layers deep: errors ~1e-6 of the values; a scale of
    # alpha / sqrt(r) instead of alpha / r moves them by ~O(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("dx", "dA_gate_up", "dB_gate_up", "dA_down", "dB_down"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
