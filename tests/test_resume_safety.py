"""Nothing lost, nothing silent: --resume never destroys a run, checkpoints are verified, bad data and bad output
folders are found before the first step, and ordinary mistakes get one error line instead of a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_run, run, tiny_cfg

from anyseek.checkpoint import folder as ckpt_lib
from anyseek.train.preflight import DataError
from anyseek.train.resume import ResumeMismatch
from anyseek.train.trainer import Trainer, TrainingDiverged


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file()}



def test_resume_with_another_config_is_an_error_that_changes_nothing(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    before = _snapshot(out)
    cfg = tiny_cfg(data_dir, "--train.max_steps=6", "--train.save_every=2", "--model.num_hidden_layers=3",
                   "--train.lr=1e-3")
    with pytest.raises(ResumeMismatch) as err:
        run(cfg, out, resume=True)
    msg = str(err.value)
    assert "model.num_hidden_layers: checkpoint 2, this run 3" in msg and "train.lr" in msg
    assert "--resume-override" in msg
    assert _snapshot(out) == before  # nothing loaded, pruned or overwritten


def test_resume_override_allows_a_deliberate_change(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    cfg = tiny_cfg(data_dir, "--train.max_steps=6", "--train.save_every=2", "--train.lr=1e-3")
    with pytest.raises(ResumeMismatch, match="train.lr"):
        run(cfg, out, resume=True)
    messages: list[str] = []
    summary = Trainer(cfg, out, resume=True, log=messages.append, resume_overrides=("train.lr",)).run()
    assert summary["step"] == 6
    assert any("resumed from" in m and "train.lr: 0.003 -> 0.001" in m for m in messages)


def test_resume_on_other_data_is_an_error(data_dir, trained, tmp_path):
    from anyseek.data.prepare import prepare

    other = tmp_path / "other"
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"Other text number {i}. " * 20}) for i in range(60)) + "\n")
    prepare(source=str(src), out=other, vocab_size=300, val_fraction=0.1, progress=False)
    out = copy_run(trained, tmp_path)
    cfg = tiny_cfg(data_dir, "--train.max_steps=6", f"--data.path={other}")
    with pytest.raises(ResumeMismatch, match=r"data fingerprint.*\n.*data vocab_size: checkpoint \d+, this run 300"):
        run(cfg, out, resume=True)


def test_flipped_bytes_are_found_and_the_previous_checkpoint_used(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    weights = out / "step-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # inside tensor data: same size, valid header
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt_lib.CheckpointDamaged, match=r"model\.safetensors does not match its recorded sha256"):
        ckpt_lib.verify(out / "step-4")
    messages: list[str] = []
    Trainer(tiny_cfg(data_dir, "--train.max_steps=5", "--train.save_every=2"), out, resume=True,
            log=messages.append).run()
    assert any("step-4" in m and "sha256" in m for m in messages)
    assert any("resumed from" in m and "step-2" in m for m in messages)


def test_pruning_reads_no_tensor_data_and_keeps_the_newest(trained, tmp_path, monkeypatch):
    """After each save the old checkpoints are pruned by marker and sizes alone: re-hashing every kept checkpoint
    would read hundreds of GB per save on a large sharded run (resume checks the hashes)."""
    out = copy_run(trained, tmp_path)
    monkeypatch.setattr(ckpt_lib, "file_sha256", lambda f: pytest.fail(f"pruning hashed {f}"))
    ckpt_lib.prune(out, keep_last=1)
    assert sorted(p.name for p in out.glob("step-*")) == ["step-4"]


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    for step in (2, 4):
        (out / f"step-{step}" / "checkpoint.json").unlink()
    before = _snapshot(out)
    with pytest.raises(ckpt_lib.CheckpointDamaged, match="every checkpoint .* is damaged"):
        run(tiny_cfg(data_dir, "--train.max_steps=6"), out, resume=True)
    assert _snapshot(out) == before


def test_a_verified_checkpoint_that_does_not_load_is_an_error(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    ckpt = out / "step-4"
    (ckpt / "optimizer.json").write_text("{not json")
    marker = json.loads((ckpt / "checkpoint.json").read_text())
    marker["files"]["optimizer.json"] = {"size": (ckpt / "optimizer.json").stat().st_size,
                                         "sha256": ckpt_lib.file_sha256(ckpt / "optimizer.json")}
    (ckpt / "checkpoint.json").write_text(json.dumps(marker))
    with pytest.raises(ckpt_lib.CheckpointError, match="cannot be loaded into this run") as err:
        run(tiny_cfg(data_dir, "--train.max_steps=6", "--train.save_every=2"), out, resume=True)
    assert not isinstance(err.value, ckpt_lib.CheckpointDamaged)
    assert (out / "step-2").is_dir() and (out / "step-4").is_dir()


def test_resume_without_any_checkpoint_starts_fresh_and_says_so(data_dir, tmp_path):
    messages: list[str] = []
    Trainer(tiny_cfg(data_dir, "--train.max_steps=1"), tmp_path / "new", resume=True, log=messages.append).run()
    assert any("holds no checkpoint yet; starting from scratch" in m for m in messages)


def test_a_full_disk_during_a_periodic_save_warns_and_training_goes_on(data_dir, tmp_path, monkeypatch):
    from anyseek.checkpoint import folder as optim  # (the one-process writer calls its write_optimizer)

    real, calls = optim.write_optimizer, {"n": 0}

    def full_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(optim, "write_optimizer", full_once)
    messages: list[str] = []
    out = tmp_path / "run"
    summary = Trainer(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2"), out,
                      log=messages.append).run()
    assert summary["step"] == 4
    warning = [m for m in messages if "could not save step 2" in m]
    assert len(warning) == 1 and "no space left on the device" in warning[0] and "\n" not in warning[0]
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [4]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".step")]


def test_an_unwritable_output_folder_fails_at_start(data_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="is not writable"):
        run(tiny_cfg(data_dir, "--train.max_steps=1"), blocker / "run")


def test_staging_left_by_a_killed_save_is_cleaned_at_start(data_dir, trained, tmp_path):
    out = copy_run(trained, tmp_path)
    (out / ".step-6.tmp-999999999").mkdir()
    shutil.copytree(out / "step-4", out / ".step-4.old-999999999")
    messages: list[str] = []
    Trainer(tiny_cfg(data_dir, "--train.max_steps=5", "--train.save_every=2"), out, resume=True,
            log=messages.append).run()
    assert not [p for p in out.iterdir() if p.name.startswith(".step")]
    assert any("removed .step-6.tmp-999999999" in m for m in messages)


# ------------------------------------------------------------------------------------------ data problems


def _copy_data(prepared: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(prepared, dst)
    return dst


def test_truncated_shard_is_named_at_start(data_dir, tmp_path):
    data = _copy_data(data_dir, tmp_path)
    shard = data / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"train-00000\.bin: missing or truncated shard; re-prepare"):
        Trainer(tiny_cfg(data, "--train.max_steps=1"), tmp_path / "run", log=lambda s: None)


def test_malformed_manifest_is_named_at_start(data_dir, tmp_path):
    data = _copy_data(data_dir, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["num_tokens"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest\.json: malformed manifest.*num_tokens.*re-prepare"):
        Trainer(tiny_cfg(data, "--train.max_steps=1"), tmp_path / "run", log=lambda s: None)


def test_empty_train_split_is_an_error_at_start(data_dir, tmp_path):
    data = _copy_data(data_dir, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"].update(shards=[], documents=0)
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"manifest\.json: the train split holds 0 documents"):
        Trainer(tiny_cfg(data, "--train.max_steps=1"), tmp_path / "run", log=lambda s: None)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))


def test_vocab_larger_than_the_model_is_an_error_naming_both(data_dir, tmp_path):
    with pytest.raises(DataError, match=r"use \d+ token ids but the model has vocab_size 100; drop --model.vocab_size"):
        Trainer(tiny_cfg(data_dir, "--model.vocab_size=100"), tmp_path / "run", log=lambda s: None)


def test_empty_validation_split_trains_without_validation(tmp_path):
    from anyseek.data.prepare import prepare

    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"Document {i}. " + "the cat sat on a mat. " * 8})
                             for i in range(40)) + "\n")
    data = tmp_path / "data"
    manifest = prepare(source=str(src), out=data, vocab_size=300, val_fraction=0.0, progress=False)
    assert manifest["documents"]["val"] == 0
    messages: list[str] = []
    cfg = tiny_cfg(data, "--train.max_steps=3", "--train.eval_every=1")
    summary = Trainer(cfg, tmp_path / "run", log=messages.append).run()
    assert summary["step"] == 3 and summary["val_loss"] != summary["val_loss"]  # NaN: no validation
    assert any("no validation documents" in m for m in messages)


def test_damaged_compressed_inputs_are_counted_skips_keeping_earlier_documents(tmp_path, capsys):
    import gzip
    import lzma

    from anyseek.data.prepare import prepare

    lines = b"".join(json.dumps({"text": f"Document {i}. " + "words and more words " * 30}).encode() + b"\n"
                     for i in range(300))
    src = tmp_path / "src"
    src.mkdir()
    full = gzip.compress(lines)
    (src / "a.jsonl.gz").write_bytes(full[: len(full) // 2])  # truncated
    (src / "b.jsonl.gz").write_bytes(b"this is not gzip\n" * 20)  # not gzip at all
    xz = lzma.compress(lines)
    (src / "c.jsonl.xz").write_bytes(xz[: len(xz) // 2])
    manifest = prepare(source=str(src / "*"), out=tmp_path / "out", vocab_size=300, val_fraction=0.0,
                       progress=False)
    assert manifest["skipped"]["damaged_compressed_file"] == 3
    assert manifest["documents"]["train"] > 100  # the documents before each damage are kept
    where = " ".join(e["where"] for e in manifest["skipped_examples"])
    assert "a.jsonl.gz: truncated" in where and "b.jsonl.gz: not a gzip file" in where
    assert "skipped 3 inputs" in capsys.readouterr().err  # progress=False (--quiet) still reports skips


# ------------------------------------------------------------------------------------------ one error line


def _anyseek(*args: str, stdin=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anyseek", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_ordinary_mistakes_print_one_error_line(data_dir, tmp_path):
    base = ["train", "--out", str(tmp_path / "r"), f"--data.path={data_dir}", "--train.max_steps=1"]
    cases = {
        "--train.device=cuda:7": "sees no CUDA GPU",
        "--train.attention_backend=flashy": "unknown backend 'flashy'",
        "--train.lr=inf": "train.lr must be a finite number",
    }
    for arg, expected in cases.items():
        r = _anyseek(*base, arg, env={"CUDA_VISIBLE_DEVICES": ""})
        assert r.returncode == 2, (arg, r.stderr)
        assert "Traceback" not in r.stderr and expected in r.stderr, (arg, r.stderr)
    r = _anyseek("--debug", *base, "--train.device=cuda:7", env={"CUDA_VISIBLE_DEVICES": ""})
    assert "Traceback" in r.stderr


def test_broken_pipe_is_quiet(data_dir):
    p = subprocess.Popen([sys.executable, "-m", "anyseek", "data", "inspect", str(data_dir), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(10)
    p.stdout.close()  # like `| head -c 10`
    err = p.stderr.read().decode()
    p.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_nan_run_without_checkpoint_does_not_claim_one(data_dir, tmp_path, monkeypatch):
    from anyseek.model.transformer import DeepSeekV3

    real = DeepSeekV3.forward

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.training:
            out.lm_loss = out.lm_loss * float("nan")
        return out

    monkeypatch.setattr(DeepSeekV3, "forward", poisoned)
    with pytest.raises(TrainingDiverged, match="No checkpoint was written yet") as err:
        run(tiny_cfg(data_dir, "--train.max_steps=5", "--train.max_bad_steps=2"), tmp_path / "run")
    assert "intact" not in str(err.value)


def test_progress_eta_waits_for_warm_up_and_shows_the_lm_loss():
    import io

    from anyseek.train.metrics import TrainProgress

    stream = io.StringIO()
    p = TrainProgress(100, stream=stream, every=1)
    p.update(1, 3.5, 1000.0, {"mtp": 3.9, "balance": 1.01})
    p.update(2, 3.4, 1000.0, {"mtp": 3.8})
    first, second = stream.getvalue().splitlines()
    assert "lm loss 3.5000 mtp 3.9000 balance(sum) 1.0100" in first and "ETA --:--" in first
    assert "ETA 0:00:00" in second


def test_doctor_check_prints_skipped_rows_as_skip(monkeypatch, capsys):
    import argparse

    from anyseek import doctor
    from anyseek.kernels import accuracy

    rows = [{"what": "triton fp16", "detail": "skipped: needs a CUDA GPU", "pass": True, "skipped": True},
            {"what": "sdpa fp32", "detail": "err 1e-7", "pass": True}]
    monkeypatch.setattr(accuracy, "check_all", lambda device: rows)
    monkeypatch.setattr(doctor, "report", lambda device: [])
    assert doctor.run(argparse.Namespace(device="cpu", check=True), []) == 0
    out = capsys.readouterr().out
    assert "SKIP  triton fp16" in out and "PASS  sdpa fp32" in out


def test_train_help_lists_the_config_sections_and_keys():
    r = _anyseek("train", "--help")
    assert r.returncode == 0
    for text in ("[model]", "[data]", "tokens_per_batch", "[train]", "max_steps", "--resume-override"):
        assert text in r.stdout, text


def test_readme_names_a_checkpoint_the_default_run_writes():
    from anyseek.train.config import load_run_config

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    t = load_run_config("tiny").train
    written = {f"runs/tiny/step-{s}" for s in range(t.save_every, t.max_steps, t.save_every)} | {
        f"runs/tiny/step-{t.max_steps}"}
    named = {w for w in readme.split('"') if w.startswith("runs/tiny/step-")}
    assert named and named <= written, named
    assert readme.index("CPU-only") < readme.index("pip install -e")  # the install note comes first
    assert "unexpected" in readme and "MTP" in readme


def test_built_in_plot_has_title_axis_labels_and_legend():
    from anyseek.train import plot

    blank = plot._draw([], [], "")
    img = plot._draw([], [], "tiny on wiki-sample")

    def inked(rows, y0, y1, x0, x1):
        return any(rows[y][3 * x] != 255 for y in range(y0, y1) for x in range(x0, x1))

    assert inked(img, 5, 20, 10, 200) and not inked(blank, 5, 20, 10, 200)  # the title
    assert inked(blank, plot.H - 22, plot.H - 2, plot.W // 2 - 30, plot.W // 2 + 30)  # "STEP" under the x axis
    assert inked(blank, plot.MARGIN_T - 20, plot.MARGIN_T - 8, 4, 40)  # "LOSS" over the y axis
    assert inked(blank, plot.MARGIN_T, plot.MARGIN_T + 32, plot.W - 200, plot.W - plot.MARGIN_R)  # the legend


def test_second_ctrl_c_exits_quietly(monkeypatch, capsys):
    from anyseek import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["train"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted" in err
