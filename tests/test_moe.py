"""MoE bookkeeping (permute/unpermute, edge cases), the routed-experts reference, routing and balancing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anyseek.kernels.reference.moe import permute, routed_experts, unpermute
from anyseek.model.config import ModelConfig
from anyseek.model.layout import PackedLayout
from anyseek.model.moe import sequence_balance_loss
from anyseek.model.transformer import DeepSeekV3


def naive_experts(x, ids, w, gate_up, down):
    I = down.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            h = gate_up[ids[t, k]] @ x[t]
            y[t] += w[t, k] * (down[ids[t, k]] @ (F.silu(h[:I]) * h[I:]))
    return y


def random_problem(T=23, D=16, I=8, E=5, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return x, ids, w, torch.randn(E, 2 * I, D, generator=g) * 0.3, torch.randn(E, D, I, generator=g) * 0.3


def test_permutation_inverts_and_groups_by_expert():
    x, ids, _, _, _ = random_problem()
    x_MD, order, counts = permute(x, ids, 5)
    assert counts.sum() == ids.numel() and torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=5))
    assert torch.equal(ids.reshape(-1)[order], ids.reshape(-1)[order].sort().values)  # grouped, experts ascending
    per_expert_slots = [order[ids.reshape(-1)[order] == e] for e in range(5)]
    assert all(torch.equal(s, s.sort().values) for s in per_expert_slots)  # stable: (token, k) order kept
    # weights 1/K: unpermute(permute(x)) == x
    back = unpermute(x_MD, order, torch.full(ids.shape, 0.5))
    torch.testing.assert_close(back, x)
    # K = 1, weight 1 is an exact inverse
    x1, o1, _ = permute(x, ids[:, :1], 5)
    assert torch.equal(unpermute(x1, o1, torch.ones(23, 1)), x)


def test_reference_matches_naive_loop():
    x, ids, w, gu, dn = random_problem()
    torch.testing.assert_close(routed_experts(x, ids, w, gu, dn), naive_experts(x, ids, w, gu, dn))


def test_all_tokens_to_one_expert():
    x, _, w, gu, dn = random_problem(K=1)
    ids = torch.full((23, 1), 3)
    _, _, counts = permute(x, ids, 5)
    assert counts.tolist() == [0, 0, 0, 23, 0]
    torch.testing.assert_close(routed_experts(x, ids, w, gu, dn), naive_experts(x, ids, w, gu, dn))


def test_top_k_equals_number_of_experts():
    x, _, w, gu, dn = random_problem(E=4, K=4)
    ids = torch.stack([torch.randperm(4) for _ in range(23)])
    torch.testing.assert_close(routed_experts(x, ids, w, gu, dn), naive_experts(x, ids, w, gu, dn))
    # the model's router with K = E picks every expert once, weights summing to routed_scaling_factor
    config = ModelConfig.from_name("tiny", n_routed_experts=4, num_experts_per_tok=4, n_group=1, topk_group=1)
    gate = DeepSeekV3(config).model.layers[1].mlp.gate
    _, chosen, weights = gate(torch.randn(7, config.hidden_size))
    assert torch.equal(chosen.sort(dim=-1).values, torch.arange(4).expand(7, 4))
    torch.testing.assert_close(weights.sum(-1), torch.full((7,), 2.5))


def test_gradients_flow_through_reference():
    x, ids, w, gu, dn = random_problem(T=6)
    for t in (x, w, gu, dn):
        t.requires_grad_(True)
    routed_experts(x, ids, w, gu, dn).square().sum().backward()
    ref = [t.grad.clone() for t in (x, w, gu, dn)]
    for t in (x, w, gu, dn):
        t.grad = None
    naive_experts(x, ids, w, gu, dn).square().sum().backward()
    for r, t in zip(ref, (x, w, gu, dn)):
        torch.testing.assert_close(r, t.grad)


def test_bias_is_for_selection_only():
    config = ModelConfig.from_name("tiny")
    gate = DeepSeekV3(config).model.layers[1].mlp.gate
    x = torch.randn(40, config.hidden_size)
    scores, _ids, _w = gate(x)
    with torch.no_grad():
        gate.e_score_correction_bias[0] = 10.0  # expert 0 is now always chosen ...
    scores2, ids2, w2 = gate(x)
    assert (ids2 == 0).any(dim=-1).all()
    torch.testing.assert_close(scores, scores2)  # ... but the weights still come from the unbiased scores
    picked = scores.gather(1, ids2)
    torch.testing.assert_close(w2, picked / picked.sum(-1, keepdim=True) * 2.5)


def imbalance(load: torch.Tensor) -> float:
    return (load.max() / load.mean()).item()


def test_bias_update_moves_skewed_router_toward_balance():
    torch.manual_seed(0)
    config = ModelConfig.from_name("tiny", n_group=1, topk_group=1)
    model = DeepSeekV3(config)
    moe = model.model.layers[1].mlp
    offset = torch.randn(config.hidden_size)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.1)  # a router with opinions, so tokens spread once the bias corrects it
        moe.gate.weight[0] += offset * 0.05  # experts 0 and 1 attract every token with the offset
        moe.gate.weight[1] += offset * 0.04
    x = torch.randn(256, config.hidden_size) * 0.5 + offset
    layout = PackedLayout.build(torch.tensor([0, 256], dtype=torch.int32), 256)
    n_moe = len(model.moe_layers())

    def load_now():
        with torch.no_grad():
            return moe(x, layout)[1].load_E

    first = load_now()
    assert imbalance(first) > 3.0
    for _ in range(100):
        load = torch.zeros(n_moe, 8)
        load[0] = load_now()
        model.update_routing_bias(load, gamma=0.01)
    last = load_now()
    assert imbalance(last) < 1.5 < imbalance(first)
    bias = moe.gate.e_score_correction_bias
    assert bias[0] < 0 and bias[1] < 0 and bias.dtype == torch.float32
    assert model.model.layers[2].mlp.gate.e_score_correction_bias.abs().sum() == 0  # zero load rows: no change
    with pytest.raises(ValueError, match="expert_load shape"):
        model.update_routing_bias(torch.zeros(2, 8))


def test_balance_loss_is_one_when_balanced_and_per_document():
    # 4 experts, K = 1, each document spreads evenly with uniform scores -> f = 1, P = 1/E -> loss 1
    scores = torch.full((8, 4), 0.5)
    ids = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    layout = PackedLayout.build(torch.tensor([0, 4, 8], dtype=torch.int32), 8)
    torch.testing.assert_close(sequence_balance_loss(scores, ids, layout), torch.tensor(1.0))
    # all of a document's tokens on the expert it prefers -> larger
    skew = torch.tensor([[0.9, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert sequence_balance_loss(skew, torch.zeros(8, 1, dtype=torch.long), layout) > 2.0


def test_masked_tokens_count_in_neither_load_nor_balance_loss():
    torch.manual_seed(0)
    scores = torch.rand(8, 4)
    ids = torch.randint(0, 4, (8, 2))
    layout = PackedLayout.build(torch.tensor([0, 5, 8], dtype=torch.int32), 8)
    keep = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)  # e.g. MTP filler at each document's end
    # the masked loss equals the loss of the kept tokens alone, as their own two documents
    alone = PackedLayout.build(torch.tensor([0, 3, 5], dtype=torch.int32), 5)
    torch.testing.assert_close(sequence_balance_loss(scores, ids, layout, keep),
                               sequence_balance_loss(scores[keep], ids[keep], alone))
    config = ModelConfig.from_name("tiny")
    moe = DeepSeekV3(config).model.layers[1].mlp
    x = torch.randn(8, config.hidden_size)
    _, stats = moe(x, layout, keep, want_balance_loss=True)
    _, full = moe(x, layout)
    assert stats.load_E.sum() == int(keep.sum()) * config.num_experts_per_tok
    assert full.load_E.sum() == 8 * config.num_experts_per_tok and full.balance_loss is None


def test_routing_bias_stays_fp32_under_dtype_casts():
    model = DeepSeekV3(ModelConfig.from_name("tiny"), dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert all(m.gate.e_score_correction_bias.dtype == torch.float32 for m in model.moe_layers())
    out = model(torch.randint(0, 4096, (1, 8)), targets=torch.randint(0, 4096, (1, 8)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


@pytest.mark.cuda
def test_grouped_mm_backend_matches_reference_on_gpu():
    from anyseek.kernels.torch_backends import grouped_mm_available, grouped_mm_routed_experts

    x, ids, w, gu, dn = (t.cuda() for t in random_problem(T=300, D=64, I=32, E=8, K=3))
    x, gu, dn = x.bfloat16(), gu.bfloat16(), dn.bfloat16()
    ok, why = grouped_mm_available(x)
    if not ok:
        pytest.skip(why)
    ids[:50] = torch.tensor([0, 1, 2], device="cuda")  # a crowded expert, and (likely) some empty ones
    outs = []
    for fn in (routed_experts, grouped_mm_routed_experts):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, gu, dn)]
        y = fn(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        y.float().square().sum().backward()
        outs.append([y.float()] + [t.grad.float() for t in leaves])
    for a, b in zip(*outs):
        assert ((a - b).abs().max() / a.abs().max()).item() < 2e-2


def official_style_gate(x, weight, bias, score_func, n_groups, topk_groups, topk, route_scale, normalize):
    """DeepSeek's inference Gate, written out: selection on biased scores, weights from the unbiased ones."""
    scores = x @ weight.t()
    scores = scores.softmax(dim=-1) if score_func == "softmax" else scores.sigmoid()
    original = scores
    scores = scores + bias
    if n_groups > 1:
        grouped = scores.view(x.size(0), n_groups, -1)
        if score_func == "softmax":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = group_scores.topk(topk_groups, dim=-1)[1]
        mask = torch.ones(x.size(0), n_groups, dtype=torch.bool).scatter_(1, keep, False)
        scores = grouped.masked_fill(mask[:, :, None], float("-inf")).flatten(1)
    ids = scores.topk(topk, dim=-1)[1]
    weights = original.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * route_scale


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_matches_official_semantics(scoring, normalize):
    torch.manual_seed(5)
    config = ModelConfig.from_name(
        "tiny", n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
        scoring_func=scoring, norm_topk_prob=normalize, routed_scaling_factor=1.5,
    )  # fmt: skip
    gate = DeepSeekV3(config).model.layers[1].mlp.gate
    with torch.no_grad():
        gate.weight.normal_(0, 0.3)
        gate.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(64, config.hidden_size)
    _, ids, w = gate(x)
    ref_ids, ref_w = official_style_gate(x, gate.weight.detach(), gate.e_score_correction_bias, scoring, 4, 2, 3, 1.5,
                                         normalize)  # fmt: skip
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, ref_order.indices))


