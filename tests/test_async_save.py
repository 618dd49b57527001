"""Checkpoints written in the background (train.async_save, anyseek.checkpoint.background): the same files as a
synchronous save of the same step, even when the model, the optimizer and the random streams change while the thread
writes; a process killed mid-write leaves the previous checkpoint as the one --resume takes, and the resumed run is
the uninterrupted one bit for bit; a failed background write means what a failed save always meant (one warning, or
SaveFailed), seen at the next step; one process and two gloo ranks."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import final_state, run, spawn, tiny_cfg, train_losses

from anyseek import checkpoint
from anyseek.checkpoint import folder as ckpt_lib
from anyseek.train.trainer import SaveFailed, Trainer

ASYNC = "--train.async_save=true"


def _files(ckpt: Path) -> dict:
    """checkpoint.json's record of every file (size, sha256), but: a sharded checkpoint's shards by content
    (`_shard`), train_state.json without the time it was written, run_config.json without train.async_save."""
    files = json.loads((ckpt / "checkpoint.json").read_text())["files"]
    state, config = (json.loads((ckpt / name).read_text()) for name in ("train_state.json", "run_config.json"))
    state.pop("saved_at")
    config["train"].pop("async_save")
    out = {k: _shard(ckpt / k) if k.startswith("dcp/") else v for k, v in files.items()}
    return {**out, "train_state.json": state, "run_config.json": config}


def _shard(path: Path) -> dict:
    """A DCP shard's header, parsed, and the sha256 of its tensor data: safetensors writes the keys of a header's
    metadata in a random order (a Rust HashMap: DCP's three keys), so two saves of the same tensors, synchronous
    ones too, differ in those bytes alone."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    return {"header": header, "data": hashlib.sha256(raw[8 + n:]).hexdigest()}


def _shards(folder: Path) -> dict:
    return {p.name: _shard(p) for p in sorted(folder.glob("*.safetensors"))}


def test_dcp_files_streamed_to_disk_are_dcps_own(tmp_path):
    """The sharded writer streams each file with safetensors' save_file (GIL released, no in-memory copy of the
    file): the same headers (sharding metadata included) and tensor bytes as DCP's own Hugging Face writer, and DCP
    reads them back."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    from anyseek.checkpoint.dcp_writer import StreamingWriter

    big = torch.randn(6, 8)
    state = {"model": {"w": torch.randn(5, 3), "view": big[2:4], "b": torch.arange(7, dtype=torch.int64),
                       "h": torch.randn(4, 4).bfloat16()}, "optim": {"w": {"exp_avg": torch.randn(5, 3),
                                                                            "step": torch.tensor(3.0)}}}
    with warnings.catch_warnings():  # (one process without a process group)
        warnings.simplefilter("ignore", UserWarning)
        for name, writer in (("own", HuggingFaceStorageWriter), ("streamed", StreamingWriter)):
            dcp.save(state, storage_writer=writer(str(tmp_path / name), save_distributed=True))
        back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                "optim": {"w": {k: torch.zeros_like(v) for k, v in state["optim"]["w"].items()}}}
        dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "streamed")))
    assert _shards(tmp_path / "own") == _shards(tmp_path / "streamed") and len(_shards(tmp_path / "own")) == 1
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert torch.equal(back["optim"]["w"]["exp_avg"], state["optim"]["w"]["exp_avg"])


def _save_args(trainer: Trainer, out: Path) -> tuple:
    """What Trainer._save hands the checkpoint package for step N (the train state as a fresh dict)."""
    state = {"tokens_seen": trainer.tokens_seen, "loader": trainer.train_loader.state_dict(),
             "bad_in_a_row": trainer.bad_in_a_row, "data": trainer.data_identity(), **trainer.start.record()}
    return (out, trainer.step, trainer.model, trainer.optimizer, state, trainer.cfg.to_dict(),
            trainer.tokenizer_files, 3)


def _gate(monkeypatch, module, name: str) -> threading.Event:
    """The background writer `module.name` waits for the returned event before it writes anything."""
    real, gate = getattr(module, name), threading.Event()

    def gated(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, gated)
    return gate


def _change_everything(trainer: Trainer, state: dict) -> None:
    """What the next steps do to what a save holds: the weights, the optimizer's moments and step, the random
    streams, the caller's train-state dict."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
        for st in trainer.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    (v.to_local() if hasattr(v, "to_local") else v).add_(1.0)
    torch.rand(7)
    random.random()
    state["tokens_seen"] = -1
    state["loader"].clear()


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("how", ["fp32", "working-copy"])
def test_background_save_is_the_synchronous_one_of_the_step_it_was_taken_at(data_dir, tmp_path, monkeypatch, how):
    """(a) the files a background save writes are byte for byte those of a synchronous save of the same step, and
    (b) they stay so while the writer is held back and everything it copied changes (working-copy: the weights and
    moments are views of flat buffers, precision.FlatAdamW)."""
    extra = ("--train.working_copy=true", "--train.dtype=bf16") if how == "working-copy" else ()
    trainer = Trainer(tiny_cfg(data_dir, "--train.max_steps=2", "--train.save_every=100", *extra), tmp_path / "run",
                      log=lambda s: None)
    trainer.run()
    monkeypatch.setattr(time, "time", lambda: 1.0e9)  # train_state.json's saved_at
    args = _save_args(trainer, tmp_path / "sync")
    checkpoint.save(*args)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    gate = _gate(monkeypatch, ckpt_lib, "write_snapshot")
    saver = checkpoint.BackgroundSaver()
    args = _save_args(trainer, tmp_path / "async")
    saver.start(*args)
    assert saver.running() and not (tmp_path / "async" / "step-2").exists()
    _change_everything(trainer, args[4])
    assert not any(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # it did change
    gate.set()
    assert saver.wait() == tmp_path / "async" / "step-2"
    a, b = (json.loads((tmp_path / d / "step-2" / "checkpoint.json").read_text()) for d in ("sync", "async"))
    assert a == b
    assert saver.host.nbytes() > 0 and saver.wait() is None


def test_a_second_background_save_waits_for_the_first(data_dir, tmp_path):
    trainer = Trainer(tiny_cfg(data_dir, "--train.max_steps=1", "--train.save_every=100"), tmp_path / "run",
                      log=lambda s: None)
    saver = checkpoint.BackgroundSaver()
    saver.start(*_save_args(trainer, tmp_path / "out"))
    with pytest.raises(RuntimeError, match="was not waited for"):
        saver.start(*_save_args(trainer, tmp_path / "out"))
    assert saver.wait() == tmp_path / "out" / "step-0"


def _fail_writes(monkeypatch, calls: set[int]) -> None:
    """The one-process writer's optimizer file fails (a full disk) at the given calls (1, 2, ...)."""
    real, n = ckpt_lib.write_optimizer, {"n": 0}

    def write_optimizer(*args, **kwargs):
        n["n"] += 1
        if n["n"] in calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_lib, "write_optimizer", write_optimizer)


def test_a_failed_background_write_is_one_warning_then_saving_goes_on(data_dir, tmp_path, monkeypatch):
    """(d) the periodic save's failure in the thread is the synchronous save's one warning line, seen at the next
    step; training and later saves go on; nothing is left of the failed one."""
    _fail_writes(monkeypatch, {1})
    messages: list[str] = []
    out = tmp_path / "run"
    summary = Trainer(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2", ASYNC), out,
                      log=messages.append).run()
    assert summary["step"] == 4 and summary["checkpoint"] == str(out / "step-4")
    assert any(m.startswith("saving step-2 in the background (staged in") for m in messages), messages
    warning = [m for m in messages if "could not save step 2" in m]
    assert len(warning) == 1 and "no space left on the device" in warning[0] and "training goes on" in warning[0]
    assert [m for m in messages if m.startswith("saved ")] == [f"saved {out / 'step-4'}"]  # the final: at once
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [4]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step")]


def test_a_failed_final_save_after_background_ones_raises_save_failed(data_dir, tmp_path, monkeypatch):
    """The final save is written at once (nothing left to overlap it with); its failure stops the run as ever, and the
    background-written step-2 is the newest checkpoint."""
    _fail_writes(monkeypatch, {2})
    messages: list[str] = []
    out = tmp_path / "run"
    with pytest.raises(SaveFailed, match="could not save step 4 .*no space left"):
        Trainer(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2", ASYNC), out,
                log=messages.append).run()
    assert f"saved {out / 'step-2'} (written in the background in" in "\n".join(messages)
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [2] and ckpt_lib.latest_checkpoint(out).step == 2
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step")]


def test_three_failed_background_saves_in_a_row_stop_the_run(data_dir, tmp_path, monkeypatch):
    _fail_writes(monkeypatch, set(range(1, 100)))
    messages: list[str] = []
    out = tmp_path / "run"
    with pytest.raises(SaveFailed, match="could not save step 3 "):
        Trainer(tiny_cfg(data_dir, "--train.max_steps=12", "--train.save_every=1", ASYNC), out,
                log=messages.append).run()
    assert len([m for m in messages if m.startswith("warning: could not save step")]) == 2
    assert max(train_losses(out)) < 12 and not ckpt_lib.list_checkpoints(out)


def _slow_writes(monkeypatch, seconds: float) -> None:
    """The one-process background writer starts `seconds` late: still writing when the loop has trained on."""
    real = ckpt_lib.write_snapshot

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_lib, "write_snapshot", slow)


