"""The trainer's overlap (`train.overlap_steps`): the host queues step N+1 before it reads step N's verdict, and a
non-finite step is skipped on the device. The run must be the one-at-a-time loop's, bit for bit: the same steps
applied and skipped, the same numbers, logs, checkpoints and weights, whatever steps are poisoned (one, two in a
row, just before a save, too many in a row)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import batch_key, count_halts, fused_adamw, poison, tiny_cfg
from safetensors.torch import load_file

from anyseek.checkpoint import folder as ckpt_lib
from anyseek.train.config import ConfigError
from anyseek.train.metrics import read_metrics
from anyseek.train.trainer import Trainer, TrainingDiverged

KEYS = ("kind", "step", "loss", "lr", "grad_norm", "lm_loss", "mtp_loss", "balance_loss", "tokens_seen",
        "mtp_loss_weight", "in_a_row", "perplexity")


def _same_checkpoints(oa, ob) -> None:
    """Two runs' checkpoints: the same steps, the same tensors bit for bit, the same train state."""
    assert [c.step for c in ckpt_lib.list_checkpoints(oa)] == [c.step for c in ckpt_lib.list_checkpoints(ob)]
    for c in ckpt_lib.list_checkpoints(oa):
        names = sorted(f.name for f in c.path.glob("*.safetensors"))
        assert names == sorted(f.name for f in (ob / c.path.name).glob("*.safetensors")) and names
        for name in names:
            x, y = load_file(str(c.path / name)), load_file(str(ob / c.path.name / name))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (c.path.name, name)
        x, y = (json.loads((d / "train_state.json").read_text()) for d in (c.path, ob / c.path.name))
        assert x.pop("saved_at") and y.pop("saved_at") and x == y


def _cfg(data, overlap: bool, *extra: str):
    return tiny_cfg(data, "--train.working_copy=true", "--train.dtype=bf16", f"--train.overlap_steps={str(overlap).lower()}",
                    "--train.save_every=4", "--train.eval_every=6", "--train.keep_last=10",
                    "--train.mtp_loss_weight_schedule=[[0, 0.3], [2000, 0.1]]",
                    "--train.bias_update_speed_schedule=[[0, 0.01], [3000, 0.002]]", *extra)


def _rows(out) -> list[dict]:
    return [{k: (r[k] if r[k] == r[k] else "nan") for k in KEYS if k in r} for r in read_metrics(out / "metrics.jsonl")]


def _batch_keys(data, n: int) -> list[tuple]:
    tr = Trainer(_cfg(data, False, "--train.max_steps=1"), data.parent / "keys", log=lambda s: None)
    batches = iter(tr.train_loader)
    keys = [batch_key(next(batches).input_ids) for _ in range(n)]
    assert len(set(keys)) == n  # each batch recognisable by its first tokens
    return keys


def _compare(data, tmp_path, monkeypatch, poisoned, *extra: str) -> None:
    """Both loops on the same config, `poisoned` batches NaN: the same logs, checkpoints and final state."""
    keys = _batch_keys(data, 20)
    poison(monkeypatch, {keys[i] for i in poisoned})
    halts = count_halts(monkeypatch)
    runs = {}
    for overlap in (False, True):
        out = tmp_path / f"overlap{overlap}"
        tr = Trainer(_cfg(data, overlap, "--train.max_steps=12", *extra), out, log=lambda s: None)
        assert tr.overlap == overlap
        summary = tr.run()
        assert summary["step"] == 12 and tr.engine._pending is None
        runs[overlap] = (tr, summary, out)
        assert any(halts) == (overlap and poisoned not in ((), (5, 6)))  # a step queued behind a bad one ran again
        halts.clear()
    (a, sa, oa), (b, sb, ob) = runs[False], runs[True]
    assert _rows(oa) == _rows(ob)
    assert sum(r["kind"] == "skip" for r in _rows(ob)) == len(poisoned)
    assert sa["val_loss"] == sb["val_loss"] and sa["tokens_seen"] == sb["tokens_seen"]
    _same_checkpoints(oa, ob)
    assert torch.equal(a.working.flat, b.working.flat) and torch.equal(a.working.flat_low, b.working.flat_low)
    assert int(a.optimizer._step_t) == int(b.optimizer._step_t) == 12
    assert float(b.engine._halt) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("poisoned", [(), (2,), (1, 2), (5, 6), (3, 7, 8, 11)])
def test_overlap_is_the_one_at_a_time_loop(data_dir, tmp_path, monkeypatch, poisoned):
    """poisoned: indices of the loader's batches whose loss is NaN. (2,): one skip, read while the step behind it,
    which would be saved, is in flight; (1, 2): two in a row, the second the step run again; (5, 6): two in a row
    settled at once (evaluation boundaries); (3, 7, 8, 11): a boundary step, then two in a row."""
    _compare(data_dir, tmp_path, monkeypatch, poisoned)


@pytest.mark.slow
def test_overlap_with_micro_batches_and_lora(data_dir, tmp_path, monkeypatch):
    """Two micro-batches per step (fp32 gradients added up, zeroed before each step), then LoRA on a base of the
    same run (adapters only in the checkpoints), each with a step run again behind a bad one."""
    _compare(data_dir, tmp_path / "accum", monkeypatch, (1, 2), "--train.grad_accum=2")
    base = tmp_path / "base"
    Trainer(_cfg(data_dir, False, "--train.max_steps=1"), base, log=lambda s: None).run()
    _compare(data_dir, tmp_path / "lora", monkeypatch, (1, 2), f"--train.init={base / 'step-1'}",
             "--train.lora_rank=4", "--train.bias_update_speed_schedule=[]")


