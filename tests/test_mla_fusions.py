"""MLA's copy-saving autograd pieces: `rope_tail` (the query's rope part rotated in one output, no split/cat) and
`split_last` (k_nope and v split off one projection; a backward that takes adjacent gradient slices as they are)."""

from __future__ import annotations

import pytest
import torch

from anyseek import kernels
from anyseek.kernels import torch_lowrank
from anyseek.model import concat
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
    a, b = concat.split_last(x, [3, 4])
    assert torch.equal(a, x[..., :3]) and torch.equal(b, x[..., 3:])
    joint = torch.randn(5, 2, 7)
    (ga, gb), = [(joint[..., :3], joint[..., 3:])]
    back = concat._SplitLast.backward(type("Ctx", (), {"sizes": [3, 4]})(), ga, gb)[0]
    assert back.data_ptr() == joint.data_ptr() and torch.equal(back, joint)  # the buffer itself, not a copy
    # other gradients (separate tensors, one missing) are concatenated, zeros for the missing one
    (a * 2).sum().backward()
    assert torch.equal(x.grad[..., :3], torch.full((5, 2, 3), 2.0))
    assert torch.equal(x.grad[..., 3:], torch.zeros(5, 2, 4))
    x.grad = None
    a, b = concat.split_last(x, [3, 4])
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


def test_cat_rows_is_a_view_of_adjacent_weights_with_cat_gradients():
    """Weights lying row after row in one buffer are joined without a copy; values and gradients as torch.cat."""
    from anyseek.model.concat import cat_rows, rows_adjacent

    flat = torch.randn(7 * 5)
    a = torch.nn.Parameter(flat[:3 * 5].view(3, 5))
    b = torch.nn.Parameter(flat[3 * 5:].view(4, 5))
    assert rows_adjacent([a, b]) and not rows_adjacent([b, a])
    joined = cat_rows([a, b])
    assert joined.data_ptr() == a.data_ptr() and joined.shape == (7, 5)
    torch.testing.assert_close(joined, torch.cat([a, b]), rtol=0, atol=0)
    g = torch.randn(7, 5)
    (joined * g).sum().backward()
    torch.testing.assert_close(a.grad, g[:3], rtol=0, atol=0)
    torch.testing.assert_close(b.grad, g[3:], rtol=0, atol=0)
    c, d = torch.randn(3, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)  # apart: a real cat
    assert not rows_adjacent([c, d]) and cat_rows([c, d]).data_ptr() != c.data_ptr()


@pytest.mark.parametrize("dropout_input", [False, True])
def test_low_rank_linear_gradients(dropout_input):
    """x W^T + (xd A^T) B^T: values and the gradients of x, W, A, B (and xd) by torch.autograd.gradcheck, fp64."""
    g = torch.Generator().manual_seed(0)
    x, W, A, B = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                  for s in ((2, 5, 7), (6, 7), (3, 7), (6, 3)))  # fmt: skip
    xd = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True) if dropout_input else None
    want = x @ W.t() + ((x if xd is None else xd) @ A.t()) @ B.t()
    torch.testing.assert_close(kernels.low_rank_linear(x, W, A, B, xd), want, rtol=1e-12, atol=1e-12)
    args = (x, W, A, B) + ((xd,) if xd is not None else ())
    assert torch.autograd.gradcheck(lambda *t: kernels.low_rank_linear(*t[:4], t[4] if len(t) > 4 else None), args)


