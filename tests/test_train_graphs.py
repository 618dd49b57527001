"""CUDA graphs of the training step (train/graphs.py): the same losses as the eager step, eager fallback for
shapes no graph takes, gradients kept where a caller frees them, and one line saying why graphs are off."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import tiny_cfg

from anyseek.data.loader import Batch
from anyseek.train import graphs
from anyseek.train.config import ConfigError, load_run_config
from anyseek.train.trainer import Trainer


def test_config_accepts_auto_true_false_only():
    assert load_run_config("tiny", []).train.cuda_graphs == "auto"
    assert load_run_config("tiny", ["--train.cuda_graphs=false"]).train.cuda_graphs == "false"
    assert load_run_config("tiny", ["--train.cuda_graphs=true"]).train.cuda_graphs == "true"
    with pytest.raises(ConfigError, match="train.cuda_graphs must be auto, true or false, got 'yes'"):
        load_run_config("tiny", ["--train.cuda_graphs=yes"])


def test_reasons_graphs_are_unavailable():
    cuda = torch.device("cuda")
    assert "CUDA device" in graphs.unavailable(torch.device("cpu"), False)
    assert "train.compile" in graphs.unavailable(cuda, True)
    assert graphs.unavailable(cuda, False) is None
    # under torchrun: on for any number of ranks; never with expert parallelism or accumulation
    assert graphs.unavailable(cuda, False, torchrun=True) is None
    assert "parallel.ep" in graphs.unavailable(cuda, False, torchrun=True, ep=2)
    assert "grad_accum" in graphs.unavailable(cuda, False, torchrun=True, grad_accum=2)


def test_cpu_run_says_why_graphs_are_off_and_true_is_an_error(data_dir, tmp_path):
    lines = []
    tr = Trainer(tiny_cfg(data_dir, "--train.device=cpu", "--train.max_steps=1"), tmp_path / "a", log=lines.append)
    assert tr.graphs is None
    tr._describe()
    assert any(line.startswith("CUDA graphs: off: CUDA graphs need a CUDA device") for line in lines), lines
    with pytest.raises(ConfigError, match="train.cuda_graphs=true but CUDA graphs need a CUDA device"):
        Trainer(tiny_cfg(data_dir, "--train.device=cpu", "--train.cuda_graphs=true"), tmp_path / "b",
                log=lambda s: None)


def test_shape_buckets():
    """Token count must match and max_seqlen stay within the cap (60 here); documents go to power-of-two buckets of
    at least 64 slots, max_seqlen to a power of two up to the cap."""
    fake = types.SimpleNamespace(tokens=100, max_seqlen=60, one_shape=False)

    def batch(cu, max_seqlen):
        n = cu[-1]
        return Batch(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                     torch.tensor(cu, dtype=torch.int32), max_seqlen)

    assert graphs.StepGraphs.key(fake, batch([0, 60, 100], 60)) == (100, 64, 60)
    assert graphs.StepGraphs.key(fake, batch([0, 40, 100], 60)) == (100, 64, 60)
    assert graphs.StepGraphs.key(fake, batch([0, 30, 60, 100], 40)) == (100, 64, 60)
    assert graphs.StepGraphs.key(fake, batch([0, 20, 40, 60, 80, 100], 20)) == (100, 64, 32)
    assert graphs.StepGraphs.key(fake, batch(list(range(0, 100)) + [100], 1)) == (100, 128, 1)
    assert graphs.StepGraphs.key(fake, batch([0, 99], 99)) is None  # another token count: eager
    assert graphs.StepGraphs.key(fake, batch([0, 30, 100], 70)) is None  # longer than the cap: eager
    with pytest.raises(ValueError, match="never decrease"):
        graphs._check_cu(batch([0, 70, 50, 100], 50), 100)
    # one graph for every shape (no memory for another): the largest buckets, which every batch of 100 fits
    one = types.SimpleNamespace(tokens=100, max_seqlen=60, one_shape=True)
    assert graphs.StepGraphs.key(one, batch([0, 20, 40, 60, 80, 100], 20)) == (100, 128, 60)
    assert graphs.StepGraphs.key(one, batch(list(range(0, 100)) + [100], 1)) == (100, 128, 60)


def test_a_shape_without_a_graph_replays_on_the_smallest_graph_that_holds_it():
    def g(T, slots, max_seqlen):
        return types.SimpleNamespace(T=T, slots=slots, max_seqlen=max_seqlen)

    have = types.SimpleNamespace(graphs={k: g(*k) for k in [(100, 64, 32), (100, 128, 60), (100, 64, 60),
                                                           (99, 256, 60)]})
    covering = graphs.StepGraphs._covering
    assert vars(covering(have, (100, 64, 16))) == vars(g(100, 64, 32))
    assert vars(covering(have, (100, 64, 60))) == vars(g(100, 64, 60))
    assert vars(covering(have, (100, 128, 32))) == vars(g(100, 128, 60))
    assert covering(have, (100, 256, 32)) is None  # more documents than any graph of 100 tokens holds


def test_a_first_capture_without_room_on_any_rank_leaves_every_rank_eager(monkeypatch):
    """Before the first capture: the eager warm-up's peak times CAPTURE_MARGIN must be free on every rank (a capture
    that runs out of memory under torchrun broke CUDA on all ranks); the ranks' verdicts are combined by `agree`,
    and the log says where the room was missing."""
    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for free, others, want, where in [(30 * GiB, True, True, None), (10 * GiB, True, False, "here"),
                                      (30 * GiB, False, False, "on another rank"),
                                      (int(10.9 * GiB), True, False, "here")]:  # fmt: skip
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 80 * GiB))
        lines, asked = [], []
        fake = types.SimpleNamespace(device="cuda", log=lines.append,
                                     agree=lambda ok, o=others: asked.append(ok) or (ok and o))  # fmt: skip
        assert graphs.StepGraphs._capture_fits(fake, 10 * GiB) is want
        assert asked == [free > 11 * GiB]  # this rank's own verdict went to the others
        assert (where is None and not lines) or (where in lines[0] and "11.0 GiB" in lines[0]), lines
    fake = types.SimpleNamespace(device="cuda", log=print, agree=None)  # one process: its own verdict
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (5 * GiB, 80 * GiB))
    assert graphs.StepGraphs._capture_fits(fake, 1 * GiB) is True


def _losses(data, tmp_path, mode: str, steps: int, accum: int, free_grads_at: int = -1):
    cfg = tiny_cfg(data, "--train.device=cuda", f"--train.cuda_graphs={mode}", f"--train.grad_accum={accum}",
                   "--train.max_steps=100", "--train.warmup_steps=1", "--train.lr=1e-3")
    tr = Trainer(cfg, tmp_path / f"{mode}{accum}{free_grads_at}", log=lambda s: None)
    batches = iter(tr.train_loader)
    losses = []
    for i in range(steps):
        if i == free_grads_at:
            for p in tr.model.parameters():
                p.grad = None
        stats = tr.engine._accumulate(batches)
        ok, loss, _ = tr.engine._apply(stats)  # the step count goes up with it
        assert ok
        losses.append(loss)
    return losses, tr


@pytest.mark.cuda
@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_step_matches_eager(data_dir, tmp_path, accum):
    """accum 1: each graph writes gradients of its own; 2: graphs and eager micro-batches add into kept tensors
    (and a caller freeing them mid-run is repaired)."""
    eager, _ = _losses(data_dir, tmp_path, "false", 12, accum)
    graphed, tr = _losses(data_dir, tmp_path, "true", 12, accum, free_grads_at=7)
    g = tr.graphs
    assert g.enabled and len(g.graphs) >= 1 and g.replays >= 12 * accum - 2 * len(g.graphs), vars(g)
    assert g.accumulate == (accum > 1)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-3, atol=0)
    assert graphed[-1] < graphed[0] - 0.3
    # closing deletes the graphs (before a process group they captured collectives of is destroyed); the trainer
    # still steps, eagerly
    replays = g.replays
    tr.close()
    assert not g.enabled and not g.graphs
    ok, loss, _ = tr.engine._apply(tr.engine._accumulate(iter(tr.train_loader)))
    assert ok and loss == loss and g.replays == replays


def test_clip_folded_into_fused_adamw_matches_clip_then_step(data_dir, tmp_path, monkeypatch):
    """One process with fused AdamW: the clip factor goes into the optimizer kernel (grad_scale) instead of a pass
    over the gradients; the steps are those of clip-then-step (CPU, fused AdamW forced; clipping active)."""
    import anyseek.train.trainer as trainer_mod

    real = trainer_mod.build_optimizer

    def fused(model, cfg, device, masters=None):
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")}
                  for g in real(model, cfg, device).param_groups]
        return torch.optim.AdamW(groups, fused=True)

    monkeypatch.setattr(trainer_mod, "build_optimizer", fused)
    runs = []
    for fold in (True, False):
        cfg = tiny_cfg(data_dir, "--train.device=cpu", "--train.grad_clip=0.05", "--train.warmup_steps=1")
        tr = Trainer(cfg, tmp_path / f"fold{fold}", log=lambda s: None)
        tr.engine._fold_clip = fold  # the kernel is fused either way
        batches = iter(tr.train_loader)
        losses, norms = [], []
        for _ in range(6):
            ok, loss, norm = tr.engine._apply(tr.engine._accumulate(batches))
            assert ok
            losses.append(loss)
            norms.append(norm)
        assert hasattr(tr.optimizer, "grad_scale") == fold
        if fold:
            assert float(tr.optimizer.grad_scale) > 1.0  # the clip was active
        runs.append((losses, norms))
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-5, atol=0)


@pytest.mark.cuda
def test_no_memory_for_a_second_graph_gives_one_graph_for_every_shape(data_dir, tmp_path, monkeypatch):
    """Where another graph would not fit (as 16B with EP4 on 4 H200s), the graphs are given back and one graph of
    the largest buckets takes every batch: the same losses as eager."""
    eager, _ = _losses(data_dir, tmp_path, "false", 10, 1)
    monkeypatch.setattr(graphs.StepGraphs, "room", lambda self: False)
    monkeypatch.setattr(graphs.StepGraphs, "_covering", lambda self, key: None)  # no graph holds the new shape
    real_key, calls = graphs.StepGraphs.key, []

    def key(self, batch):  # this corpus gives one shape; every other batch asks for twice the document slots
        k = real_key(self, batch)
        calls.append(k)
        return k if self.one_shape or len(calls) % 2 else (k[0], 2 * k[1], k[2])

    monkeypatch.setattr(graphs.StepGraphs, "key", key)
    graphed, tr = _losses(data_dir, tmp_path, "true", 10, 1)
    g = tr.graphs
    assert g.enabled and g.one_shape and len(g.graphs) == 1 and g.replays >= 10 - 2 - 1, vars(g)
    (key,) = g.graphs
    assert key == (tr.cfg.data.tokens_per_batch, graphs._pow2(tr.cfg.data.tokens_per_batch + 1), tr.cfg.data.max_seqlen)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-3, atol=0)
    tr.close()
