"""Folders on disk that must never be seen half-written, nor written by two runs at once: one error type, fsync,
one atomic folder writer, one folder lock.

    with atomic_folder(Path("runs/tiny/step-500")) as tmp:
        write_things_into(tmp)          # a crash here leaves no trace at the final path
    # here step-500 is complete: fsynced, renamed into place, the parent folder fsynced

    lock = lock_folder(Path("runs/tiny"))   # FolderInUse when another live process holds it
    ...                                      # a crash or kill -9 releases it (the OS drops the process's locks)
    lock.release()

Used by both the Hugging Face writer (`anyseek.hf.save_pretrained`) and training checkpoints
(`anyseek.checkpoint.folder`); neither nests the other's staging. A write that fails inside `atomic_folder` reaches
the caller as OSError, whichever library wrote (`os_error`: safetensors raises its own type for a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError


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
    the block removes the staging folder and re-raises; a failed write (`os_error`: a full disk reported by
    safetensors included) as OSError. An existing `final` is replaced only once the new one is complete: it is
    renamed aside, the new one renamed in, then the old one deleted (so callers check first that `final` holds
    nothing a user would miss).
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        failed = os_error(e)
        if failed is None or failed is e:
            raise
        raise failed from e


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error(e: BaseException) -> OSError | None:
    """The OSError that `e` is, or None: `e` itself, or safetensors' SafetensorError for a failed write (full disk,
    file too large, read-only folder: "Error while serializing: I/O error: No space left on device (os error 28)")
    as an OSError with that errno. Its other errors (a tensor it cannot write: a programming error) are not."""
    if isinstance(e, OSError):
        return e
    if not isinstance(e, SafetensorError):
        return None
    text = str(e)
    if "I/O error" not in text and "IoError" not in text:
        return None
    code = _OS_ERROR.search(text)
    return OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else OSError(errno.EIO, text)


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


# ---------------------------------------------------------------- one process per folder

LOCK_FILE = ".anyseek.lock"
_WINDOWS_BYTE = 1 << 30  # the byte msvcrt.locking locks: far past the text, which others must still read


class FolderInUse(RuntimeError):
    """Another live process holds the folder's lock; the message names the folder and that process."""


class FolderLock:
    """A lock on `folder` held for this object's life (`lock_folder`), released by `release()` or by the death of the
    process: an advisory lock on folder/.anyseek.lock (flock on POSIX, msvcrt.locking on Windows), which the OS
    drops with the process, so a crashed or `kill -9`ed holder never leaves the folder stuck. The file holds the
    holder's pid, host and start time, for the message another process gets. `held` is False on a filesystem
    without locks (some network and FUSE mounts): nothing then stops a second run, and the caller says so."""

    def __init__(self, folder: Path, fd: int | None):
        self.folder, self.path, self._fd = folder, folder / LOCK_FILE, fd
        self.held = fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        if os.name != "nt":  # removed while still held: whoever opened it meanwhile sees the unlink and retries
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        else:
            import msvcrt

            with contextlib.suppress(OSError):
                os.lseek(self._fd, _WINDOWS_BYTE, os.SEEK_SET)
                msvcrt.locking(self._fd, msvcrt.LK_UNLCK, 1)
        os.close(self._fd)  # releases the lock
        self._fd = None


def lock_folder(folder: Path) -> FolderLock:
    """Take `folder`'s lock (the folder must exist), or raise FolderInUse naming the process that holds it."""
    path = Path(folder) / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _try_lock(fd)
        if locked is None:  # no locks here
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return FolderLock(Path(folder), None)
        if not locked:
            os.close(fd)
            raise FolderInUse(f"{folder} is in use by another anyseek run ({_holder(path)}); wait for it to end, or "
                              "choose another folder")
        try:  # a holder that released between our open and our lock removed the file we locked: lock the new one
            if os.name == "nt" or os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(me).encode())  # (at offset 0: nothing was read or written through fd yet)
    return FolderLock(Path(folder), fd)


def _try_lock(fd: int) -> bool | None:
    """Whether the lock was taken (False: another holds it; None: this filesystem has no locks)."""
    try:
        import fcntl
    except ImportError:  # Windows (msvcrt's locks are mandatory: lock a byte no reader reads)
        import msvcrt

        os.lseek(fd, _WINDOWS_BYTE, os.SEEK_SET)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    return True


def _holder(path: Path) -> str:
    try:
        who = json.loads(path.read_text(encoding="utf-8", errors="replace")[:1000])
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said who it is yet"
