"""No data loss, nothing silent, around checkpoints and run folders: `anyseek export` never replaces what it did not
write, a run folder has one run at a time, a full disk during a save is one line, generate/eval/--init refuse damaged
or foreign inputs, and the identity of a pretrained folder covers every byte."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import copy_run, run, spawn, tiny_cfg
from safetensors import SafetensorError

from anyseek import hf
from anyseek.checkpoint import folder as ckpt_lib
from anyseek.checkpoint import identity
from anyseek.checkpoint.exporter import EXPORT_JSON, ExportRefused, check_out
from anyseek.cli import main
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3
from anyseek.storage import LOCK_FILE, CheckpointError, FolderInUse, lock_folder
from anyseek.train.trainer import Trainer

TRAIN_ARGS = ["--data.tokens_per_batch=256", "--data.max_seqlen=64", "--model.num_hidden_layers=2",
              "--train.log_every=1", "--train.threads=1", "--train.tensorboard=false", "--train.eval_tokens=256",
              "--train.sample_tokens=2"]



def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _flip(file: Path, offset: int | None = None, n: int = 4096) -> None:
    """Invert `n` bytes from `offset` (default: the middle of the file), keeping its size."""
    data = bytearray(file.read_bytes())
    start = len(data) // 2 if offset is None else offset
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    file.write_bytes(bytes(data))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _anyseek(*args, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "anyseek", *map(str, args)], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, timeout=600, **kw)


def _tiny_model(vocab: int = 300) -> DeepSeekV3:
    torch.manual_seed(0)
    return DeepSeekV3(ModelConfig.from_name("tiny", vocab_size=vocab, num_hidden_layers=2))


# ------------------------------------------------------------------------------------------ export --out


def test_export_refuses_a_folder_holding_user_files(trained, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("years of work")
    rc, _, err = cli(capsys, "export", trained, "--out", out)
    assert rc == 2 and err.count("\n") == 1 and "thesis.txt" in err and "not written by anyseek export" in err
    assert sorted(os.listdir(out)) == ["thesis.txt"] and (out / "thesis.txt").read_text() == "years of work"


def test_export_never_writes_into_a_run_or_its_checkpoints(trained, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    before = _snapshot(run_dir)
    cases = [
        (run_dir, run_dir, "which the export reads"),                              # the whole run
        (run_dir, run_dir / "step-2", "which the export reads"),                   # its optimizer state
        (run_dir / "step-2", run_dir / "step-4", "a training run's folder"),       # step-2's weights in step-4
        (run_dir / "step-2", run_dir / "exported", "a training run's folder"),     # a new folder inside the run
    ]
    for src, out, says in cases:
        rc, _, err = cli(capsys, "export", src, "--out", out)
        assert rc == 2 and err.count("\n") == 1 and says in err, (out, err)
    assert _snapshot(run_dir) == before


def test_export_replaces_an_earlier_export_and_nothing_else(trained, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert cli(capsys, "export", trained / "step-2", "--out", out)[0] == 0
    mark = json.loads((out / EXPORT_JSON).read_text())
    assert mark["source"] == str((trained / "step-2").resolve())
    assert set(mark["files"]) == {p.name for p in out.iterdir()} - {EXPORT_JSON}
    assert cli(capsys, "export", trained, "--out", out)[0] == 0  # the run's newest checkpoint replaces it
    assert json.loads((out / EXPORT_JSON).read_text())["source"] == str((trained / "step-4").resolve())
    got, want = load_file(out / "model.safetensors"), load_file(trained / "step-4" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    (out / "notes.md").write_text("mine")
    rc, _, err = cli(capsys, "export", trained, "--out", out)
    assert rc == 2 and "notes.md" in err and (out / "notes.md").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert cli(capsys, "export", trained, "--out", tmp_path / "empty")[0] == 0


@pytest.mark.parametrize("path", ["export", "merge", "peft", "sharded"])
def test_every_export_path_checks_out_before_it_reads(trained, tmp_path, path):
    from anyseek.checkpoint.exporter import export, export_merged, export_peft, export_sharded

    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("x")
    write = {"export": lambda: export(trained, out), "merge": lambda: export_merged(trained, out),
             "peft": lambda: export_peft(trained, out), "sharded": lambda: export_sharded(trained / "step-4", out)}[path]
    with pytest.raises(ExportRefused, match="thesis.txt"):  # (not "not a LoRA / sharded checkpoint")
        write()
    assert sorted(os.listdir(out)) == ["thesis.txt"]


def test_export_never_writes_over_or_around_what_it_reads(tmp_path):
    base = tmp_path / "models" / "base"
    base.mkdir(parents=True)
    (base / "config.json").write_text("{}")
    (base / EXPORT_JSON).write_text(json.dumps({"files": ["config.json"]}))  # an export: replaceable as a folder
    step = tmp_path / "runs" / "lora" / "step-4"
    with pytest.raises(ExportRefused, match="is .*base, which the export reads"):
        check_out(base, step, base)
    with pytest.raises(ExportRefused, match="holds .*base, which the export reads"):
        check_out(tmp_path / "models", step, base)
    assert check_out(tmp_path / "models" / "merged", step, base) == tmp_path / "models" / "merged"


def test_save_pretrained_refuses_a_folder_holding_other_files(trained, tmp_path):
    model = _tiny_model()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("x")
    with pytest.raises(FileExistsError, match="thesis.txt"):
        hf.save_pretrained(model, mine)
    assert sorted(os.listdir(mine)) == ["thesis.txt"]
    step = copy_run(trained, tmp_path) / "step-4"
    before = _snapshot(step)
    with pytest.raises(FileExistsError, match="optimizer"):  # a checkpoint's training state
        hf.save_pretrained(model, step)
    assert _snapshot(step) == before
    hf.save_pretrained(model, tmp_path / "m")  # a model folder (tokenizer files kept) is still replaced
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    hf.save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------------------ one run per folder


def test_folder_lock_names_its_holder_and_goes_with_it(tmp_path):
    lock = lock_folder(tmp_path)
    with pytest.raises(FolderInUse, match=f"{tmp_path} is in use .*pid {os.getpid()} on {socket.gethostname()}"):
        lock_folder(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    lock_folder(tmp_path).release()


@pytest.mark.slow
def test_a_second_run_into_a_busy_folder_fails_at_once_and_a_killed_run_resumes(data_dir, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--out", out, f"--data.path={data_dir}", "--train.max_steps=4", "--train.save_every=2",
            *TRAIN_ARGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ANYSEEK_TEST_SLOW_SAVE": "300"}
    first = subprocess.Popen([sys.executable, "-m", "anyseek", *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 300
        for line in first.stdout:  # the first run is saving step 2 (and sleeps there)
            if "ANYSEEK_TEST_SLOW_SAVE" in line or time.time() > deadline:
                break
        before = _snapshot(out)
        second = _anyseek(*args)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), second.stderr
        assert f"{out} is in use" in lines[0] and f"pid {first.pid} on {socket.gethostname()}" in lines[0]
        assert _snapshot(out) == before  # nothing written, nothing cleaned up under the live run
    finally:
        first.kill()
        first.wait()
    resumed = _anyseek(*args, "--resume")  # at once: the killed run's lock went with it
    assert resumed.returncode == 0, resumed.stderr
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [2, 4]
    assert not (out / LOCK_FILE).exists() and not [p for p in out.iterdir() if p.name.startswith(".step")]


def test_a_filesystem_without_locks_is_a_warning_not_a_refusal(tmp_path, monkeypatch):
    import errno
    import fcntl

    from anyseek.train.preflight import claim_out_dir

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    messages: list[str] = []
    lock = claim_out_dir(tmp_path / "run", messages.append)
    assert not lock.held and any("without file locks" in m for m in messages)
    lock.release()
    assert os.listdir(tmp_path / "run") == []


def _train_into_busy_folder(data: str, out: str) -> None:
    """A rank of a 2-rank run into a folder the test holds: every rank must stop with the same one-line reason."""
    rank = int(os.environ["RANK"])
    try:
        Trainer(tiny_cfg(Path(data), "--train.max_steps=1"), Path(out), log=lambda s: None).run()
        message = "trained"
    except Exception as e:  # noqa: BLE001  (the test reads what each rank was told)
        message = f"{type(e).__name__}: {e}"
    (Path(out).parent / f"rank{rank}.txt").write_text(message)


@pytest.mark.slow
def test_under_torchrun_every_rank_gets_the_refusal(data_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = lock_folder(out)
    try:
        assert spawn(_train_into_busy_folder, str(data_dir), str(out), timeout=300) == [0, 0]
    finally:
        lock.release()
    for rank in (0, 1):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert f"{out} is in use" in said and f"pid {os.getpid()}" in said and "\n" not in said, said
    assert os.listdir(out) == []


# ------------------------------------------------------------------------------------------ a full disk


def _fail_first_rng_save(monkeypatch, error: Exception) -> None:
    real, calls = ckpt_lib.save_file, {"n": 0}

    def save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_lib, "save_file", save_file)  # (the one-process writer's rng.safetensors)


def test_safetensors_full_disk_during_a_periodic_save_is_one_warning(data_dir, tmp_path, monkeypatch):
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    _fail_first_rng_save(monkeypatch, full)
    messages: list[str] = []
    out = tmp_path / "run"
    summary = Trainer(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2"), out,
                      log=messages.append).run()
    assert summary["step"] == 4
    warning = [m for m in messages if "could not save step 2" in m]
    assert len(warning) == 1 and "no space left on the device" in warning[0] and "\n" not in warning[0]
    assert [c.step for c in ckpt_lib.list_checkpoints(out)] == [4]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def test_a_safetensors_error_that_is_not_a_failed_write_is_raised(data_dir, tmp_path, monkeypatch):
    _fail_first_rng_save(monkeypatch, SafetensorError("Error while serializing: a programming error"))
    with pytest.raises(SafetensorError, match="a programming error"):
        run(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2"), tmp_path / "run")


def _limit_file_size(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
@pytest.mark.parametrize("background", ["false", "true"])
def test_a_real_write_failure_during_saves_is_one_line_each(data_dir, trained, tmp_path, background):
    """safetensors itself fails to write (the process may not write files past half the model's size): the periodic
    save is one warning and training goes on; the final save is one error line; no traceback, nothing left. The same
    with the periodic save written in the background (train.async_save=true: its failure is seen a step later)."""
    out = tmp_path / "run"
    limit = (trained / "step-4" / "model.safetensors").stat().st_size // 2
    r = _anyseek("train", "--out", out, f"--data.path={data_dir}", "--train.max_steps=4", "--train.save_every=2",
                 f"--train.async_save={background}", *TRAIN_ARGS, preexec_fn=_limit_file_size(limit))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "SafetensorError" not in r.stderr, r.stderr[-3000:]
    warning = [line for line in r.stdout.splitlines() if "could not save step 2" in line]
    assert len(warning) == 1 and "File too large" in warning[0] and "training goes on" in warning[0]
    error = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[")]  # (progress bars)
    assert len(error) == 1 and "could not save step 4" in error[0] and "File too large" in error[0], r.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 4 in steps  # training went on past the failed save
    assert not ckpt_lib.list_checkpoints(out) and not [p for p in out.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ damaged inputs


def test_generate_and_eval_refuse_flipped_bytes_naming_the_file(data_dir, trained, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    _flip(run_dir / "step-4" / "model.safetensors")
    for command in (["generate", run_dir / "step-4", "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"],
                    ["eval", run_dir / "step-4", "--data", data_dir, "--device", "cpu"]):
        rc, out, err = cli(capsys, *command)
        assert rc == 2 and out == "" and err.count("\n") == 1, err
        assert "step-4" in err and "model.safetensors" in err and "sha256" in err, err
    # the run folder: the damaged newest checkpoint is named and skipped, the previous one used
    rc, out, err = cli(capsys, "eval", run_dir, "--data", data_dir, "--device", "cpu")
    assert rc == 0 and json.loads(out)["checkpoint"] == str(run_dir / "step-2")
    assert "skipping checkpoint" in err and "step-4" in err and "model.safetensors" in err
    rc, out, _ = cli(capsys, "generate", run_dir / "step-2", "--prompt", "the", "--max-new-tokens", "2",
                     "--device", "cpu")
    assert rc == 0 and out.strip()


def test_init_from_a_damaged_step_folder_is_refused(data_dir, trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    _flip(run_dir / "step-4" / "model.safetensors")
    with pytest.raises(ckpt_lib.CheckpointDamaged, match=r"--init .*step-4: model\.safetensors does not match"):
        Trainer(tiny_cfg(data_dir, f"--train.init={run_dir / 'step-4'}", "--train.max_steps=1"), tmp_path / "new",
                log=lambda s: None)


def _train_sharded(data: str, out: str) -> None:
    Trainer(tiny_cfg(Path(data), "--train.max_steps=2"), Path(out), log=lambda s: None).run()


@pytest.mark.slow
def test_sharded_checkpoint_is_refused_with_the_export_command(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert spawn(_train_sharded, str(data_dir), str(out), world=1, timeout=300) == [0]
    step = out / "step-2"
    assert ckpt_lib.is_sharded(step)
    for command in (["generate", step, "--prompt", "the"], ["eval", step, "--data", data_dir],
                    ["generate", out, "--prompt", "the"]):
        rc, _, err = cli(capsys, *command)
        assert rc == 2 and err.count("\n") == 1 and "sharded" in err and f"anyseek export {step} --out" in err, err
    with pytest.raises(CheckpointError, match=f"--init {step}: a sharded checkpoint.*anyseek export"):
        Trainer(tiny_cfg(data_dir, f"--train.init={step}", "--train.max_steps=1"), tmp_path / "new",
                log=lambda s: None)
    # what the message says to do works: the exported folder generates
    assert cli(capsys, "export", step, "--out", tmp_path / "hf")[0] == 0
    assert (tmp_path / "hf" / EXPORT_JSON).is_file()
    rc, text, err = cli(capsys, "generate", tmp_path / "hf", "--prompt", "the", "--max-new-tokens", "2")
    assert rc == 0 and text.strip(), err


def test_eval_refuses_data_of_another_tokenizer_naming_both(data_dir, trained, tmp_path, capsys):
    from anyseek.data.prepare import prepare

    step = trained / "step-4"
    docs = tmp_path / "other.jsonl"
    docs.write_text("".join(json.dumps({"text": f"Another text {i}, in other words entirely."}) + "\n"
                            for i in range(60)))
    other = tmp_path / "other"
    prepare(source=str(docs), out=other, vocab_size=300, val_fraction=0.2, progress=False)
    rc, out, err = cli(capsys, "eval", step, "--data", other, "--device", "cpu")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "another tokenizer" in err and str(other) in err and str(step / "tokenizer.json") in err
    # the same text prepared with the checkpoint's tokenizer: evaluated
    same = tmp_path / "same"
    prepare(source=str(docs), out=same, tokenizer=step, val_fraction=0.2, progress=False)
    assert cli(capsys, "eval", step, "--data", same, "--device", "cpu")[0] == 0
    # the same vocabulary in another file (saved again, other bytes): evaluated
    copy = tmp_path / "copy"
    shutil.copytree(step, copy, ignore=shutil.ignore_patterns("checkpoint.json"))
    (copy / "tokenizer.json").write_text(json.dumps(json.loads((step / "tokenizer.json").read_text()), indent=4))
    assert cli(capsys, "eval", copy, "--data", data_dir, "--device", "cpu")[0] == 0
    # no tokenizer.json beside the model: a warning, not a silent pass
    (copy / "tokenizer.json").unlink()
    rc, _, err = cli(capsys, "eval", copy, "--data", other, "--device", "cpu")
    assert rc == 0 and "warning" in err and "no tokenizer.json" in err


# ------------------------------------------------------------------------------------------ --init identity


def _save(model, folder: Path) -> Path:
    hf.save_pretrained(model, folder)
    return folder


def _largest_tensor_start(file: Path) -> int:
    """Where the data of the file's largest tensor begins (far from the middle bytes the sampled hash reads)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    begin, _ = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    return 8 + n + begin


def test_init_hash_covers_every_byte_and_older_references_still_match(tmp_path):
    folder = _save(_tiny_model(), tmp_path / "m")
    ref = identity.reference(folder)
    old_style = {"path": str(folder.resolve()), "sha256": identity.sampled_hash(folder)}  # recorded before
    assert identity.same_content(old_style, ref) and identity.same_content(ref, identity.reference(folder))
    sampled = identity.sampled_hash(folder)
    _flip(folder / "model.safetensors", offset=_largest_tensor_start(folder / "model.safetensors"), n=4)
    assert identity.sampled_hash(folder) == sampled  # what the sampled hash could not see
    assert identity.content_hash(folder) != ref["sha256"] and not identity.same_content(ref, identity.reference(folder))
    other = _save(DeepSeekV3(ModelConfig.from_name("tiny", vocab_size=300, num_hidden_layers=2)), tmp_path / "o")
    assert not identity.same_content(old_style, identity.reference(other))


def test_hub_cache_file_unlike_its_blob_is_refused(tmp_path):
    snap = _save(_tiny_model(), tmp_path / "models--x" / "snapshots" / "abc")
    blobs = tmp_path / "models--x" / "blobs"
    blobs.mkdir()
    weights = snap / "model.safetensors"
    blob = blobs / ckpt_lib.file_sha256(weights)
    weights.rename(blob)
    weights.symlink_to(os.path.relpath(blob, snap))
    identity.reference(snap)  # intact
    _flip(blob)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: its content .* is damaged; download it again"):
        identity.reference(snap)


def test_large_files_are_hashed_once_until_they_change(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYSEEK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(identity, "CACHE_MIN_BYTES", 1)
    folder = _save(_tiny_model(), tmp_path / "m")
    first = identity.content_hash(folder)
    assert (tmp_path / "cache" / identity.CACHE_FILE).is_file()
    read: list[str] = []
    real = identity._sha256
    monkeypatch.setattr(identity, "_sha256", lambda p: read.append(p.name) or real(p))
    assert identity.content_hash(folder) == first and read == []
    weights = folder / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    _flip(weights)
    os.utime(weights, ns=(stamp + 10**9, stamp + 10**9))
    assert identity.content_hash(folder) != first and read == ["model.safetensors"]


def test_init_from_a_step_folder_reads_its_files_once(trained, monkeypatch):
    from anyseek.train.init import InitSource

    step = trained / "step-4"
    want = identity.content_hash(step)
    read: list[str] = []
    real = identity._sha256
    monkeypatch.setattr(identity, "_sha256", lambda p: read.append(p.name) or real(p))
    ref = InitSource.open(step).reference()  # verified against checkpoint.json: those digests are the identity's
    assert ref["sha256"] == want and read == []


def test_a_lora_base_damaged_in_place_is_refused_by_resume_and_export(data_dir, trained, tmp_path, capsys):
    """Bytes flipped where the older sampled hash did not look: the adapters' base is no longer what they were
    trained on, and both --resume and the merged export say so instead of computing another model."""
    from anyseek.train.resume import ResumeMismatch

    base = tmp_path / "base"  # a plain model folder (no checkpoint.json): only the identity can tell
    shutil.copytree(trained / "step-4", base, ignore=shutil.ignore_patterns("checkpoint.json", "optimizer*", "rng*",
                                                                          "train_state.json"))
    out = tmp_path / "lora"
    lora = ("--train.lora_rank=2", f"--train.init={base}")
    run(tiny_cfg(data_dir, "--train.max_steps=1", *lora), out)
    _flip(base / "model.safetensors", offset=_largest_tensor_start(base / "model.safetensors"), n=4)
    with pytest.raises(ResumeMismatch, match=r"init content \(sha256\)"):
        run(tiny_cfg(data_dir, "--train.max_steps=2", *lora), out, resume=True)
    rc, _, err = cli(capsys, "export", out, "--out", tmp_path / "merged")
    assert rc == 2 and "it has changed since" in err and not (tmp_path / "merged").exists()
