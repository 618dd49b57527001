"""`hf:NAME[:CONFIG]` sources: a Hugging Face dataset, streamed with `datasets` (the `data` extra).

Offline it fails at once: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no TCP connection to the Hub within 3 s.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

from anyseek.data.readers import Skip, Source, SourceError, pick_field, read_record

_TRUE = {"1", "true", "yes", "on"}


def parse_hf_spec(spec: str) -> tuple[str, str | None]:
    """Split "hf:NAME[:CONFIG]", e.g. hf:wikimedia/wikipedia:20231101.en -> (wikimedia/wikipedia, 20231101.en)."""
    name, _, config = spec.removeprefix("hf:").partition(":")
    if not name.strip():
        raise SourceError(f"{spec!r}: expected hf:NAME[:CONFIG], e.g. hf:wikimedia/wikipedia:20231101.en")
    return name.strip(), (config.strip() or None)


def check_online(spec: str, timeout_s: float = 3.0) -> None:
    """Raise SourceError at once when the Hub cannot be reached."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            raise SourceError(
                f"{spec}: {var} is set, and hf: sources stream from the Hugging Face Hub. "
                "Download the dataset's parquet files elsewhere and pass their folder as --source."
            )
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise SourceError(
            f"{spec}: cannot reach {host}:{port} ({e}); this machine looks offline. hf: sources stream from the "
            "Hub; download the dataset's parquet files elsewhere and pass their folder as --source."
        ) from None


def hf_source(spec: str, text_column: str | None, split: str = "train") -> Source:
    name, config = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError as e:
        raise SourceError(f'{spec}: hf: sources need the datasets library: pip install "anyseek[data]"') from e
    check_online(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001  datasets raises many types (not found, gated, bad config): all are fatal here
        raise SourceError(f"{spec}: cannot open the dataset ({type(e).__name__}: {e})") from None
    names = list(ds.column_names or [])
    if names:
        column = pick_field(names, text_column, spec)
        if column not in names:
            raise SourceError(f"{spec}: no column {column!r}; columns are {names}")
    else:
        column = text_column

    def items() -> Iterator[str | Skip]:
        col = column
        for i, rec in enumerate(ds):
            doc, col = read_record(rec, col, f"{spec}:row {i}")
            yield doc

    description = {"kind": "hf", "dataset": name, "config": config, "split": split, "text_column": column}
    fingerprint = {"kind": "hf", "dataset": name, "config": config, "split": split, "text_column": column}
    return Source(spec, description, fingerprint, items)