def test_moe_input_as_one_copy_per_reader():
    """MoE.forward takes x or `input_copies` tensors of it (router, routed, shared experts), as the norm before it
    hands them out so that its backward can sum their gradients: the same output and gradients either way."""
    config = ModelConfig.from_name("tiny")
    torch.manual_seed(0)
    moe = DeepSeekV3(config).model.layers[1].mlp
    assert moe.input_copies == (3 if config.n_shared_experts else 2)
    x = torch.randn(31, config.hidden_size)
    dy = torch.randn(31, config.hidden_size)
    grads = []
    for as_copies in (False, True):
        moe.zero_grad()
        xs = [x.clone().requires_grad_() for _ in range(moe.input_copies if as_copies else 1)]
        y, _ = moe(tuple(xs) if as_copies else xs[0])
        y.backward(dy)
        grads.append((y.detach(), sum(t.grad for t in xs), [p.grad.clone() for p in moe.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    for a, b in zip(grads[0][2], grads[1][2]):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="copies"):
        moe((x, x)) if moe.input_copies == 3 else moe((x, x, x))


def test_routed_experts_addend_of_another_shape_is_an_error():
    from anyseek import kernels

    x, ids, w, gu, dn = random_problem()
    with pytest.raises(ValueError, match=r"add_TD \(23, 17\) must have x's shape \(23, 16\)"):
        kernels.routed_experts(x, ids, w, gu, dn, torch.zeros(23, 17))
    y = kernels.routed_experts(x, ids, w, gu, dn, torch.ones(23, 16))
    torch.testing.assert_close(y, kernels.routed_experts(x, ids, w, gu, dn) + 1)
