"""Packed varlen batches: documents never see each other and positions restart, so packing changes nothing."""

from __future__ import annotations

import pytest
import torch

from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DeepSeekV3(ModelConfig.from_name("tiny", init_std=0.05)).eval()


def test_two_documents_packed_equal_each_alone(model):
    a, b = torch.randint(0, 4096, (37,)), torch.randint(0, 4096, (21,))
    cu = torch.tensor([0, 37, 58], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat([a, b]), cu_seqlens=cu).logits
        alone_a = model(a).logits
        alone_b = model(b[None]).logits[0]  # a [1, S] row is one document too
    torch.testing.assert_close(packed[:37], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[37:], alone_b, rtol=1e-5, atol=1e-5)


def test_rows_equal_packed_and_losses_match(model):
    ids = torch.randint(0, 4096, (3, 16))
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    cu = torch.arange(0, 49, 16, dtype=torch.int32)
    with torch.no_grad():
        rows = model(ids, targets=targets)
        packed = model(ids.reshape(-1), cu_seqlens=cu, targets=targets.reshape(-1), max_seqlen=16)
    torch.testing.assert_close(rows.logits.reshape(48, -1), packed.logits, rtol=1e-5, atol=1e-5)
    for name in ("loss", "lm_loss", "mtp_loss", "balance_loss", "expert_load"):
        torch.testing.assert_close(getattr(rows, name), getattr(packed, name), rtol=1e-5, atol=1e-5)
    assert rows.logits.shape == (3, 16, 4096)


def test_empty_and_single_token_documents(model):
    ids = torch.randint(0, 4096, (9,))
    cu = torch.tensor([0, 1, 1, 9], dtype=torch.int32)  # a 1-token doc, an empty doc, an 8-token doc
    with torch.no_grad():
        out = model(ids, cu_seqlens=cu, targets=ids)
        alone = model(ids[1:]).logits
    torch.testing.assert_close(out.logits[1:], alone, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out.loss)


def test_bad_packing_inputs_are_named(model):
    ids = torch.randint(0, 4096, (10,))
    with pytest.raises(ValueError, match="end at the token count 10"):
        model(ids, cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be None"):
        model(ids.view(2, 5), cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="targets shape"):
        model(ids, targets=ids[:5])
    with pytest.raises(ValueError, match=r"\[T\] \(packed\) or \[B, S\]"):
        model(ids.view(1, 2, 5))


def test_return_logits_false_keeps_losses(model):
    ids = torch.randint(0, 4096, (2, 8))
    out = model(ids, targets=ids, return_logits=False)
    assert out.logits is None and out.loss is not None
    out.loss.backward()
    assert model.model.layers[1].mlp.experts.gate_up_proj.grad is not None
    model.zero_grad(set_to_none=True)


def test_padding_cu_seqlens_with_empty_documents_changes_nothing(model):
    """What a CUDA graph of the training step relies on (train/graphs.py): cu_seqlens padded with empty documents
    at the end and max_seqlen rounded up give the same losses, expert loads and gradients (MTP and the sequence-wise
    balance loss included)."""
    torch.manual_seed(1)
    ids = torch.randint(0, 4096, (40,))
    targets = torch.roll(ids, -1)
    targets[[6, 17, 39]] = -100
    cu = torch.tensor([0, 7, 18, 19, 40], dtype=torch.int32)
    padded = torch.cat([cu, torch.full((11,), 40, dtype=torch.int32)])
    model.train()
    try:
        results = []
        for c, max_seqlen in ((cu, None), (padded, 32)):
            model.zero_grad(set_to_none=True)
            out = model(ids, cu_seqlens=c, targets=targets, max_seqlen=max_seqlen, return_logits=False,
                        num_targets=[36.0, 33.0])
            out.loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((out, grads))
    finally:
        model.eval()
    (a, ga), (b, gb) = results
    for name in ("loss", "lm_loss", "mtp_loss", "balance_loss", "expert_load"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-6, atol=1e-7, msg=n)
