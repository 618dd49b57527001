"""The PyTorch attention backends (SDPA, and batched-matmul tiles: `bmm`) against the fp32 reference, on CPU."""

import pytest
import torch

from anyseek import kernels
from anyseek.kernels import reference, torch_backends


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("tiles", [False, True], ids=["sdpa", "bmm"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "lengths",
    [[1], [5, 1, 17, 64, 3, 1, 100], [1] * 40 + [33], [130, 64, 65, 1], [1100, 7], [70] * 3],
    ids=["one", "mixed", "many-short", "tile-edges", "long (> 1024: SDPA)", "equal (no gather)"],
)
def test_sdpa_mla_matches_reference(lengths, causal, tiles):
    torch.manual_seed(0)
    T, H, N, R, V = sum(lengths), 3, 32, 16, 24
    q, kn = torch.randn(T, H, N + R, requires_grad=True), torch.randn(T, H, N, requires_grad=True)
    kp, v = torch.randn(T, R, requires_grad=True), torch.randn(T, H, V, requires_grad=True)
    cu = _cu(lengths)
    out = torch_backends.sdpa_mla_attention(q, kn, kp, v, cu, max(lengths), 0.3, causal, tiles)
    ref = reference.mla_attention(q, kn, kp, v, cu, max(lengths), 0.3, causal)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, kn, kp, v), g), _grads(ref, (q, kn, kp, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiles", [False, True], ids=["sdpa", "bmm"])
@pytest.mark.parametrize("dqk,dv", [(64, 64), (40, 72)])
def test_sdpa_varlen_matches_reference(dqk, dv, tiles):
    torch.manual_seed(1)
    lengths = [9, 1, 30, 2]
    T, H = sum(lengths), 2
    q, k, v = (torch.randn(T, H, d, requires_grad=True) for d in (dqk, dqk, dv))
    cu = _cu(lengths)
    out = torch_backends.sdpa_varlen_attention(q, k, v, cu, 30, tiles=tiles)
    ref = reference.varlen_attention(q, k, v, cu, 30)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_shapes_name_the_problem():
    cu = _cu([4])
    with pytest.raises(ValueError, match="N\\+R=24"):
        kernels.mla_attention(
            torch.randn(4, 2, 24), torch.randn(4, 2, 16), torch.randn(4, 4), torch.randn(4, 2, 8), cu, 4
        )
    with pytest.raises(ValueError, match="token count 5"):
        kernels.varlen_attention(torch.randn(5, 1, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8), cu, 4)
    with pytest.raises(ValueError, match="1-D int32"):
        kernels.varlen_attention(torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), cu.float(), 4)


def test_mixed_dtypes_follow_q():
    """Under autocast the rope part may arrive in fp32 while q is bf16: computed in q's dtype."""
    cu = _cu([3, 5])
    q, kn, v = torch.randn(8, 2, 24).bfloat16(), torch.randn(8, 2, 16).bfloat16(), torch.randn(8, 2, 8).bfloat16()
    out = torch_backends.sdpa_mla_attention(q, kn, torch.randn(8, 8), v, cu, 5)
    assert out.dtype == torch.bfloat16 and out.shape == (8, 2, 8)


def test_bmm_backend_is_chosen_on_cpu_fp32_only():
    from anyseek.kernels import registry

    assert registry.choose("mla_attention", torch.empty(1, 4, 48))[1] == "bmm"
    assert registry.choose("mla_attention", torch.empty(1, 4, 48, dtype=torch.bfloat16))[1] == "sdpa"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert registry.choose("mla_attention", torch.empty(1, 4, 48))[1] == "sdpa"
