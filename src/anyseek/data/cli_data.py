"""`anyseek data inspect DIR`: the manifest's figures and a few decoded documents (see docs/data.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p = sub.add_parser("inspect", help="print a prepared folder's figures and a few decoded documents")
    p.add_argument("dir", help="a folder written by `anyseek prepare`")
    p.add_argument("--split", default="train", help="split to show documents from (default: train)")
    p.add_argument("--docs", type=int, default=3, help="how many documents to decode (default 3)")
    p.add_argument("--max-chars", type=int, default=600, help="cut each decoded document after this many chars")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON and nothing else")
    parser.set_defaults(_data_parser=parser)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    if getattr(args, "data_command", None) != "inspect":
        args._data_parser.print_help()
        return 2
    from anyseek.data.shards import read_manifest

    try:
        manifest = read_manifest(args.dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"anyseek data inspect: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2, ensure_ascii=False))
        return 0
    print(summary(Path(args.dir), manifest))
    print(documents(Path(args.dir), manifest, args.split, args.docs, args.max_chars))
    return 0


def summary(data_dir: Path, m: dict) -> str:
    from anyseek.data.shards import missing_files

    src = m["source"]
    what = ", ".join(f"{k}={v}" for k, v in src.items() if k not in ("first_files",))
    tok = m["tokenizer"]
    specials = ", ".join(f"{k} {m[k + '_token']!r}={m[k + '_token_id']}" for k in ("eos", "bos", "pad"))
    lines = [
        f"{data_dir}",
        f"  source     {what}",
        f"  created    {m['created_at']} by {m['created_by']} in {m.get('elapsed_s', '?')} s",
        f"  tokenizer  {tok.get('kind')}, vocab {m['vocab_size']:,}, {specials}",
        f"             sha256 {m['tokenizer_sha256'][:16]}…, tokens stored as {m['dtype']}",
        f"  split  {'documents':>12} {'tokens':>15} {'text MB':>10} {'tokens/doc':>11} {'bytes/token':>12} shards",
    ]
    for split, info in m["splits"].items():
        docs, toks, nbytes = info["documents"], info["tokens"], m["text_bytes"].get(split, 0)
        lines.append(
            f"  {split:<5}  {docs:>12,} {toks:>15,} {nbytes / 1e6:>10.2f} {toks / max(docs, 1):>11.1f} "
            f"{nbytes / max(toks - docs, 1):>12.2f} {len(info['shards'])}"
        )
    skipped = m.get("skipped") or {}
    lines.append(f"  skipped    {sum(skipped.values()):,} inputs" + (":" if skipped else ""))
    lines += [f"    {reason:<24} {count:,}" for reason, count in sorted(skipped.items(), key=lambda kv: -kv[1])]
    for ex in m.get("skipped_examples", [])[:5]:
        lines.append(f"    e.g. {ex['reason']}: {ex['where']}")
    problems = missing_files(data_dir, m)
    if problems:
        lines.append(f"  WARNING: {len(problems)} shard files missing or truncated, e.g. {problems[0]}")
    return "\n".join(lines)


def documents(data_dir: Path, m: dict, split: str, count: int, max_chars: int) -> str:
    from anyseek.data.shards import open_split
    from anyseek.data.tokenizer import load_tokenizer

    if count <= 0 or m["splits"].get(split, {}).get("documents", 0) == 0:
        return ""
    data = open_split(data_dir, split, m)
    lens = data.doc_len
    p = np.percentile(lens, [50, 90, 99])
    stats = f"min {lens.min():,}, median {p[0]:,.0f}, p90 {p[1]:,.0f}, p99 {p[2]:,.0f}, max {lens.max():,}"
    lines = [f"  {split} document length in tokens: {stats}"]
    tok = load_tokenizer(data_dir)
    picks = np.unique(np.linspace(0, data.num_docs - 1, count).round().astype(int))
    for d in picks:
        ids = data.document(int(d)).tolist()
        text = tok.decode(ids, skip_special_tokens=False)
        cut = text if len(text) <= max_chars else text[:max_chars] + f" […{len(text) - max_chars:,} more chars]"
        lines.append(f"\n--- {split} document {d:,} ({len(ids):,} tokens) ---\n{cut}")
    return "\n".join(lines)
