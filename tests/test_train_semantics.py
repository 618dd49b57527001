"""Training semantics against the DeepSeek-V3 report: the loss is a token mean over the whole step, schedules,
and what a resume restores. Each test failed before its fix."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_cfg

from anyseek.data.loader import Batch
from anyseek.model.mtp import count_targets
from anyseek.train.config import ConfigError, load_run_config, piecewise
from anyseek.train.trainer import Trainer


def _batch(lengths: list[int], vocab: int, seed: int, ignore_every: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ids = torch.randint(1, vocab, (T,), generator=g)
    targets = torch.randint(1, vocab, (T,), generator=g)
    if ignore_every:
        targets[::ignore_every] = -100
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(ids, targets, cu, max(lengths))


def _concat(a: Batch, b: Batch) -> Batch:
    cu = torch.cat([a.cu_seqlens, b.cu_seqlens[1:] + a.cu_seqlens[-1]])
    return Batch(torch.cat([a.input_ids, b.input_ids]), torch.cat([a.targets, b.targets]), cu,
                 max(a.max_seqlen, b.max_seqlen))


def test_count_targets_counts_next_token_and_every_mtp_depth():
    targets = torch.tensor([11, 12, -100, 21, 22, 23, 99])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    # depth d at i uses targets[i+d] while i+d stays in i's document
    assert count_targets(targets, cu, 2) == [6, 4, 2]
    assert count_targets(targets.view(1, 7), None, 1) == [6, 5]


def test_grad_accumulation_is_the_token_mean_of_the_whole_step(data_dir, tmp_path):
    """Two micro-batches with 64 and 10 valid targets must give the gradient of one forward over both (the mean
    over all 74 targets), not the mean of the two micro-batch means (which weighs the 10 targets 6.4x more)."""
    cfg = tiny_cfg(data_dir, "--train.grad_accum=2", "--model.aux_loss_alpha=0.0", "--model.num_hidden_layers=2")
    trainer = Trainer(cfg, tmp_path / "run", log=lambda s: None)
    V = trainer.model_cfg.vocab_size
    big, small = _batch([40, 24], V, seed=1), _batch([7, 6], V, seed=2, ignore_every=5)
    assert count_targets(big.targets, big.cu_seqlens, 0)[0] == 64
    assert count_targets(small.targets, small.cu_seqlens, 0)[0] == 10
    torch.manual_seed(0)
    stats = trainer.engine._accumulate(iter([big, small]))
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)

    both = _concat(big, small)
    out = trainer.model(both.input_ids, cu_seqlens=both.cu_seqlens, targets=both.targets, return_logits=False)
    want_loss = out.lm_loss + trainer.model_cfg.mtp_loss_weight * out.mtp_loss
    want_loss.backward()
    torch.testing.assert_close(stats.loss, want_loss.detach(), rtol=1e-5, atol=1e-6)
    worst = max(float((got[n] - p.grad).norm() / p.grad.norm().clamp(min=1e-12))
                for n, p in trainer.model.named_parameters() if p.grad is not None and p.grad.norm() > 0)
    assert worst < 1e-4, worst


def test_piecewise_schedules_by_tokens():
    sched = [[0, 0.3], [1000, 0.1]]
    assert [piecewise(sched, t, 9.0) for t in (0, 999, 1000, 10**9)] == [0.3, 0.3, 0.1, 0.1]
    assert piecewise([], 5, 9.0) == 9.0
    for bad in ([[5, 0.3]], [[0, 0.3], [0, 0.1]], [[0, 0.3], [10, -1]], [0.3], "0.3"):
        with pytest.raises(ConfigError, match="mtp_loss_weight_schedule"):
            load_run_config("tiny", [f"--train.mtp_loss_weight_schedule={bad!r}".replace("'", '"')])


def test_trainer_follows_the_report_schedules(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, "--train.mtp_loss_weight_schedule=[[0, 0.3], [1000, 0.1]]",
                   "--train.bias_update_speed_schedule=[[0, 0.001], [2000, 0.0]]")
    trainer = Trainer(cfg, tmp_path / "run", log=lambda s: None)
    assert (trainer.engine.mtp_loss_weight(), trainer.engine.bias_update_speed()) == (0.3, 0.001)
    trainer.engine.tokens_seen = 1500
    assert (trainer.engine.mtp_loss_weight(), trainer.engine.bias_update_speed()) == (0.1, 0.001)
    trainer.engine.tokens_seen = 2000
    biases = [m.gate.e_score_correction_bias.clone() for m in trainer.model.moe_layers()]
    cfg.train.max_steps = 2  # two steps past the switch: gamma 0 leaves the routing biases where they are
    trainer.run()
    assert all(torch.equal(b, m.gate.e_score_correction_bias) for b, m in zip(biases, trainer.model.moe_layers()))


def test_resume_restores_bad_steps_in_a_row(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, "--train.max_steps=3")
    trainer = Trainer(cfg, tmp_path / "run", log=lambda s: None)
    trainer.engine.bad_in_a_row = 2
    trainer._save()
    again = Trainer(cfg, tmp_path / "run", resume=True, log=lambda s: None)
    again._resume()
    assert again.bad_in_a_row == 2
