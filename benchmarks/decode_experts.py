"""Where a decode step's time goes for a flavor (default 16B; random bf16 weights, one GPU): ms per `Engine.decode`
step at batch 1, 8 and 64, CUDA-graphed, with the routed experts as `infer/layers.py: ffn_forward` runs them by
batch size without the kernel (ANYSEEK_DECODE_EXPERTS=sizes: gathered expert weights, or every expert on every
token) and through the routed-experts kernel seam (=kernel, the default with the Triton backend: reads only the
chosen experts); then the eager step's kernels at batch 1 (how many a step, the top ones).

    python benchmarks/decode_experts.py [16B|small] [--kernel-only]

Written at stop 45 after `anyseek serve` measured 93 tokens/s at one client on 16B. Stop 46, one H200: sizes
9.90 / 11.14 / 14.24 ms a step at batch 1 / 8 / 64, kernel 6.15 / 6.30 / 6.45; the kernel is the default since."""
import sys, time, torch
import anyseek.infer.layers as layers
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3
from anyseek.infer.engine import Engine
from torch.profiler import profile, ProfilerActivity

name = next((a for a in sys.argv[1:] if not a.startswith("--")), "16B")
cfg = ModelConfig.from_name(name)
torch.manual_seed(0)
model = DeepSeekV3(cfg, device="cuda").to(device="cuda", dtype=torch.bfloat16).eval()
variants = (("sizes", "sizes", True), ("kernel", "kernel", True), ("kernel-eager", "kernel", False))
if "--kernel-only" in sys.argv:
    variants = variants[1:]
for label, mode, graphs in variants:
    layers.DECODE_EXPERTS = mode
    eng = Engine(model, max_batch=64, max_len=512, cuda_graphs=graphs)
    for B in (1, 8, 64):
        ids = list(range(B))
        eng.prefill(ids, [[5] * 64 for _ in ids])
        tok = [7] * B
        for _ in range(5):
            eng.decode(ids, tok)
        torch.cuda.synchronize(); t = time.perf_counter(); n = 30
        for _ in range(n):
            eng.decode(ids, tok)
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t) / n
        print(f"{name} {label} B={B}: {ms:.2f} ms/step, {B / ms * 1e3:,.0f} tok/s", flush=True)
        if not graphs and B == 1:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    eng.decode(ids, tok)
                torch.cuda.synchronize()
            launched = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"{name} {label} B=1: {len(launched) / 3:.0f} kernels a step")
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=50))
        for s in ids:
            eng.free(s)
    del eng
