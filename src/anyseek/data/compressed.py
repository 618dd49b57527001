"""Open a data file for reading bytes, decompressing by its suffix: .bz2 (multistream too), .gz, .xz."""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from pathlib import Path


def open_binary(path: Path):
    """Open `path` for reading bytes, decompressing .bz2, .gz and .xz."""
    suffix = path.suffix.lower()
    if suffix == ".bz2":
        return bz2.open(path, "rb")
    if suffix == ".gz":
        return gzip.open(path, "rb")
    if suffix == ".xz":
        return lzma.open(path, "rb")
    return open(path, "rb")


# What a damaged compressed file raises while it is read (not when it is opened: a missing file stays an error).
DAMAGE_ERRORS = (EOFError, gzip.BadGzipFile, lzma.LZMAError, zlib.error, OSError)


def damage_reason(path: Path, e: BaseException) -> str:
    """A short description of why a compressed file could not be read to its end."""
    if isinstance(e, EOFError):
        return f"{path}: truncated ({path.suffix} stream ends early)"
    if isinstance(e, gzip.BadGzipFile):
        return f"{path}: not a gzip file ({e})"
    return f"{path}: damaged {path.suffix} data ({e})"


def read_bytes(path: Path, chunk: int = 1 << 20) -> tuple[bytes, str | None]:
    """The whole (decompressed) file, or what could be read of it and why the rest could not."""
    parts: list[bytes] = []
    with open_binary(path) as f:
        read = getattr(f, "read1", f.read)  # read1: the data before a damaged point still comes out
        try:
            while data := read(chunk):
                parts.append(data)
        except DAMAGE_ERRORS as e:
            return b"".join(parts), damage_reason(path, e)
    return b"".join(parts), None
