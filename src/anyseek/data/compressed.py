"""Open a data file for reading bytes, decompressing by its suffix: .bz2 (multistream too), .gz, .xz."""

from __future__ import annotations

import bz2
import gzip
import lzma
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
