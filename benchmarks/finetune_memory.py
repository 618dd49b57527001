"""Peak GPU memory and tokens/s of full fine-tuning vs LoRA, and what `anyseek train` predicts for each.

    python benchmarks/finetune_memory.py [--steps 6] [--out results.json]

One optimizer step as the trainer runs it (bf16 autocast, packed documents, AdamW fused, gradient clipping) on random
tokens, same batch for both modes. Full: fp32 weights + AdamW on everything. LoRA: rank 16 on every target, the base
frozen in bf16, AdamW on the adapters only. Cases: the `small` flavor and a 2-layer `16B`-shaped model (Moonlight /
DeepSeek-V2-Lite widths: one dense and one MoE layer, vocab 163840). LoRA over a 4-bit base, and the
transformers + PEFT + bitsandbytes peer: benchmarks/finetune_4bit.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from anyseek.model.config import ModelConfig
from anyseek.model.mtp import count_targets
from anyseek.model.transformer import DeepSeekV3
from anyseek.train.config import load_run_config
from anyseek.train.memory import estimate
from anyseek.train.optim import build_optimizer
from anyseek.transforms import lora as lora_lib

GiB = 1 << 30
CASES = [("small", {}, 8192, 2048), ("16B, 2 layers", {"num_hidden_layers": 2}, 4096, 2048)]


def batch(vocab: int, tokens: int, seqlen: int, device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    targets = torch.roll(ids, -1)
    cu = torch.arange(0, tokens + 1, seqlen, dtype=torch.int32)
    targets[cu[1:] - 1] = -100
    return ids.to(device), targets.to(device), cu.to(device)


def one_case(flavor: str, overrides: dict, tokens: int, seqlen: int, lora: bool, steps: int,
             dev: torch.device | None = None) -> dict:
    dev = dev or torch.device("cuda")
    if dev.type != "cuda":  # a dry run of the script's logic on the CPU (timings and memory meaningless)
        torch.cuda.synchronize = torch.cuda.reset_peak_memory_stats = torch.cuda.empty_cache = lambda *a: None
        torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a: 0
    mc = ModelConfig.from_name("16B" if flavor.startswith("16B") else flavor, **overrides)
    torch.manual_seed(0)
    model = DeepSeekV3(mc, device=dev)
    spec = lora_lib.LoRASpec(rank=16, alpha=32) if lora else None
    if lora:
        lora_lib.apply_lora(model, spec, torch.bfloat16)
    model.train()
    run_cfg = load_run_config("small", [f"--data.tokens_per_batch={tokens}", f"--data.max_seqlen={seqlen}"])
    opt = build_optimizer(model, run_cfg.train, dev)
    ids, targets, cu = batch(mc.vocab_size, tokens, seqlen, dev)
    n = torch.tensor(count_targets(targets.cpu(), cu.cpu(), len(model.mtp)), dtype=torch.float32, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(ids, cu_seqlens=cu, targets=targets, max_seqlen=seqlen, return_logits=False, num_targets=n)
        loss = out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step().detach())
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    last = float(last.detach())  # waits for the GPU
    ms = (time.perf_counter() - t0) / steps * 1e3
    est = estimate(mc, run_cfg, spec, torch.bfloat16, autocast=True)
    row = {"model": flavor, "mode": "LoRA r16 (bf16 base)" if lora else "full (fp32 + AdamW)",
           "params_M": model.num_parameters() / 1e6, "trained_M": sum(p.numel() for p in params) / 1e6,
           "tokens": tokens, "resident_GiB": resident / GiB, "peak_GiB": peak / GiB, "estimate_GiB": est.total / GiB,
           "est_parts_GiB": {k: getattr(est, k) / GiB for k in ("weights", "grads", "optimizer", "weight_copies",
                                                                  "activations")},
           "ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3, "first_loss": first, "last_loss": float(last)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for flavor, overrides, tokens, seqlen in CASES:
        for lora in (False, True):
            t0 = time.perf_counter()
            rows.append(one_case(flavor, overrides, tokens, seqlen, lora, args.steps))
            gc.collect()  # the case's model and optimizer went with its frame
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__}")
    print("| model | mode | params M | trained M | tokens/step | peak GiB | estimate GiB | ms/step | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['params_M']:.0f} | {r['trained_M']:.1f} | {r['tokens']} | "
              f"{r['peak_GiB']:.2f} | {r['estimate_GiB']:.2f} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} |")
    for i in range(0, len(rows), 2):
        f, lo = rows[i], rows[i + 1]
        print(f"{f['model']}: LoRA peak = {lo['peak_GiB'] / f['peak_GiB']:.0%} of full; "
              f"tokens/s {lo['tokens_per_s'] / f['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