@pytest.mark.slow
def test_overlap_stops_a_diverging_run_like_the_loop(data_dir, tmp_path, monkeypatch):
    keys = _batch_keys(data_dir, 20)
    poison(monkeypatch, set(keys[6:]))
    for overlap in (False, True):
        out = tmp_path / f"overlap{overlap}"
        with pytest.raises(TrainingDiverged, match="3 non-finite steps in a row at step 7"):
            Trainer(_cfg(data_dir, overlap, "--train.max_steps=12", "--train.max_bad_steps=3"), out,
                    log=lambda s: None).run()
        assert ckpt_lib.latest_checkpoint(out).step == 4
    assert _rows(tmp_path / "overlapFalse") == _rows(tmp_path / "overlapTrue")


def test_overlap_off_without_a_working_copy(data_dir, tmp_path):
    tr = Trainer(tiny_cfg(data_dir, "--train.max_steps=2"), tmp_path / "run", log=lambda s: None)
    assert tr.working is None and not tr.overlap and "working copy" in tr.engine.overlap_note
    tr = Trainer(_cfg(data_dir, False, "--train.max_steps=2"), tmp_path / "run2", log=lambda s: None)
    assert not tr.overlap and "overlap_steps=false" in tr.engine.overlap_note
    # asked for where the optimizer cannot skip a step on the device (foreach AdamW on the CPU): an error saying so
    with pytest.raises(ConfigError, match="overlap_steps=true but it needs an optimizer that skips a step on the dev"):
        Trainer(tiny_cfg(data_dir, "--train.max_steps=2", "--train.overlap_steps=true"), tmp_path / "run3",
                log=lambda s: None)  # fmt: skip


@pytest.mark.parametrize("poisoned", [(1,), (1, 2), (3, 7)])
def test_overlap_with_fused_adamw_is_the_loop(data_dir, tmp_path, monkeypatch, poisoned):
    """Without a working copy, fused AdamW skips a step on the device through its found_inf (its step count taken
    back there too): with train.overlap_steps=true the run is the loop's, bit for bit (rows, checkpoints, weights,
    moments and step counts), with a bad step alone, two in a row, one before a save and one just before the end,
    each halting the step queued behind it. "auto" leaves it off in one process (measured under torchrun only)."""
    import anyseek.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "build_optimizer", fused_adamw)
    keys = _batch_keys(data_dir, 12)
    poison(monkeypatch, {keys[i] for i in poisoned})
    halts = count_halts(monkeypatch)
    runs = []
    for mode in ("auto", "true"):
        out = tmp_path / mode
        tr = Trainer(tiny_cfg(data_dir, "--train.max_steps=8", "--train.save_every=4", "--train.eval_every=3",
                              "--train.keep_last=10", f"--train.overlap_steps={mode}"), out,
                     log=lambda s: None)  # fmt: skip
        assert tr.working is None and tr.overlap == (mode == "true"), tr.engine.overlap_note
        assert ("fused AdamW" in tr.engine.overlap_note) and (("only when asked" in tr.engine.overlap_note) == (mode == "auto"))
        tr.run()
        assert tr.engine._pending is None and any(halts) == (mode == "true")  # a step queued behind a bad one ran again
        halts.clear()
        runs.append((tr, out))
    (a, oa), (b, ob) = runs
    assert _rows(oa) == _rows(ob) and sum(r["kind"] == "skip" for r in _rows(ob)) == len(poisoned)
    _same_checkpoints(oa, ob)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        assert all(torch.equal(sa[k], sb[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert float(sb["step"]) == 8 and float(b.engine._halt) == 0.0


@pytest.mark.cuda
def test_overlap_on_the_gpu_matches_the_loop(data_dir, tmp_path, monkeypatch):
    """Graphed steps with the overlap: the same losses as one at a time; then eager steps with a poisoned batch:
    the same steps skipped."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    losses = {}
    for overlap in (False, True):
        cfg = tiny_cfg(data_dir, "--train.device=cuda", f"--train.overlap_steps={str(overlap).lower()}", "--train.max_steps=12",
                       "--train.save_every=5", "--train.eval_every=100", "--train.keep_last=10")
        tr = Trainer(cfg, tmp_path / f"g{overlap}", log=lambda s: None)
        assert tr.overlap == overlap and tr.graphs is not None
        tr.run()
        losses[overlap] = [r["loss"] for r in read_metrics(tmp_path / f"g{overlap}" / "metrics.jsonl")
                           if r["kind"] == "train"]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-3, atol=0)

    keys = _batch_keys(data_dir, 12)
    poison(monkeypatch, {keys[3], keys[4]})
    rows = {}
    for overlap in (False, True):
        cfg = tiny_cfg(data_dir, "--train.device=cuda", f"--train.overlap_steps={str(overlap).lower()}", "--train.max_steps=8",
                       "--train.cuda_graphs=false", "--train.save_every=100")
        out = tmp_path / f"e{overlap}"
        Trainer(cfg, out, log=lambda s: None).run()
        rows[overlap] = [(r["kind"], r["step"]) for r in read_metrics(out / "metrics.jsonl")]
    assert rows[True] == rows[False] and sum(k == "skip" for k, _ in rows[True]) == 2