def test_a_stop_and_a_divergence_complete_the_background_save_in_flight(data_dir, tmp_path, monkeypatch):
    """Ctrl-C while step-2 is written in the background: the stop's save (step 3, at once) waits for it, and both
    are complete when the run returns; a run that diverges completes its save in flight before it raises."""
    import signal

    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.step import StepEngine
    from anyseek.train.trainer import TrainingDiverged

    _slow_writes(monkeypatch, 1.0)
    settle = StepEngine._settle

    def interrupt_at_3(self, item, halted=False):
        outcome = settle(self, item, halted)
        if outcome.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return outcome

    monkeypatch.setattr(StepEngine, "_settle", interrupt_at_3)
    messages: list[str] = []
    out = tmp_path / "stopped"
    summary = Trainer(tiny_cfg(data_dir, "--train.max_steps=8", "--train.save_every=2", ASYNC), out,
                      log=messages.append).run()
    assert summary.get("stopped_early") and summary["step"] == 3
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [2, 3] and ckpt_lib.latest_checkpoint(out).step == 3
    assert any(m.startswith("waited ") and "step-2" in m for m in messages), messages
    monkeypatch.setattr(StepEngine, "_settle", settle)

    forward, calls = DeepSeekV3.forward, {"n": 0}

    def nan_from_the_third(self, *args, **kwargs):
        result = forward(self, *args, **kwargs)
        calls["n"] += self.training
        if self.training and calls["n"] >= 3:
            result.lm_loss = result.lm_loss * float("nan")
        return result

    monkeypatch.setattr(DeepSeekV3, "forward", nan_from_the_third)
    out = tmp_path / "diverged"
    with pytest.raises(TrainingDiverged):
        run(tiny_cfg(data_dir, "--train.max_steps=10", "--train.save_every=2", "--train.max_bad_steps=2", ASYNC), out)
    assert ckpt_lib.latest_checkpoint(out).step == 2
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step")]


