"""Folders on disk that must never be seen half-written: one error type, fsync, one atomic folder writer.

    with atomic_folder(Path("runs/tiny/step-500")) as tmp:
        write_things_into(tmp)          # a crash here leaves no trace at the final path
    # here step-500 is complete: fsynced, renamed into place, the parent folder fsynced

Used by both the Hugging Face writer (`anyseek.hf.save_pretrained`) and training checkpoints
(`anyseek.checkpoint.folder`); neither nests the other's staging.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint or model folder that is missing pieces or cannot be read; the message names the file."""


def fsync_dir(folder: Path) -> None:
    """Flush the folder's entries so a rename after it is durable (no-op where unsupported, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file directly in `folder`, then the folder itself."""
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def staging_name(final: Path) -> Path:
    """The hidden temporary folder a write of `final` is assembled in: `.NAME.tmp-PID` beside it."""
    return final.parent / f".{final.name}.tmp-{os.getpid()}"


@contextlib.contextmanager
def atomic_folder(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside `final`; when the block succeeds, make it `final` atomically.

    A crash or kill at any moment leaves either the old `final` (or none) or the complete new one. An exception in
    the block removes the staging folder and re-raises. An existing `final` is replaced only once the new one is
    complete: it is renamed aside, the new one renamed in, then the old one deleted.
    """
    final = Path(final)
    if final.exists() and not final.is_dir():
        raise FileExistsError(f"{final}: exists and is not a folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_name(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_staging(folder: Path) -> list[str]:
    """Clean up after writers of `folder`'s entries that died mid-way; return one line per action taken.

    `.NAME.tmp-PID` of a dead process: removed (an unfinished write). `.NAME.old-PID`: the previous NAME, set aside
    just before the new one was renamed in; if NAME is missing it is put back, else removed.
    """
    actions: list[str] = []
    if not folder.is_dir():
        return actions
    for p in sorted(folder.glob(".*.tmp-*")):
        if p.is_dir() and not _pid_alive(p.name.rsplit("-", 1)[-1]):
            shutil.rmtree(p, ignore_errors=True)
            actions.append(f"removed {p.name} (an unfinished write)")
    for p in sorted(folder.glob(".*.old-*")):
        if not p.is_dir() or _pid_alive(p.name.rsplit("-", 1)[-1]):
            continue
        name = p.name[1:].rsplit(".old-", 1)[0]
        if (folder / name).exists():
            shutil.rmtree(p, ignore_errors=True)
            actions.append(f"removed {p.name} (replaced by {name})")
        else:
            os.rename(p, folder / name)
            actions.append(f"restored {name} from {p.name} (a replacement was interrupted)")
    return actions


def _pid_alive(pid_text: str) -> bool:
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
