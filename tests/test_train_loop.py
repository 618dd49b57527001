"""The training loop end to end on a small synthetic corpus: loss falls, resume is exact, saves are atomic,
NaN steps are skipped and stop the run, checkpoints load in transformers, signals save and exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import final_state, run, tiny_cfg

import anyseek
from anyseek.checkpoint import folder as ckpt_lib
from anyseek.train.metrics import read_metrics
from anyseek.train.step import StepEngine
from anyseek.train.trainer import SaveFailed, Trainer, TrainingDiverged


def test_smoke_loss_falls_and_writes_everything(data_dir, tmp_path):
    summary = run(tiny_cfg(data_dir, "--train.max_steps=20", "--train.save_every=10", "--train.keep_last=1"), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert all(k in rows[-1] for k in ("lm_loss", "mtp_loss", "balance_loss", "tokens_per_s", "grad_norm", "lr"))
    assert summary["step"] == 20 and summary["val_loss"] < rows[0]["loss"]
    assert [c.step for c in ckpt_lib.list_checkpoints(tmp_path)] == [20]  # keep_last=1 pruned step-10
    ckpt = tmp_path / "step-20"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "run_config.json", "optimizer.safetensors", "train_state.json",
                 "rng.safetensors", "checkpoint.json"):
        assert (ckpt / name).is_file(), name
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((ckpt / "run_config.json").read_text())["train"]["max_steps"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_resume_is_bit_identical(data_dir, tmp_path, monkeypatch, overlap):
    """overlap: a bf16 working copy on the CPU, so that the host queues a step before it settles the last one (the
    stop then comes one step later: the step in flight is settled and saved)."""
    extra = ("--train.working_copy=true", "--train.dtype=bf16") if overlap else ()
    cfg = tiny_cfg(data_dir, "--train.max_steps=8", "--train.save_every=100", *extra)
    straight = tmp_path / "straight"
    run(cfg, straight)

    # Interrupt the second run with a real SIGINT once step 4 is settled: it must save and exit cleanly.
    interrupted = tmp_path / "interrupted"
    original = StepEngine._settle

    def settle_then_interrupt(self, item, halted=False):
        assert self.overlap == overlap
        outcome = original(self, item, halted)
        if outcome.ok and outcome.step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return outcome

    monkeypatch.setattr(StepEngine, "_settle", settle_then_interrupt)
    summary = run(cfg, interrupted)
    monkeypatch.setattr(StepEngine, "_settle", original)
    stopped = 5 if overlap else 4  # with the overlap step 5 was in flight when step 4 settled
    assert summary.get("stopped_early") and summary["step"] == stopped
    assert [c.step for c in ckpt_lib.list_checkpoints(interrupted)] == [stopped]
    run(cfg, interrupted, resume=True)

    a, b = final_state(straight, 8), final_state(interrupted, 8)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    la = [r["loss"] for r in read_metrics(straight / "metrics.jsonl") if r["kind"] == "train"]
    lb = [r["loss"] for r in read_metrics(interrupted / "metrics.jsonl") if r["kind"] == "train"]
    assert la == lb


def test_failed_save_leaves_previous_checkpoint(data_dir, tmp_path, monkeypatch):
    cfg = tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2")
    from anyseek.checkpoint import folder as optim  # (the one-process writer calls its write_optimizer)

    calls = {"n": 0}
    real = optim.write_optimizer

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "write_optimizer", flaky)
    with pytest.raises(SaveFailed, match="could not save step 4 .*disk full"):  # the final save: the run stops
        run(cfg, tmp_path)
    assert [c.step for c in ckpt_lib.list_checkpoints(tmp_path)] == [2]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    assert ckpt_lib.latest_checkpoint(tmp_path).step == 2
    monkeypatch.setattr(optim, "write_optimizer", real)
    summary = run(cfg, tmp_path, resume=True)
    assert summary["step"] == 4


def test_corrupt_checkpoint_is_reported_and_previous_used(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2")
    run(cfg, tmp_path)
    weights = tmp_path / "step-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    messages = []
    assert ckpt_lib.latest_checkpoint(tmp_path, log=messages.append).step == 2
    assert "step-4" in messages[0] and "model.safetensors" in messages[0]
    t = Trainer(tiny_cfg(data_dir, "--train.max_steps=5", "--train.save_every=2"), tmp_path, resume=True,
                log=messages.append)
    assert t.run()["step"] == 5
    assert any("resumed from" in m and "step-2" in m for m in messages)


@pytest.mark.slow
def test_kill_9_during_save_keeps_previous_checkpoint(data_dir, tmp_path):
    out = tmp_path / "run"
    args = [f"--data.path={data_dir}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
            "--model.num_hidden_layers=2", "--train.max_steps=4", "--train.save_every=2", "--train.log_every=1",
            "--train.threads=1", "--train.tensorboard=false", "--train.eval_tokens=256", "--train.sample_tokens=2"]
    subprocess.run([sys.executable, "-m", "anyseek", "train", "--out", str(out), *args], check=True,
                   capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # Second run: resume, train to step 6, and hang in the middle of saving step-6; kill -9 it there.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANYSEEK_TEST_SLOW_SAVE": "60"}
    args[4] = "--train.max_steps=6"
    proc = subprocess.Popen([sys.executable, "-m", "anyseek", "train", "--out", str(out), "--resume", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:
        if "ANYSEEK_TEST_SLOW_SAVE" in line or time.time() > deadline:
            break
    proc.kill()
    proc.wait()
    assert any(p.name.startswith(".step-6.tmp-") for p in out.iterdir())  # the half-written save
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [2, 4]
    latest = ckpt_lib.latest_checkpoint(out)
    assert latest.step == 4
    ckpt_lib.verify(latest.path)


def test_nan_steps_are_skipped_then_stop_the_run(data_dir, tmp_path, monkeypatch):
    from anyseek.model.transformer import DeepSeekV3

    real_forward = DeepSeekV3.forward
    poison = {"calls": set()}
    counter = {"n": 0}

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if self.training:
            counter["n"] += 1
            if counter["n"] in poison["calls"]:
                out.lm_loss = out.lm_loss * float("nan")
        return out

    monkeypatch.setattr(DeepSeekV3, "forward", forward)
    poison["calls"] = {3}
    summary = run(tiny_cfg(data_dir, "--train.max_steps=5", "--train.save_every=100"), tmp_path / "a")
    skips = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["kind"] == "skip"]
    assert len(skips) == 1 and summary["step"] == 5

    counter["n"] = 0
    poison["calls"] = set(range(3, 100))
    out = tmp_path / "b"
    with pytest.raises(TrainingDiverged, match="3 non-finite steps in a row"):
        run(tiny_cfg(data_dir, "--train.max_steps=10", "--train.save_every=2", "--train.max_bad_steps=3"), out)
    assert ckpt_lib.latest_checkpoint(out).step == 2


def test_checkpoint_loads_in_transformers_with_equal_logits(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    run(tiny_cfg(data_dir, "--train.max_steps=3", "--train.save_every=100"), tmp_path)
    ckpt = tmp_path / "step-3"

    ours = anyseek.load_pretrained(ckpt).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    ids = torch.tensor([tok("The cat sat on the mat. The king ran north.")["input_ids"]])
    with torch.no_grad():
        a = ours(ids).logits.float()
        b = theirs(ids).logits.float()
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


def test_cli_config_error_names_the_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "anyseek", "train", "--out", str(tmp_path), "--train.max_stpes=3"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "unknown key train.max_stpes" in r.stderr and "max_steps" in r.stderr