def test_pruning_in_the_background_keeps_the_newest_complete_checkpoint_at_every_step(data_dir, tmp_path, monkeypatch):
    """keep_last=1 with a save every step, each written slowly: after the first save is complete there is a complete
    checkpoint at every step (pruning runs after the new folder is in place, one save at a time), and the run ends
    with the last one alone."""
    from anyseek.train.saving import Saves

    _slow_writes(monkeypatch, 0.2)
    out, newest = tmp_path / "run", []
    poll = Saves.poll

    def watch(self):
        poll(self)
        latest = ckpt_lib.latest_checkpoint(out, log=lambda s: None)
        newest.append(latest.step if latest else None)

    monkeypatch.setattr(Saves, "poll", watch)
    run(tiny_cfg(data_dir, "--train.max_steps=6", "--train.save_every=1", "--train.keep_last=1", ASYNC), out)
    first = next(i for i, s in enumerate(newest) if s is not None)
    assert None not in newest[first:] and newest[first:] == sorted(newest[first:]), newest
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [6]


# ---------------------------------------------------------------------------------------------- resume, kill -9
@pytest.mark.slow
def test_runs_saving_in_the_background_write_the_same_checkpoints_and_resume_exactly(data_dir, tmp_path):
    """(e) the same steps with background saves: every checkpoint the synchronous run's (but saved_at), the same
    losses; resumed from a background-saved checkpoint (itself saving in the background), bit for bit the run that
    was never interrupted."""
    over = ["--train.max_steps=6", "--train.save_every=2", "--train.keep_last=3"]
    run(tiny_cfg(data_dir, *over, "--train.async_save=false"), tmp_path / "sync")
    run(tiny_cfg(data_dir, *over, ASYNC), tmp_path / "async")
    for step in (2, 4, 6):
        assert _files(tmp_path / "sync" / f"step-{step}") == _files(tmp_path / "async" / f"step-{step}"), step
    assert train_losses(tmp_path / "sync") == train_losses(tmp_path / "async")
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "async", out, ignore=shutil.ignore_patterns("step-6", "metrics.jsonl"))
    run(tiny_cfg(data_dir, *over, ASYNC), out, resume=True)
    assert _files(out / "step-6") == _files(tmp_path / "sync" / "step-6")
    assert train_losses(out) == {s: v for s, v in train_losses(tmp_path / "sync").items() if s > 4}


