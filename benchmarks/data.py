"""Data pipeline benchmark: prints one markdown table.

    python benchmarks/data.py [--scale 8] [--workers N]

Rows, all on the same text (the built-in Wikipedia sample, repeated `--scale` times into a jsonl file):
  - raw `tokenizers` batch encoding of the texts already in memory (encode_batch and encode_batch_fast): the peer;
  - `prepare` with a given tokenizer (read jsonl + split + encode + write shards): compared with encode_batch;
  - `prepare` training its BPE first: compared with raw `train_from_iterator` + encode_batch on the texts in memory;
  - `prepare` of a MediaWiki XML dump made from the same text with markup added (cleaning in a process pool);
  - PackedLoader packing on one core (tokens/s), for two batch shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path


def sample_texts() -> list[str]:
    from anyseek.data.sources import wiki_sample_path

    data = json.loads(wiki_sample_path().read_text(encoding="utf-8"))
    return [v["extract"].strip() for v in data.values()]


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def write_dump(path: Path, texts: list[str]) -> int:
    from xml.sax.saxutils import escape

    with open(path, "w", encoding="utf-8") as f:
        f.write('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/">\n')
        for i, t in enumerate(texts):
            first, _, rest = t.partition(". ")
            wiki = (f"{{{{Short description|Article {i}}}}}\n{{{{Infobox|a=1|b={{{{convert|3|km}}}}}}}}\n'''{first}'''."
                    f"<ref>{{{{cite web|url=https://x.example/{i}}}}}</ref> [[Link|{rest}]]\n[[Category:C{i % 50}]]")  # fmt: skip
            f.write(
                f"<page><title>Article {i}</title><ns>0</ns><revision><text>{escape(wiki)}</text></revision></page>\n"
            )
        f.write("</mediawiki>\n")
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=8, help="repeat the sample this many times (default 8, ~39 MB)")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions; each row reports its best")
    args = ap.parse_args()
    import numpy as np
    import tokenizers
    import torch

    from anyseek import __version__
    from anyseek.data.loader import PackedLoader
    from anyseek.data.prepare import prepare
    from anyseek.data.tokenizer import batched, load_tokenizer, train_bpe

    texts = sample_texts() * args.scale
    mb = sum(len(t.encode()) for t in texts) / 1e6
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "sample.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
        prepare(str(src), tmp / "full", 4096, workers=args.workers, progress=False)  # the tokenizer for the peers
        tok = load_tokenizer(tmp / "full")
        batches = list(batched(texts, 1000))  # the peer's best use: calls of 1000 documents, not one giant call
        runs = {
            "raw": lambda: [tok.encode_batch(b, add_special_tokens=False) for b in batches],
            "fast": lambda: [tok.encode_batch_fast(b, add_special_tokens=False) for b in batches],
            "given": lambda: prepare(str(src), tmp / "given", tokenizer=tmp / "full" / "tokenizer",
                                     workers=args.workers, progress=False, force=True),
            "train": lambda: train_bpe(iter(batches), 4096),
            "full": lambda: prepare(str(src), tmp / "full", 4096, workers=args.workers, progress=False, force=True),
        }  # fmt: skip
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(args.repeat):  # interleaved, so that a busy moment hits every row alike
            for name, fn in runs.items():
                best[name] = min(best[name], best_of(fn, repeat=1))
        t_raw, t_fast, t_given, t_train, t_full = (best[k] for k in ("raw", "fast", "given", "train", "full"))
        rows.append(("tokenizers encode_batch, 1000 docs a call (peer, in memory)", mb, t_raw, t_raw))
        rows.append(("tokenizers encode_batch_fast, 1000 docs a call (in memory)", mb, t_fast, t_raw))
        rows.append(("anyseek prepare, given tokenizer (jsonl -> shards)", mb, t_given, t_raw))
        rows.append(("tokenizers BPE training + encode_batch (peer, in memory)", mb, t_train + t_raw, t_train + t_raw))
        rows.append(("anyseek prepare, BPE 4096 trained (2 passes)", mb, t_full, t_train + t_raw))
        dump_texts = texts[: max(len(texts) // 4, 1)]
        dump_mb = write_dump(tmp / "dump.xml", dump_texts) / 1e6
        t_xml = best_of(lambda: prepare(str(tmp / "dump.xml"), tmp / "xml", tokenizer=tmp / "full" / "tokenizer",
                                        workers=args.workers, progress=False, force=True), repeat=args.repeat)  # fmt: skip
        rows.append(("anyseek prepare, XML dump (wikitext cleaning)", dump_mb, t_xml, None))

        torch.set_num_threads(1)
        loader_rows = []
        for tpb, seqlen in ((65536, 4096), (16384, 512)):
            loader = PackedLoader(tmp / "given", tokens_per_batch=tpb, max_seqlen=seqlen)
            it = iter(loader)
            for _ in range(3):
                next(it)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 2.0:
                n += next(it).num_tokens
            loader_rows.append((tpb, seqlen, n / (time.perf_counter() - t0)))

    print(f"anyseek {__version__} data benchmark, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"tokenizers {tokenizers.__version__}, numpy {np.__version__}, torch {torch.__version__}")  # fmt: skip
    print(f"text: the Wikipedia sample x{args.scale} ({len(texts):,} documents, {mb:.1f} MB), vocab 4096\n")
    print("| what | MB | s | MB/s | vs its peer |")
    print("|---|---:|---:|---:|---:|")
    for name, size, t, ref in rows:
        ratio = f"{ref / t:.0%}" if ref is not None else "-"
        print(f"| {name} | {size:.1f} | {t:.2f} | {size / t:.1f} | {ratio} |")
    print("\n| PackedLoader, 1 core | tokens/s |")
    print("|---|---:|")
    for tpb, seqlen, rate in loader_rows:
        print(f"| tokens_per_batch={tpb}, max_seqlen={seqlen} | {rate / 1e6:.1f} M |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
