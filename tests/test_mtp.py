"""Multi-token prediction: shifted inputs/labels stay inside documents; the loss adds up as documented."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.mtp import shift_in_documents
from anyseek.model.transformer import DeepSeekV3


def test_targets_stop_at_document_ends():
    #            doc 0: 3 tokens | doc 1: 4 tokens
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 23])
    targets = torch.tensor([11, 12, -100, 21, 22, 23, 99])  # doc 1's last target given, doc 0's ignored
    pack = PackedLayout.build(torch.tensor([0, 3, 7], dtype=torch.int32), 7)
    ids1, labels1, inside1 = shift_in_documents(ids, targets, pack, depth=1)
    assert ids1.tolist() == [11, 12, 0, 21, 22, 23, 0]
    assert labels1.tolist() == [12, -100, -100, 22, 23, 99, -100]
    assert inside1.tolist() == [True, True, False, True, True, True, False]
    ids2, labels2, _ = shift_in_documents(ids, targets, pack, depth=2)
    assert ids2.tolist() == [12, 0, 0, 22, 23, 0, 0]
    assert labels2.tolist() == [-100, -100, -100, 23, 99, -100, -100]


def test_shift_is_a_shift_of_main_targets():
    """Depth d at i predicts t_{i+d+1} = targets[i+d] from input t_{i+d} = input_ids[i+d], inside one document."""
    ids = torch.arange(100, 120)
    targets = ids + 1
    pack = PackedLayout.build(torch.tensor([0, 20], dtype=torch.int32), 20)
    for d in (1, 2, 3):
        mtp_ids, labels, _ = shift_in_documents(ids, targets, pack, depth=d)
        assert torch.equal(mtp_ids[: 20 - d], ids[d:])
        assert torch.equal(labels[: 20 - d], ids[d:] + 1)
        assert (labels[20 - d :] == -100).all()


def test_loss_is_lm_plus_weighted_mtp_plus_balance():
    torch.manual_seed(0)
    config = ModelConfig.from_name("tiny", num_nextn_predict_layers=2, mtp_loss_weight=0.5, aux_loss_alpha=0.01)
    model = DeepSeekV3(config)
    ids = torch.randint(0, 4096, (30,))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    out = model(ids, cu_seqlens=cu, targets=torch.roll(ids, -1))
    expected = out.lm_loss + 0.5 * out.mtp_loss + 0.01 * out.balance_loss
    torch.testing.assert_close(out.loss, expected)
    assert out.expert_load.shape == (3 + 2, 8)  # 3 main MoE layers, then one row per MTP module
    assert config.n_moe_layers == 5 == len(model.moe_layers())
    K = config.num_experts_per_tok
    assert (out.expert_load[:3].sum(dim=1) == 30 * K).all()
    # MTP depth d: each of the 2 documents has d filler positions past its end, routed but not counted
    assert out.expert_load[3].sum() == (30 - 2 * 1) * K and out.expert_load[4].sum() == (30 - 2 * 2) * K
    out.mtp_loss.backward()
    assert model.mtp[1].eh_proj.weight.grad.abs().sum() > 0
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0  # shared embedding
    assert model.model.layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0  # through h^0


def test_mtp_does_not_run_without_targets():
    model = DeepSeekV3(ModelConfig.from_name("tiny"))
    out = model(torch.randint(0, 4096, (2, 8)))
    assert out.loss is None and out.mtp_loss is None and out.balance_loss is None
    assert out.expert_load[-1].sum() == 0 and out.expert_load[0].sum() == 16 * 2


def test_cross_entropy_matches_torch():
    import torch.nn.functional as F

    from anyseek.model.loss import cross_entropy

    x = (torch.randn(50, 33) * 3).requires_grad_()
    y = torch.randint(0, 33, (50,))
    y[::4] = -100
    ours = cross_entropy(x, y)
    (g_ours,) = torch.autograd.grad(ours, x)
    ref = F.cross_entropy(x, y, ignore_index=-100)
    (g_ref,) = torch.autograd.grad(ref, x)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(g_ours, g_ref)
    y[:] = -100
    assert cross_entropy(x, y).item() == 0.0


def test_linear_cross_entropy_matches_unfused():
    from anyseek.model.loss import _LinearCrossEntropy, cross_entropy

    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(40, 16, requires_grad=True)
    y = torch.randint(0, 40, (50,))
    y[::3] = -100
    ref = cross_entropy(h @ w.t(), y)
    g_ref = torch.autograd.grad(ref, (h, w))
    fused = _LinearCrossEntropy.apply(h, w, y, 7, True, None, None) * 2.0  # 8 chunks, and a scaled use
    g_fused = torch.autograd.grad(fused, (h, w))
    torch.testing.assert_close(fused, ref * 2.0)
    for a, b in zip(g_fused, g_ref):
        torch.testing.assert_close(a, b * 2.0)


def test_loss_chunks_on_gpus():
    """GPU chunks: 2^26 logits, or for a batch of many tokens at most 8 chunks of up to 2^27 logits."""
    from anyseek.model.loss import chunk_rows

    assert chunk_rows(32000, "cuda", 8192) == (1 << 26) // 32000  # 4 chunks of 2097 rows, as before
    assert chunk_rows(32000, "cuda", 32768) == 4096  # 8 chunks, not 16
    assert chunk_rows(32000, "cuda", 1 << 20) == (1 << 27) // 32000  # the chunk's size stays bounded
    assert chunk_rows(163840, "cuda", 1) == (1 << 26) // 163840
    assert chunk_rows(4096, "cpu", 1 << 20) == 256  # CPU: unchanged (cache-sized chunks)
    assert chunk_rows(163840, "cuda", 4096, head_trained=False) == 128  # a frozen head: no [V, D] sum to re-read
    assert chunk_rows(32000, "cuda", 32768, head_trained=False) == (1 << 24) // 32000
    assert chunk_rows(4096, "cpu", 1 << 20, head_trained=False) == 256


def test_linear_cross_entropy_frozen_head_builds_no_weight_gradient(monkeypatch):
    """A frozen head (LoRA): the same loss and hidden-state gradient, no [V, D] weight gradient (nor its matmuls)."""
    from anyseek.model import loss as loss_lib

    torch.manual_seed(0)
    h = torch.randn(50, 16, requires_grad=True)
    w = torch.randn(40, 16)
    y = torch.randint(0, 40, (50,))
    ref = loss_lib.cross_entropy(h @ w.t(), y)
    (g_ref,) = torch.autograd.grad(ref, (h,))
    zeros = []
    real_zeros = torch.zeros
    monkeypatch.setattr(loss_lib.torch, "zeros", lambda *a, **k: zeros.append(a) or real_zeros(*a, **k))
    fused = loss_lib.linear_cross_entropy(h, w, y)
    (g_fused,) = torch.autograd.grad(fused, (h,))
    torch.testing.assert_close(fused, ref)
    torch.testing.assert_close(g_fused, g_ref)
    assert not any(tuple(a[0]) == tuple(w.shape) for a in zeros if a and isinstance(a[0], torch.Size))


def test_linear_cross_entropy_extreme_logits():
    """The log-sum-exp is taken from the softmax's largest entry: a label whose probability underflows fp32 (a logit
    gap of ~300) still gets its exact loss, not inf."""
    from anyseek.model.loss import linear_cross_entropy

    h = torch.zeros(3, 4)
    h[:, 0] = torch.tensor([300.0, -300.0, 1e-3])
    w = torch.zeros(5, 4)
    w[1, 0] = 1.0
    y = torch.tensor([0, 1, 4])
    ours = linear_cross_entropy(h.clone().requires_grad_(), w, y)
    ref = F.cross_entropy(h @ w.t(), y)
    assert torch.isfinite(ours) and ours.item() > 90
    torch.testing.assert_close(ours, ref)


def test_fused_and_unfused_heads_give_same_loss_and_grads():
    torch.manual_seed(0)
    model = DeepSeekV3(ModelConfig.from_name("tiny", init_std=0.05))
    ids = torch.randint(0, 4096, (40,))
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    grads = []
    for return_logits in (True, False):
        out = model(ids, cu_seqlens=cu, targets=torch.roll(ids, -1), return_logits=return_logits)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    # The two heads sum the same fp32 products in other orders: their dh and dW differ by a few units of roundoff
    # u, and the backward through the layers carries that on as sums over tokens and features. An entry's error
    # scales with the terms summed into it, i.e. with its tensor's largest entries, not with the entry itself (which
    # may be a near-cancellation, where any relative tolerance is noise): measured <= ~30 u x max|grad| per tensor
    # (4 seeds, 1 and 2 threads); 256 u leaves ~8x room, while a wrong scale or chunk is off by >= 1e-3 of it.
    u = 2.0**-24
    for name in grads[0]:
        atol = 256 * u * grads[1][name].abs().max().item()
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=atol, msg=name)


def test_linear_cross_entropy_low_precision_products():
    """Under autocast every product of the head runs in the autocast dtype (no fp32 matmul), with fp32 sums: loss and
    both gradients within 2x the error of the same head computed by PyTorch under autocast (fp32 reference)."""
    from anyseek.model.loss import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(300, 32)
    w = torch.randn(200, 32) * 0.3
    y = torch.randint(0, 200, (300,))
    y[::7] = -100

    def run(fn, autocast):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(hh, ww)
        loss.backward()
        return loss.detach().float(), hh.grad, ww.grad

    unfused = lambda hh, ww: F.cross_entropy((hh @ ww.t()).float(), y, ignore_index=-100)
    ref = run(unfused, False)
    torch_low = run(unfused, True)
    ours = run(lambda hh, ww: linear_cross_entropy(hh, ww, y), True)
    for r, t, o in zip(ref, torch_low, ours):
        assert o.dtype == r.dtype
        err_ours, err_torch = (o - r).abs().max().item(), (t - r).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6, (err_ours, err_torch)