@pytest.mark.slow
def test_kill_9_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_exactly(data_dir, tmp_path):
    """(c) a real process, killed while its thread writes step-6 and its loop trains on: step-4 is what latest and
    --resume take, the staging folder is cleaned up, and the resumed run ends with the weights of the same resume
    never interrupted."""
    over = ["--train.save_every=2", ASYNC]
    out, straight = tmp_path / "run", tmp_path / "straight"
    run(tiny_cfg(data_dir, "--train.max_steps=4", *over), out)
    shutil.copytree(out, straight)
    run(tiny_cfg(data_dir, "--train.max_steps=8", *over), straight, resume=True)
    args = [f"--data.path={data_dir}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
            "--model.num_hidden_layers=2", "--train.warmup_steps=2", "--train.lr=3e-3", "--train.log_every=1",
            "--train.eval_every=1000", "--train.eval_tokens=512", "--train.sample_tokens=5", "--train.threads=1",
            "--train.tensorboard=false", "--train.max_steps=8", *over]  # (tiny_cfg's settings)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANYSEEK_TEST_SLOW_SAVE": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "anyseek", "train", "--out", str(out), "--resume", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 120
        for line in proc.stdout:  # the thread sleeps in the middle of writing step-6
            if "ANYSEEK_TEST_SLOW_SAVE" in line or time.time() > deadline:
                break
        while time.time() < deadline and 8 not in train_losses(out):
            time.sleep(0.2)  # meanwhile the loop trains on: steps 7 and 8 (then waits for step-6 to finish)
        assert 8 in train_losses(out)
    finally:
        proc.kill()
        proc.wait()
    assert any(p.name.startswith(".step-6.tmp-") for p in out.iterdir())  # the half-written save
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [2, 4]
    assert ckpt_lib.latest_checkpoint(out).step == 4
    messages: list[str] = []
    Trainer(tiny_cfg(data_dir, "--train.max_steps=8", *over), out, resume=True, log=messages.append).run()
    assert any(m.startswith(f"resumed from {out / 'step-4'} at step 4") for m in messages), messages
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step")]
    a, b = final_state(straight, 8), final_state(out, 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- two gloo ranks
def _two_ranks_snapshot_and_failure(data: str, root: str) -> None:
    """One rank of a 2-step 2-rank run; then (a, b) a synchronous and a gated background save of step 2 with
    everything changed before the gate opens, and (d) a background save that fails on rank 1 only: the same OSError
    on both ranks, nothing left. Rank 0 writes what it found to result.json."""
    from anyseek.checkpoint import sharded

    patch = pytest.MonkeyPatch()  # (this process ends with the run)
    root = Path(root)
    trainer = Trainer(tiny_cfg(Path(data), "--train.max_steps=2", "--train.save_every=100"), root / "run",
                      log=lambda s: None)
    trainer.run()
    env, masters = trainer.par.env, trainer.par.masters
    patch.setattr(time, "time", lambda: 1.0e9)
    checkpoint.save(*_save_args(trainer, root / "sync"), env=env, masters=masters)
    import torch.distributed.checkpoint as dcp  # the same state by DCP's own writer (ours streams its files)
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    live = sharded.snapshot_sharded(*_save_args(trainer, root)[1:7], env, masters).state
    dcp.save(live, storage_writer=HuggingFaceStorageWriter(str(root / "dcp-own"), save_distributed=True))
    gate = _gate(patch, sharded, "write_sharded")
    saver = checkpoint.BackgroundSaver(env)
    args = _save_args(trainer, root / "async")
    saver.start(*args, masters=masters)
    _change_everything(trainer, args[4])
    gate.set()
    path = saver.wait()
    if env.rank == 1:
        patch.setattr(sharded, "file_sha256", lambda f: (_ for _ in ()).throw(OSError(errno.ENOSPC, "disk full")))
    saver.start(*_save_args(trainer, root / "failed"), masters=masters)
    try:
        saver.wait()
        failure = None
    except OSError as e:
        failure = [e.errno, str(e)]
    if env.is_main:
        a, b = _files(root / "sync" / "step-2"), _files(path)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        left = sorted(p.name for p in (root / "failed").iterdir())
        own = _shards(root / "dcp-own") == _shards(root / "sync" / "step-2" / "dcp") != {}
        (root / "result.json").write_text(json.dumps({"differ": differ, "failure": failure, "left": left,
                                                      "dcp_own": own}))
    else:
        (root / "rank1.json").write_text(json.dumps({"failure": failure}))


@pytest.mark.slow
def test_two_ranks_background_save_is_the_synchronous_one_and_a_failure_is_everyones(data_dir, tmp_path):
    assert spawn(_two_ranks_snapshot_and_failure, str(data_dir), str(tmp_path), timeout=300) == [0, 0]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["differ"] == [] and result["dcp_own"], result
    assert result["failure"][0] == errno.ENOSPC and "on rank 1" in result["failure"][1], result
    assert json.loads((tmp_path / "rank1.json").read_text())["failure"][0] == errno.ENOSPC
    assert result["left"] == [], result  # no step-2, no staging folder


@pytest.mark.slow
def test_two_ranks_saving_in_the_background_write_the_same_checkpoints_and_resume_exactly(data_dir, tmp_path):
    """(e) under torchrun: the sharded checkpoints of a run saving in the background are the synchronous run's (but
    saved_at), and a resume from one (on 2 ranks, saving in the background) gives the same losses."""
    from helpers import train_ranks

    over = ["--train.max_steps=6", "--train.save_every=2", "--train.keep_last=3", "--model.bias_update_speed=0.01"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "sync"), [*over, "--train.async_save=false"], False,
                 timeout=300) == [0, 0]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "async"), [*over, ASYNC], False, timeout=300) == [0, 0]
    for step in (2, 4, 6):
        a, b = (_files(tmp_path / r / f"step-{step}") for r in ("sync", "async"))
        assert a == b and any(k.startswith("dcp/") for k in a), step
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "async", out, ignore=shutil.ignore_patterns("step-6", "metrics.jsonl"))
    assert spawn(train_ranks, str(data_dir), str(out), [*over, ASYNC], True, timeout=300) == [0, 0]
    assert _files(out / "step-6") == _files(tmp_path / "sync" / "step-6")
    assert train_losses(out) == {s: v for s, v in train_losses(tmp_path / "sync").items() if s > 4}


