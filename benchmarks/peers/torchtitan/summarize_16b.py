#!/usr/bin/env python3
"""The markdown table of run_16b_ep.sh: torchtitan's 16B runs, each with its own and anyseek's MFU.

    python3 summarize_16b.py MANIFEST.tsv --check CHECK.json --ranks N --ep N [--first 10 --last 30] [--json OUT]

MANIFEST.tsv: one row per attempt (variant, tokens per rank per step, compile, AC, rc, wall seconds, log path),
written by run_16b_ep.sh. The step lines are read by the shared peer's summarize.py (parse_log). Per attempt: the
median over steps [first, last] of torchtitan's tokens/s per GPU (a rank's tokens over its step time: every rank
waits for the others in the collectives), TFLOP/s and MFU; the largest per-step peak of reserved memory. Every rank
logs its step lines; the parser keeps each step's last line, i.e. one rank's figures.
anyseek's MFU of the same run: tokens/s per GPU x anyseek's FLOPs per token (CHECK.json, from check_16b.py: 6 x
active weights without the embedding and norms, causal attention halved, recomputation not credited) / the GPU's
dense bf16 peak as anyseek's trainer takes it (anyseek.train.metrics; torchtitan's peak where anyseek is not
importable).
"""

import argparse
import json
import re
import sys

import summarize as peer  # the shared peer folder's log parser (on sys.path via run_16b_ep.sh)


def peak_flops(device: str | None, torchtitan_peak: str | None) -> tuple[float | None, str]:
    """(FLOP/s, where it came from) for anyseek's MFU."""
    if device:
        try:
            from anyseek.train.metrics import peak_tflops

            tflops = peak_tflops(device)
            if tflops is not None:
                return tflops * 1e12, "anyseek's table"
        except ImportError:
            pass
    if torchtitan_peak:
        try:
            return float(torchtitan_peak), "torchtitan's"
        except ValueError:
            pass
    return None, "unknown"


def rows_of(manifest: str, first: int, last: int) -> list[dict]:
    rows = []
    with open(manifest) as f:
        lines = f.read().splitlines()
    for line in lines:
        if not line.strip():
            continue
        name, tokens, comp, ac, rc, wall, log = line.split("\t")
        steps, info = peer.parse_log(log if int(rc) != 125 else "/nonexistent")
        window = [steps[s] for s in range(first, last + 1) if s in steps]
        error = None
        if int(rc) == 125:
            error = "skipped: time budget"
        elif int(rc) in (124, 137):
            error = f"timed out after {wall}s at step {max(steps) if steps else 0}"
        elif int(rc) != 0 or not steps:
            error = info["error"] or f"exit {rc}, no step logged"
        elif len(window) < last - first + 1:
            error = f"only {len(window)} steps in the window"
        rows.append({"variant": name, "tokens_per_rank": int(tokens), "compile": comp, "ac": ac, "rc": int(rc),
                     "wall_s": float(wall), "log": log, "device": info["device"], "peak_flops": info["peak_flops"],
                     "tps": peer.median_or_none([w["tps"] for w in window]),
                     "tflops": peer.median_or_none([w["tflops"] for w in window]),
                     "mfu": peer.median_or_none([w["mfu"] for w in window]),
                     "min_tps": min((w["tps"] for w in window), default=None),
                     "max_tps": max((w["tps"] for w in window), default=None),
                     "mem_gib": max((s["mem_gib"] for s in steps.values()), default=None),
                     "loss": steps[max(steps)]["loss"] if steps else None,
                     "steps": len(steps), "error": error, "shims": info["shims"]})  # fmt: skip
    return rows


def fmt(x, spec: str, unit: str = "") -> str:
    return "-" if x is None else format(x, spec) + unit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest")
    p.add_argument("--check", required=True, help="check_16b.py's --json")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--first", type=int, default=10)
    p.add_argument("--last", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with open(a.check) as f:
        check = json.load(f)
    ours_fpt = check["anyseek"]["flops_per_token"] if check.get("anyseek") else None
    tt = check["torchtitan"]
    rows = rows_of(a.manifest, a.first, a.last)
    device = next((r["device"] for r in rows if r["device"]), None)
    tt_peak = next((r["peak_flops"] for r in rows if r["peak_flops"]), None)
    peak, peak_from = peak_flops(re.sub(r"\s+with\s+.*$", "", device or ""), tt_peak)
    for r in rows:
        r["anyseek_mfu"] = (r["tps"] * ours_fpt / peak) if (r["tps"] and ours_fpt and peak) else None
    print(f"torchtitan 0.3.0, anyseek's 16B cut to {check['layers']} layers (vocab {check['vocab']}): "
          f"{tt['total'] / 1e9:.2f}B parameters, {tt['active'] / 1e9:.3f}B active; {a.ranks} ranks, EP {a.ep}, "
          f"FSDP2 over all ranks; device: {device}; peak for MFU: torchtitan {tt_peak}, anyseek "
          f"{fmt(peak, '.3e')} ({peak_from})")  # fmt: skip
    print(f"FLOPs per token at seq {check['seqlen']}: torchtitan {tt['flops_per_token'] / 1e9:.3f} G (6 x active "
          f"incl. norms + unhalved attention), anyseek {fmt(ours_fpt and ours_fpt / 1e9, '.3f')} G (6 x active "
          f"matmul weights + causal attention)")  # fmt: skip
    for s in sorted({s for r in rows for s in r["shims"]}):
        print(f"shim: {s}")
    print()
    print(f"| variant | compile | AC | tokens/rank/step | tokens/s per GPU (median, steps {a.first}-{a.last}) "
          f"| min-max | all ranks | torchtitan TFLOP/s | torchtitan MFU | anyseek MFU | peak reserved GiB "
          f"| last loss | wall s | status |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        spread = f"{fmt(r['min_tps'], ',.0f')}-{fmt(r['max_tps'], ',.0f')}" if r["min_tps"] else "-"
        print(f"| {r['variant']} | {r['compile']} | {r['ac']} | {r['tokens_per_rank']:,} | {fmt(r['tps'], ',.0f')} "
              f"| {spread} | {fmt(r['tps'] and r['tps'] * a.ranks, ',.0f')} | {fmt(r['tflops'], '.1f')} "
              f"| {fmt(r['mfu'], '.2f', '%')} | {fmt(r['anyseek_mfu'] and 100 * r['anyseek_mfu'], '.2f', '%')} "
              f"| {fmt(r['mem_gib'], '.1f')} | {fmt(r['loss'], '.3f')} | {r['wall_s']:.0f} "
              f"| {(r['error'] or 'ok')[:120]} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"check": check, "rows": rows, "peak_flops_anyseek": peak}, f, indent=1, default=str)
    return 0 if any(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
