"""The AdamW step alone over a flavor's weights: anyseek's kernels against torch's fused AdamW.

    python benchmarks/optimizer.py [--flavor small] [--vocab 32000] [--reps 20]

Every row moves 28 bytes per weight (reads and writes together):
  torch fused AdamW      torch.optim.AdamW(fused=True) over fp32 weights and fp32 gradients: torchrun's optimizer
                         before stop 35, and the fallback where Triton cannot run
  TensorAdamW, fp32      `train.optim.TensorAdamW` over fp32 weights and fp32 gradients (FSDP2's fp32 shards,
                         `parallel.shard_dtype=fp32`)
  TensorAdamW, masters   the same over fp32 masters with bf16 gradients (views of one buffer, as FSDP2's reduction
                         leaves them), writing each bf16 weight in the same pass (`parallel.shard_dtype=bf16`, the
                         default under torchrun in bf16)
  flat kernel            `kernels.adamw_flat`, the one-process working copy's optimizer (one flat buffer each)
Correctness: the weights after one step, against torch.optim.AdamW (foreach, fp32) from the same state and the same
(bf16-rounded) gradients: max |difference| over the weights.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def bench(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/optimizer.py needs a CUDA GPU")

    import anyseek.kernels.triton.adamw as tri
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.optim import TensorAdamW

    with torch.device("meta"):
        shapes = [q.shape for q in DeepSeekV3(ModelConfig.from_name(args.flavor, vocab_size=args.vocab)).parameters()]
    n = sum(s.numel() for s in shapes)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w0 = torch.randn(n, device=dev, generator=gen) * 0.02
    g_low = (torch.randn(n, device=dev, generator=gen) * 1e-3).to(torch.bfloat16)  # every row's gradient values
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for s in shapes:
            out.append(flat[at:at + s.numel()].view(s))
            at += s.numel()
        return out

    ref = [torch.nn.Parameter(t.clone()) for t in split(w0)]
    for q, g in zip(ref, split(g_low.float())):
        q.grad = g
    torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], foreach=True, **kw).step()
    expected = torch.cat([q.detach().reshape(-1) for q in ref])
    del ref
    torch.cuda.empty_cache()

    rows = []

    def record(name: str, ms: float, weights: torch.Tensor) -> None:
        err = (weights - expected).abs().max().item()
        rows.append((name, ms, 28 * n / ms / 1e6, err))
        print(f"{name}: {ms:.3f} ms, max |diff| {err:.2e}", flush=True)

    def tensor_step(make, name: str, masters: bool) -> None:
        params = [torch.nn.Parameter(t.clone() if not masters else t.to(torch.bfloat16)) for t in split(w0)]
        grads = split(g_low.clone()) if masters else split(g_low.float())
        for q, g in zip(params, grads):
            q.grad = g
        opt = make([{"params": params, "weight_decay": 0.1}], {q: m for q, m in zip(params, split(w0.clone()))}
                   if masters else None)  # fmt: skip
        opt.grad_scale = torch.ones((), device=dev)
        opt.found_inf = torch.zeros((), device=dev)
        opt.step()  # the step checked
        weights = torch.cat([m.reshape(-1) for m in opt.masters.values()]) if masters else \
            torch.cat([q.detach().reshape(-1) for q in params])
        weights = weights.clone()
        record(name, bench(opt.step, args.reps), weights)
        del params, grads, opt
        torch.cuda.empty_cache()

    tensor_step(lambda g, m: torch.optim.AdamW(g, fused=True, **kw), "torch fused AdamW (fp32 weights and gradients)",
                False)
    tensor_step(lambda g, m: TensorAdamW(g, **kw), "TensorAdamW, fp32 weights and gradients", False)
    tensor_step(lambda g, m: TensorAdamW(g, masters=m, **kw), "TensorAdamW, fp32 masters, bf16 gradients and weights",
                True)

    w, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    low, one = torch.empty_like(w0, dtype=torch.bfloat16), torch.ones((), device=dev)
    tri.adamw_flat(w, g_low, m, v, low, one, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    checked = w.clone()
    record("flat kernel, bf16 gradient, writes bf16 weights (one process)",
           bench(lambda: tri.adamw_flat(w, g_low, m, v, low, one, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1), args.reps), checked)

    print()
    print(f"AdamW step over `{args.flavor}`'s {len(shapes)} weight tensors ({n / 1e6:.1f}M weights, vocab "
          f"{args.vocab}), {torch.cuda.get_device_name()}")
    print(f"{platform.machine()}, torch {torch.__version__}, {datetime.date.today()}, mean of {args.reps} steps after "
          f"3; Triton blocks of {tri.TENSORS_BLOCK} elements, {tri.TENSORS_WARPS} warps")
    print()
    print("| optimizer | ms/step | GB/s (28 B per weight) | max abs diff vs torch AdamW (fp32) after one step |")
    print("| --- | --- | --- | --- |")
    for name, ms, gbs, err in rows:
        print(f"| {name} | {ms:.3f} | {gbs:,.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