@pytest.mark.slow
def test_checkpoint_benchmark_runs_on_the_cpu(data_dir, tmp_path):
    """benchmarks/checkpoint_save.py (for GPUs: the loop's blocked time per save) runs end to end on the tiny flavor,
    prints its table and leaves only its result behind (--keep)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "checkpoint_save.py"
    out = subprocess.run([sys.executable, str(script), "--flavor", "tiny", "--device", "cpu", "--layers", "2",
                          "--steps", "1", "--out", str(tmp_path / "bench"), "--keep",
                          f"--override=--data.path={data_dir}", "--override=--data.tokens_per_batch=256",
                          "--override=--data.max_seqlen=64", "--override=--train.threads=1"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| synchronous save (train.async_save=false) |" in out.stdout, out.stdout
    assert "| background save, later ones (buffers reused) |" in out.stdout, out.stdout
    result = json.loads((tmp_path / "bench" / "result.json").read_text())
    assert result["bytes"] > 0 and result["next_blocked_s"] >= 0
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == ["result.json"]


def test_buffers_reserved_ahead_are_the_ones_the_copy_fills():
    """`HostBuffers.reserve` makes exactly the buffers `copy_tree` then fills, in place (no second allocation), from
    `specs` that name a tree's tensors as `copy_tree` does."""
    from anyseek.checkpoint.host import HostBuffers

    tree = {"model": {"a": torch.randn(3, 4), "b": torch.arange(5)}, "optim": [{"m": torch.ones(2)}, 7]}
    host = HostBuffers()
    specs = host.specs(tree)
    assert specs == [("/model/a", (3, 4), torch.float32, False), ("/model/b", (5,), torch.int64, False),
                     ("/optim/0/m", (2,), torch.float32, False)]
    host.reserve(specs)
    made = {n: b.data_ptr() for n, b in host.buffers.items()}
    copied = host.copy_tree(tree)
    assert {n: b.data_ptr() for n, b in host.buffers.items()} == made
    assert torch.equal(copied["model"]["a"], tree["model"]["a"]) and copied["optim"][1] == 7
    assert copied["model"]["a"].data_ptr() == made["/model/a"]
