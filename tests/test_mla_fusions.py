"""MLA's copy-saving autograd pieces: `rope_tail` (the query's rope part rotated in one output, no split/cat) and
`_split_last` (k_nope and v split off one projection; a backward that takes adjacent gradient slices as they are)."""

from __future__ import annotations

import pytest
import torch

from anyseek.model import mla
from anyseek.model.rope import apply_rope, rope_rows, rope_tail_


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_tail_is_split_rope_cat(interleave):
    """In place on a matmul's output (no copy of the nope part), values and gradients as split + rope + cat."""
    torch.manual_seed(0)
    T, H, N, R, D = 7, 3, 10, 8, 5
    x = torch.randn(T, D, requires_grad=True)
    w = torch.randn(H * (N + R), D)
    ang = torch.randn(T, R // 2)
    cos, sin = ang.cos(), ang.sin()
    y = x @ w.t()
    ptr = y.data_ptr()
    got = rope_tail_(y, cos, sin, H, R, interleave)
    assert got.data_ptr() == ptr and got.shape == (T, H * (N + R))
    ref_x = x.detach().clone().requires_grad_()
    nope, pe = (ref_x @ w.t()).view(T, H, N + R).split([N, R], dim=-1)
    want = torch.cat([nope, apply_rope(pe, cos, sin, interleave)], dim=-1).view(T, -1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-5)  # rope maths is fp32 either way
    leaf = torch.randn(T, H * (N + R), requires_grad=True)  # a leaf cannot change in place: the split/cat path
    torch.testing.assert_close(rope_tail_(leaf, cos, sin, H, R, interleave),
                               torch.cat([leaf.view(T, H, -1)[..., :N], apply_rope(leaf.view(T, H, -1)[..., N:], cos,
                                                                                     sin, interleave)], -1).view(T, -1))


def test_split_last_takes_adjacent_gradients_without_a_copy():
    x = torch.randn(5, 2, 7, requires_grad=True)
    a, b = mla._split_last(x, [3, 4])
    assert torch.equal(a, x[..., :3]) and torch.equal(b, x[..., 3:])
    joint = torch.randn(5, 2, 7)
    (ga, gb), = [(joint[..., :3], joint[..., 3:])]
    back = mla._SplitLast.backward(type("Ctx", (), {"sizes": [3, 4]})(), ga, gb)[0]
    assert back.data_ptr() == joint.data_ptr() and torch.equal(back, joint)  # the buffer itself, not a copy
    # other gradients (separate tensors, one missing) are concatenated, zeros for the missing one
    (a * 2).sum().backward()
    assert torch.equal(x.grad[..., :3], torch.full((5, 2, 3), 2.0))
    assert torch.equal(x.grad[..., 3:], torch.zeros(5, 2, 4))
    x.grad = None
    a, b = mla._split_last(x, [3, 4])
    (a.sum() + (b * 3).sum()).backward()
    assert torch.equal(x.grad, torch.cat([torch.ones(5, 2, 3), torch.full((5, 2, 4), 3.0)], dim=-1))


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_rows_is_apply_rope(interleave):
    """The key's rope part, a strided slice of its projection: a new contiguous tensor, gradients as apply_rope's."""
    torch.manual_seed(1)
    T, L, R = 11, 6, 8
    kv = torch.randn(T, L + R, requires_grad=True)
    ang = torch.randn(T, R // 2)
    cos, sin = ang.cos(), ang.sin()
    got = rope_rows(kv[:, L:], cos, sin, interleave)
    assert got.is_contiguous()
    ref = kv.detach().clone().requires_grad_()
    want = apply_rope(ref[:, L:], cos, sin, interleave)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # one fp32 rounding
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(kv.grad, ref.grad, rtol=0, atol=1e-6)
