"""Does a 4-bit base cost accuracy? LoRA from a trained `small` checkpoint with a bf16 base and with a 4-bit (NF4)
base, same data, seed and steps: their final validation losses side by side (the issue's target: within 1%).

    python benchmarks/base4_accuracy.py --data DIR [--base STEP_DIR] [--pretrain-steps 1000] [--steps 300]
                                        [--tokens 8192] [--out runs/base4-accuracy]

DIR: a prepared corpus (`anyseek prepare`, e.g. the Wikipedia sample at vocab 32000). --base: a trained `small`
step-N (or Hugging Face folder) to adapt; without it the script first trains `small` from scratch for
--pretrain-steps on DIR and adapts that. Each LoRA run: rank 16 on every target, the trainer's defaults otherwise,
through `anyseek.train.Trainer` (the same code as `anyseek train`). Prints a markdown table; exits non-zero when the
4-bit run's validation loss is more than 1% above the bf16 run's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from anyseek.train.config import load_run_config
from anyseek.train.trainer import Trainer


def train(out: Path, flavor: str, data: str, tokens: int, steps: int, extra: list[str]) -> dict:
    cfg = load_run_config(flavor, [f"--data.path={data}", f"--data.tokens_per_batch={tokens}",
                                    f"--train.max_steps={steps}", "--train.tensorboard=false",
                                    f"--train.save_every={steps}", *extra])  # fmt: skip
    t0 = time.perf_counter()
    summary = Trainer(cfg, out, log=lambda s: None).run()
    return {**summary, "seconds": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--base", default=None)
    ap.add_argument("--pretrain-steps", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default="runs/base4-accuracy")
    ap.add_argument("--flavor", default="small")
    ap.add_argument("--pretrain-arg", action="append", default=[],
                    help="a dotted override for the pretraining run (e.g. a dry run of the script on a CPU)")
    args = ap.parse_args()
    out = Path(args.out)
    base = args.base
    if base is None:
        pre = train(out / "pretrain", args.flavor, args.data, args.tokens, args.pretrain_steps, args.pretrain_arg)
        base = pre["checkpoint"]
        print(f"pretrained {args.flavor}: {args.pretrain_steps} steps, val loss {pre['val_loss']:.4f} "
              f"({pre['seconds']:.0f} s)")
    rows = {}
    for bits in (16, 4):
        lora = [f"--train.init={json.dumps(str(base))}", "--train.lora_rank=16", "--train.lora_alpha=32",
                f"--train.base_bits={bits}"]  # fmt: skip
        rows[bits] = train(out / f"lora-base{bits}", args.flavor, args.data, args.tokens, args.steps, lora)
        print(json.dumps({"base_bits": bits, "val_loss": rows[bits]["val_loss"], "seconds": rows[bits]["seconds"]}),
              flush=True)
    ratio = rows[4]["val_loss"] / rows[16]["val_loss"]
    print(f"\nLoRA r16 on `{args.flavor}` from {base}, {args.steps} steps of {args.tokens} tokens")
    print("| base | val loss | val perplexity | s |")
    print("| --- | --- | --- | --- |")
    for bits, r in rows.items():
        print(f"| {'bf16' if bits == 16 else '4-bit NF4'} | {r['val_loss']:.4f} | {r['val_perplexity']:.2f} | "
              f"{r['seconds']:.0f} |")
    print(f"4-bit / bf16 validation loss: {ratio:.4f} (target <= 1.01)")
    return 0 if ratio <= 1.01 else 1


if __name__ == "__main__":
    sys.exit(main())
