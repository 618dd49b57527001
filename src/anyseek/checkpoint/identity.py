"""What a model folder is, in a few bytes: its path and a hash of its content, recorded by runs that start from it
(`--init`: train_state.json; LoRA checkpoints: lora.json) and compared on `--resume` and when adapters are loaded.

The hash covers every byte of config.json, the weights index and the safetensors files: one flipped bit gives another
hash, so the hash a run prints and records identifies the weights it started from, and a base that changed since
(damaged, replaced) is found on `--resume` and when adapters are merged. Reading a large model costs time (sha256 at
~1 GB/s per file, the files in parallel: ~30 s for 31 GB on one disk), so the digest of every large file is cached in
$ANYSEEK_CACHE/file-sha256.json under (path, size, mtime, inode): once per model and machine. The cache trusts a file
whose size and mtime did not change; a step-N folder given to `--init` is also checked against its checkpoint.json.

A file of a Hugging Face hub cache (a symlink into `blobs/`, the blob named by the sha256 of its content) is checked
against that name: a damaged download is an error, never a model that quietly computes something else.

References recorded before every byte was hashed (no "hashed" key: config, headers and 64 bytes of every tensor) are
compared with that sampled hash of the folder (`same_content`), so their runs still resume and their adapters load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from anyseek.data.sources import default_cache_dir
from anyseek.storage import CheckpointError

HASHED = "all"  # a reference's "hashed": every byte of its files (absent: the sampled hash of older versions)
CACHE_FILE = "file-sha256.json"
CACHE_MIN_BYTES = 64 << 20  # files below this are hashed again each time (a few ms), never cached
_CHUNK = 1 << 22
_BLOB = re.compile(r"[0-9a-f]{64}")


def reference(folder: Path, log: Callable[[str], None] | None = None,
              known: dict[str, str] | None = None) -> dict[str, str]:
    """{"path": the folder, resolved, "sha256": `content_hash`, "hashed": "all"}; `log` hears of a long hash."""
    return {"path": str(Path(folder).resolve()), "sha256": content_hash(Path(folder), log, known), "hashed": HASHED}


def content_hash(folder: Path, log: Callable[[str], None] | None = None, known: dict[str, str] | None = None) -> str:
    """sha256 over the names and sha256 of config.json, the weights index and every safetensors file in `folder`.
    known: {file name: sha256} the caller has just checked (a verified step-N's checkpoint.json): not read again.
    Raises CheckpointError for a hub-cache file whose content is not its blob's name (a damaged download)."""
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors.index.json")),
             *sorted(folder.glob("*.safetensors"))]
    cache = _Cache()
    for f in files:
        if (known or {}).get(f.name):
            cache.put(f, known[f.name], remember=False)
    todo = [f for f in files if cache.get(f) is None]
    size = sum(f.stat().st_size for f in todo)
    if log is not None and size > 1 << 30:
        log(f"init: hashing {size / 1e9:.1f} GB in {folder} (every byte, to identify the weights; cached for next "
            f"time in {cache.path})")
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(len(todo), 1))) as pool:
        digests = dict(zip(todo, pool.map(_sha256, todo)))  # hashlib releases the GIL: the files in parallel
    h = hashlib.sha256()
    for f in files:
        digest = digests.get(f) or cache.get(f)
        _check_blob(f, digest)
        if f in digests:
            cache.put(f, digest)
        h.update(f.name.encode() + b"\0" + digest.encode() + b"\n")
    cache.save()
    return h.hexdigest()


def same_content(saved: dict | None, now: dict | None) -> bool:
    """Whether the folder of the reference `now` holds what the reference `saved` recorded (None: no folder). A
    reference from before full hashes is compared with the sampled hash of `now`'s folder."""
    if saved is None or now is None:
        return saved is now
    if saved.get("hashed") == now.get("hashed"):
        return saved.get("sha256") == now.get("sha256")
    if saved.get("hashed") is None and Path(now["path"]).is_dir():
        return saved.get("sha256") == sampled_hash(Path(now["path"]))
    return False


SAMPLE_BYTES = 64  # of every tensor's data, from its middle, hashed with the headers (`sampled_hash`)


def sampled_hash(folder: Path) -> str:
    """The content hash of references recorded before full hashes: sha256 over config.json, the weights index and
    every safetensors file's header and size plus SAMPLE_BYTES from the middle of every tensor."""
    h = hashlib.sha256()
    for f in [folder / "config.json", *sorted(folder.glob("*.safetensors.index.json"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            header = fh.read(min(n, 100 << 20))
            h.update(f.name.encode() + b"\0" + head + header + str(f.stat().st_size).encode())
            try:
                spans = sorted(tuple(v["data_offsets"]) for k, v in json.loads(header).items() if k != "__metadata__")
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # not a readable header: hashed as bytes above, the loader will say what is wrong
            for begin, end in spans:
                fh.seek(8 + n + (begin + end - SAMPLE_BYTES) // 2 if end - begin > SAMPLE_BYTES else 8 + n + begin)
                h.update(fh.read(min(SAMPLE_BYTES, end - begin)))
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_blob(path: Path, digest: str) -> None:
    """A hub-cache file (snapshots/REV/NAME -> ../../blobs/SHA256) must hold what its blob is named after."""
    if not path.is_symlink():
        return
    blob = path.resolve()
    if blob.parent.name == "blobs" and _BLOB.fullmatch(blob.name) and blob.name != digest:
        raise CheckpointError(f"{path}: its content (sha256 {digest[:12]}) is not what the Hugging Face cache "
                              f"downloaded (blob {blob.name[:12]}): the file is damaged; download it again")


class _Cache:
    """$ANYSEEK_CACHE/file-sha256.json: {resolved path: [size, mtime_ns, inode, sha256]} of files of at least
    CACHE_MIN_BYTES. Best effort: an unreadable or unwritable cache is no cache."""

    def __init__(self):

        self.path = default_cache_dir() / CACHE_FILE
        self.entries: dict[str, list] = {}
        self.known: dict[str, str] = {}  # this call's digests given by the caller, never written to the cache
        self.changed = False
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(self.path.read_text())
            self.entries = loaded if isinstance(loaded, dict) else {}

    @staticmethod
    def _key(f: Path) -> tuple[str, list]:
        st = f.stat()
        return str(f.resolve()), [st.st_size, st.st_mtime_ns, st.st_ino]

    def get(self, f: Path) -> str | None:
        key, stamp = self._key(f)
        if key in self.known:
            return self.known[key]
        hit = self.entries.get(key)
        return hit[3] if isinstance(hit, list) and len(hit) == 4 and hit[:3] == stamp else None

    def put(self, f: Path, digest: str, remember: bool = True) -> None:
        key, stamp = self._key(f)
        if not remember:
            self.known[key] = digest
        elif stamp[0] >= CACHE_MIN_BYTES:
            self.entries[key] = [*stamp, digest]
            self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        tmp = self.path.with_name(f".{CACHE_FILE}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)  # atomic: a reader sees the old cache or the new one
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
