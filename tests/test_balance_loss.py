"""The sequence-wise balance loss is a mean over every segment of the optimizer step, however the step is split into
micro-batches (and ranks): each micro-batch's summed loss is divided by the step's count of segments, counted on the
host like the next-token loss's targets (`count_segments`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import spawn, tiny_cfg

from anyseek.data.loader import Batch
from anyseek.model.layout import PackedLayout
from anyseek.model.mtp import count_segments
from anyseek.train.trainer import Trainer

# 8 micro-batches of different numbers and lengths of documents (1-token documents have no MTP term)
SKEWED = [[37], [3, 2, 1, 5], [20, 1], [1, 1, 1, 1, 1, 1], [12, 9, 7], [2], [30, 3], [5, 5, 5, 5, 1]]


def _batch(lengths: list[int], vocab: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(1, vocab, (T,), generator=g)
    targets = torch.randint(1, vocab, (T,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    targets[cu[1:].long() - 1] = -100  # a document's last token has no next token
    return Batch(ids, targets, cu, max(lengths))


def _concat(batches: list[Batch]) -> Batch:
    cu, ids, targets = [torch.zeros(1, dtype=torch.int32)], [], []
    for b in batches:
        cu.append(b.cu_seqlens[1:] + cu[-1][-1])
        ids.append(b.input_ids)
        targets.append(b.targets)
    return Batch(torch.cat(ids), torch.cat(targets), torch.cat(cu), max(b.max_seqlen for b in batches))


def _reference(trainer: Trainer, micro: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain forward and backward over every document of `micro` (the model's own denominators: the means over
    this one batch); (loss, balance_loss), the gradients in `.grad`."""
    both = _concat(micro)
    out = trainer.model(both.input_ids, cu_seqlens=both.cu_seqlens, targets=both.targets, return_logits=False)
    loss = out.lm_loss + trainer.engine.mtp_loss_weight() * out.mtp_loss + trainer.model_cfg.aux_loss_alpha * out.balance_loss
    loss.backward()
    return loss.detach(), out.balance_loss.detach()


