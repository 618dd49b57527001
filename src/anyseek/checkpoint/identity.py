"""What a model folder is, in a few bytes: its path and a content hash, recorded by runs that start from it
(`--init`: train_state.json; LoRA checkpoints: lora.json) and compared on `--resume` and when adapters are loaded."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path


def reference(folder: Path) -> dict[str, str]:
    """{"path": the folder, resolved, "sha256": `content_hash`}."""
    return {"path": str(Path(folder).resolve()), "sha256": content_hash(Path(folder))}


SAMPLE_BYTES = 64  # of every tensor's data, from its middle, hashed with the headers


def content_hash(folder: Path) -> str:
    """sha256 over config.json, the weights index and every safetensors file's header and size (names, shapes,
    dtypes, offsets) plus SAMPLE_BYTES from the middle of every tensor: two checkpoints of one architecture (another
    step, another fine-tune, a merged LoRA) differ, without reading the whole model (one small read per tensor)."""
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