def test_low_rank_linear_output_takes_rope_in_place_without_copy_slices():
    """A 2-D input gives the Function's output itself, not a view of it: rope_tail_ (in place, on q_b's output) then
    adds no CopySlices node (which copies the whole gradient back in backward); gradients as out of place."""
    from anyseek.model.rope import apply_rope, rope_tail_

    g = torch.Generator().manual_seed(0)
    x, W, A, B = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                  for s in ((6, 7), (2 * 10, 7), (3, 7), (2 * 10, 3)))  # fmt: skip
    ang = torch.randn(6, 2, generator=g, dtype=torch.float64)
    cos, sin = ang.cos(), ang.sin()
    y = kernels.low_rank_linear(x, W, A, B)
    assert y._base is None
    q = rope_tail_(y, cos, sin, 2, 4, False)
    assert "CopySlices" not in type(q.grad_fn).__name__
    q3 = (x @ W.t() + x @ A.t() @ B.t()).view(6, 2, 10)
    want = torch.cat([q3[..., :6], apply_rope(q3[..., 6:], cos, sin, False)], dim=-1).view(6, 20)
    torch.testing.assert_close(q, want, rtol=1e-12, atol=1e-12)
    gy = torch.randn(6, 20, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(q, (x, W, A, B), gy.clone())  # (rope_tail_'s backward rotates its gradient in place)
    torch.testing.assert_close(got, torch.autograd.grad(want, (x, W, A, B), gy), rtol=1e-5, atol=1e-6)  # rope: fp32


def test_fused_linear_joins_low_rank_terms():
    """Layers exposing fused_weight / fused_low_rank: one matmul whose columns equal each layer's own x W^T +
    (x A^T) B^T, and a plain nn.Linear beside them."""

    class Low(torch.nn.Module):
        def __init__(self, out, r):
            super().__init__()
            self.fused_weight = torch.randn(out, 7, dtype=torch.float64)
            self.A, self.B = torch.randn(r, 7, dtype=torch.float64), torch.randn(out, r, dtype=torch.float64)
            self.fused_low_rank = (self.A, self.B, None, 0.5)

    torch.manual_seed(0)
    plain = torch.nn.Linear(7, 4, bias=False, dtype=torch.float64)
    for layers in ([Low(5, 2), plain, Low(3, 4)], [Low(5, 2), Low(3, 4)], [plain, Low(3, 4)]):
        x = torch.randn(9, 7, dtype=torch.float64)
        want = torch.cat([m(x) if m is plain else x @ m.fused_weight.t() + 0.5 * x @ m.A.t() @ m.B.t()
                          for m in layers], dim=-1)
        torch.testing.assert_close(concat.fused_linear(x, layers), want, rtol=1e-12, atol=1e-12)
    layers[1].fused_low_rank = (layers[1].A, layers[1].B, None, 2.0)  # scales that differ
    layers = [Low(5, 2), layers[1]]
    want = torch.cat([x @ layers[0].fused_weight.t() + 0.5 * x @ layers[0].A.t() @ layers[0].B.t(),
                      x @ layers[1].fused_weight.t() + 2.0 * x @ layers[1].A.t() @ layers[1].B.t()], dim=-1)
    torch.testing.assert_close(concat.fused_linear(x, layers), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dropout_input", [False, True])
def test_low_rank_linear_blocks_and_scale_gradients(dropout_input):
    """B in blocks over output columns (a block-diagonal B without forming it) with a scale: values and every
    gradient by gradcheck, fp64."""
    g = torch.Generator().manual_seed(1)
    x, W, A, B1, B2 = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
                       for s in ((5, 7), (9, 7), (5, 7), (3, 2), (4, 3)))  # fmt: skip
    xd = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True) if dropout_input else None

    def f(x, W, A, B1, B2, xd=None):
        return kernels.low_rank_linear(x, W, A, [(1, B1), (5, B2)], xd, scale=0.75)

    Bfull = torch.zeros(9, 5, dtype=torch.float64)
    Bfull[1:4, :2], Bfull[5:9, 2:] = B1.detach(), B2.detach()
    want = x @ W.t() + 0.75 * ((x if xd is None else xd) @ A.t()) @ Bfull.t()
    torch.testing.assert_close(f(x, W, A, B1, B2, xd), want, rtol=1e-12, atol=1e-12)
    args = (x, W, A, B1, B2) + ((xd,) if xd is not None else ())
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("rows", [5, 12])  # fewer rows than input features: added; more: the merged weight
@pytest.mark.parametrize("blocks", ["one", "partial"])
def test_low_rank_linear_merged_and_added_paths(rows, blocks):
    """Both ways of applying the low-rank term (`merge_wanted`): values and every gradient by gradcheck,
    fp64, with one B over all outputs (a single addmm merge) and with blocks that leave rows of W uncovered."""
    g = torch.Generator().manual_seed(2)
    x, W, A = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((rows, 7), (9, 7), (5, 7)))  # fmt: skip
    shapes = [(9, 5)] if blocks == "one" else [(3, 2), (4, 3)]
    Bs = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    starts = [0] if blocks == "one" else [1, 5]
    assert torch_lowrank.merge_wanted(rows, W, False) == (rows > 7) and not torch_lowrank.merge_wanted(rows, W, True)

    def f(x, W, A, *Bs):
        return kernels.low_rank_linear(x, W, A, list(zip(starts, Bs)), None, scale=0.75)

    def dense_B(Bs):  # the block-diagonal B [9, 5] the blocks stand for, differentiable
        out, r0 = 0, 0
        for at, B in zip(starts, Bs):
            out = out + torch.nn.functional.pad(B, (r0, 5 - r0 - B.shape[1], at, 9 - at - B.shape[0]))
            r0 += B.shape[1]
        return out

    def want(x, W, A, *Bs):
        return x @ W.t() + 0.75 * (x @ A.t()) @ dense_B(Bs).t()

    torch.testing.assert_close(f(x, W, A, *Bs), want(x, W, A, *Bs), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(f, (x, W, A, *Bs))
    # a frozen W and an input without a gradient (LoRA's first layer): the adapters' gradients alone, as wanted
    xf, Wf = x.detach(), W.detach()
    gy = torch.randn(rows, 9, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(f(xf, Wf, A, *Bs), (A, *Bs), gy)
    torch.testing.assert_close(got, torch.autograd.grad(want(xf, Wf, A, *Bs), (A, *Bs), gy), rtol=1e-12, atol=1e-12)


def test_working_copy_lays_joined_weights_out_adjacent():
    """train/precision.py keeps each pair the model joins (q_a|kv_a, gate|up) row after row, so cat_rows is a view;
    the model's output and gradients are those of the plain model."""
    from anyseek.model.concat import adjacent_weights, rows_adjacent
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.precision import WorkingCopy

    torch.manual_seed(0)
    model = DeepSeekV3(ModelConfig.from_name("tiny"))
    ref = DeepSeekV3(ModelConfig.from_name("tiny"))
    ref.load_state_dict(model.state_dict())
    groups = adjacent_weights(model)
    assert len(groups) >= 2 * len(list(model.model.layers))  # q_a|kv_a per layer, gate|up per dense MLP / shared
    wc = WorkingCopy(model, torch.float16, accumulate=False)
    assert all(rows_adjacent(list(g)) for g in groups)
    with wc.active():
        assert all(rows_adjacent(list(g)) for g in groups)
    ids = torch.randint(0, 4096, (2, 16))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_linear_fp32_is_the_fp32_linear_on_cpu():
    from anyseek.model.matmul import linear_fp32

    x, w = torch.randn(9, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    torch.testing.assert_close(linear_fp32(x, w), torch.nn.functional.linear(x.float(), w.float()), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_linear_fp32_on_tensor_cores(dtype):
    """The router's logits from bf16/fp16 x and w: forward and both gradients within 2x the error of the fp32 path
    they replace (F.linear on fp32 copies), against fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from anyseek.model.matmul import _LowFP32Linear, linear_fp32

    torch.manual_seed(0)
    x0 = torch.randn(4099, 1024, device="cuda").to(dtype)
    w0 = (torch.randn(32, 1024, device="cuda") * 0.05).to(dtype)
    g = torch.randn(4099, 32, device="cuda")

    def run(fn, dt):
        x = x0.detach().to(dt).requires_grad_()
        w = w0.detach().to(dt).requires_grad_()
        y = fn(x, w)
        y.backward(g.to(y.dtype))
        return [t.detach().double() for t in (y, x.grad, w.grad)], y

    want, _ = run(lambda x, w: x @ w.t(), torch.float64)
    theirs, _ = run(lambda x, w: torch.nn.functional.linear(x.float(), w.float()).float(), dtype)
    ours, y = run(linear_fp32, dtype)
    assert y.dtype == torch.float32 and isinstance(y.grad_fn, _LowFP32Linear._backward_cls)
    for what, o, t, r in zip(("out", "dx", "dw"), ours, theirs, want):
        err, err_t = (o - r).abs().max().item(), (t - r).abs().max().item()
        assert err <= 2 * err_t + 1e-5, (what, err, err_t)