def _assert_same_gradients(got: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Every parameter's gradient (the main and the MTP routers' included) within fp32 rounding of `model`'s."""
    routers = [n for n in got if n.endswith("gate.weight")]
    assert any(n.startswith("mtp.") for n in routers) and any(n.startswith("model.") for n in routers), routers
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            err = float((got[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
            assert err < 1e-5, (n, err)


def _loop_balance_loss(scores_TE, topk_ids_TK, cu, mask_T) -> tuple[float, int]:
    """The report's formula, one document at a time in float64: (sum over documents with counted tokens of
    sum_e f_e P_e, how many such documents)."""
    E, K = scores_TE.shape[1], topk_ids_TK.shape[1]
    total, docs = 0.0, 0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        keep = [t for t in range(start, end) if mask_T[t]]
        if not keep:
            continue
        s = scores_TE[keep].double()
        P = (s / s.sum(dim=1, keepdim=True)).mean(dim=0)
        f = torch.zeros(E, dtype=torch.float64)
        for t in keep:
            for e in topk_ids_TK[t].tolist():
                f[e] += E / (K * len(keep))
        total += float((f * P).sum())
        docs += 1
    return total, docs


def test_count_segments_counts_the_segments_each_layer_group_averages_over():
    cu = torch.tensor([0, 1, 3, 7, 7, 10], dtype=torch.int32)  # lengths 1, 2, 4, 0, 3
    targets = torch.zeros(10, dtype=torch.long)
    # main layers: every non-empty segment; MTP depth d: the segments longer than d
    assert count_segments(targets, cu, 3) == [4, 3, 2, 1]
    assert count_segments(targets, None, 2) == [1, 1, 1]
    assert count_segments(targets.view(2, 5), None, 5) == [2, 2, 2, 2, 2, 0]


def test_balance_loss_sums_over_segments_and_divides_by_the_given_count():
    from anyseek.model.moe import sequence_balance_loss

    torch.manual_seed(0)
    E, K = 8, 2
    cu = torch.tensor([0, 5, 6, 6, 13, 16], dtype=torch.int32)  # an empty document too
    T = int(cu[-1])
    layout = PackedLayout.build(cu, T)
    scores = torch.rand(T, E)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    for mask in (torch.ones(T, dtype=torch.bool), torch.rand(T) > 0.4):
        total, docs = _loop_balance_loss(scores, ids, cu, mask)
        got = sequence_balance_loss(scores, ids, layout, mask)  # default: this batch's documents, a mean
        torch.testing.assert_close(got, torch.tensor(total / docs, dtype=torch.float32))
        for n in (docs + 9, torch.tensor(docs + 9.0)):
            got = sequence_balance_loss(scores, ids, layout, mask, num_segments=n)
            torch.testing.assert_close(got, torch.tensor(total / (docs + 9), dtype=torch.float32))


def test_eight_micro_batches_give_the_gradients_of_one_batch_of_the_same_documents(data_dir, tmp_path):
    """8 skewed micro-batches (1 to 6 documents each, 1 to 37 tokens long) through the trainer's accumulation equal
    one forward over all their documents: same loss, same balance loss metric, same gradient for every parameter
    (the main and the MTP routers included), at the report's alpha 1e-4. A mean of per-micro-batch means weighs a
    document of a micro-batch with few documents up to 6x more (the MTP router's gradient then differs by ~50%)."""
    cfg = tiny_cfg(data_dir, "--train.grad_accum=8", "--model.aux_loss_alpha=1e-4")
    trainer = Trainer(cfg, tmp_path / "run", log=lambda s: None)
    micro = [_batch(lengths, trainer.model_cfg.vocab_size, seed=i) for i, lengths in enumerate(SKEWED)]
    stats = trainer.engine._accumulate(iter(micro))
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    loss, balance = _reference(trainer, micro)
    torch.testing.assert_close(stats.loss, loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(stats.parts["balance_loss"], balance, rtol=1e-5, atol=0)
    _assert_same_gradients(got, trainer.model)


def _two_ranks(data: str, out: str) -> None:
    """Rank r runs SKEWED[4r:4r+4] as its step's 4 micro-batches; rank 0 writes the weights before the step, the
    gathered gradients, and the loss and balance loss summed over the ranks (as `Parallel.sum_step` sums them)."""
    from safetensors.torch import save_file

    trainer = Trainer(tiny_cfg(Path(data), "--train.grad_accum=4"), Path(out) / "run", log=lambda s: None)
    rank, V = trainer.par.env.rank, trainer.model_cfg.vocab_size
    weights = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
    micro = [_batch(lengths, V, seed=i) for i, lengths in enumerate(SKEWED)][4 * rank:4 * rank + 4]
    stats = trainer.engine._accumulate(iter(micro))
    grads = {f"grad/{n}": p.grad.full_tensor() for n, p in trainer.model.named_parameters() if p.grad is not None}
    sums = trainer.par.sum_(torch.stack([stats.loss, stats.parts["balance_loss"]]))
    if rank == 0:
        save_file({**weights, **grads, "sums": sums}, str(Path(out) / "two_ranks.safetensors"))


@pytest.mark.slow
def test_two_ranks_of_four_micro_batches_give_the_gradients_of_one_batch(data_dir, tmp_path):
    """The segment counts are summed over the ranks: 2 gloo ranks x 4 of the skewed micro-batches equal one
    forward over all 8 micro-batches' documents (FSDP2 sums the ranks' gradients)."""
    from safetensors.torch import load_file

    assert spawn(_two_ranks, str(data_dir), str(tmp_path), timeout=300) == [0, 0]
    saved = load_file(str(tmp_path / "two_ranks.safetensors"))
    trainer = Trainer(tiny_cfg(data_dir), tmp_path / "one", log=lambda s: None)
    loaded = trainer.model.load_state_dict({n: v for n, v in saved.items() if "/" not in n and n != "sums"},
                                           strict=False)
    assert not loaded.unexpected_keys and all(n.endswith("e_score_correction_bias") for n in loaded.missing_keys)
    micro = [_batch(lengths, trainer.model_cfg.vocab_size, seed=i) for i, lengths in enumerate(SKEWED)]
    loss, balance = _reference(trainer, micro)
    torch.testing.assert_close(saved["sums"], torch.stack([loss, balance]), rtol=1e-5, atol=0)
    _assert_same_gradients({n[5:]: v for n, v in saved.items() if n.startswith("grad/")}, trainer.model)
