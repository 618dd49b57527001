"""Checks a run makes before its first step, so that bad data or a bad output folder stops it at once with a message
that names the file and the fix, never at step 250 without a checkpoint."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from anyseek.data.shards import MANIFEST, missing_files
from anyseek.storage import FolderLock, lock_folder, recover_staging

REPREPARE = "re-prepare it: delete the folder and run `anyseek prepare --source ... --out {dir}` again"


class DataError(ValueError):
    """Prepared data that cannot be trained on; the message names the file and how to re-prepare."""


def check_prepared(data_dir: Path, manifest: dict, log: Callable[[str], None]) -> bool:
    """Raise DataError for a malformed manifest, a missing or truncated shard, or no training documents.
    Returns whether the folder has validation documents (when not, says so: the run trains without validation)."""
    fix = REPREPARE.format(dir=data_dir)
    path = data_dir / MANIFEST
    try:
        splits = manifest["splits"]
        int(manifest["vocab_size"])
        for split in splits.values():
            for shard in split["shards"]:
                shard["tokens"], shard["offsets"], int(shard["num_tokens"]), int(shard["documents"])
        bad = missing_files(data_dir, manifest)
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path}: malformed manifest (missing or bad {e}); {fix}") from None
    if bad:
        raise DataError(f"{bad[0]}: missing or truncated shard"
                        f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; {fix}")
    if int(splits.get("train", {}).get("documents", 0)) == 0:
        raise DataError(f"{path}: the train split holds 0 documents; nothing to train on ({fix} with more text)")
    if int(splits.get("val", {}).get("documents", 0)) == 0:
        log(f"note: {data_dir} has no validation documents: training runs without validation "
            "(prepare with a larger --val-fraction to get some)")
        return False
    return True


def check_vocab(data_dir: Path, manifest: dict, model_vocab: int) -> None:
    """The model must have a row for every token id the data holds."""
    data_vocab = int(manifest["vocab_size"])
    if data_vocab > model_vocab:
        raise DataError(
            f"{data_dir}: the tokenizer and data use {data_vocab} token ids but the model has vocab_size "
            f"{model_vocab}; drop --model.vocab_size (it then follows the data) or set it to at least {data_vocab}"
        )


def claim_out_dir(out_dir: Path, log: Callable[[str], None]) -> FolderLock:
    """Make `out_dir` and take it for this run (`anyseek.storage.lock_folder`: FolderInUse, naming the other run's pid
    and host, when a live run holds it; a crashed or killed run's lock is gone with it), then `check_writable`.
    Release the returned lock when the run ends."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lock = lock_folder(out_dir)
    except OSError as e:
        raise OSError(e.errno, f"{out_dir} is not writable: {describe_os_error(e)}") from None
    if not lock.held:
        log(f"warning: {out_dir} is on a filesystem without file locks: a second run into it would not be stopped")
    try:
        check_writable(out_dir, log)
    except BaseException:
        lock.release()
        raise
    return lock


def check_writable(out_dir: Path, log: Callable[[str], None]) -> None:
    """Make `out_dir`, clean up what interrupted saves left there (only the run holding the folder may: a live
    run's staging folder is not debris), and make sure a file can be written in it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for line in recover_staging(out_dir):
            log(f"note: {out_dir}: {line}")
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"{out_dir} is not writable: {describe_os_error(e)}") from None


def describe_os_error(e: OSError) -> str:
    """One line for a failed write: what happened and what to do."""
    if e.errno == errno.ENOSPC:
        return "no space left on the device (free some space or choose another --out)"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{e.strerror or 'permission denied'} (a read-only or protected folder: choose another --out)"
    return f"{e.strerror or e}"
