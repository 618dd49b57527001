"""Where a decode step's GPU time goes, with routing as real traffic spreads it (random prompts and tokens: at batch
64 nearly every expert is chosen, so a step reads nearly all expert weights; `decode_experts.py` repeats one token,
so all sequences pick the same few experts). One GPU, random bf16 weights.

    python benchmarks/decode_profile.py [16B|small] [--batches 1,64] [--context 256] [--top 25]

Prints per batch: the graphed step's ms (what `anyseek serve` runs), the eager step's summed kernel time, the
kernels a step, and the kernels grouped by name (us a step, count a step, share), largest first; the floor from the
bytes a step must read (weights of the chosen experts + everything else, the latent cache) at the GPU's bandwidth."""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from anyseek.infer.engine import Engine
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3

p = argparse.ArgumentParser()
p.add_argument("flavor", nargs="?", default="16B")
p.add_argument("--batches", default="1,64")
p.add_argument("--context", type=int, default=256)
p.add_argument("--top", type=int, default=25)
p.add_argument("--max-len", type=int, default=None, help="the engine's longest sequence (default context + 64)")
p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8 TB/s)")
p.add_argument("--no-join", action="store_true", help="leave the weights as built (no `infer.layers.join_weights`)")
p.add_argument("--moe-small", default=None, help="JSON of the experts' small_ launch settings (moe_decode.py --out)")
a = p.parse_args()
if a.moe_small:
    import json

    from anyseek.kernels.triton import moe as tri

    tri._TABLE[tri.family(torch.device("cuda"))].update({k: tuple(v) for k, v in json.load(open(a.moe_small)).items()})
cfg = ModelConfig.from_name(a.flavor)
torch.manual_seed(0)
model = DeepSeekV3(cfg, device="cuda").to(device="cuda", dtype=torch.bfloat16).eval()
if not a.no_join:  # as `anyseek serve` and `generate` load a model
    from anyseek.infer.layers import join_weights

    join_weights(model)
V = cfg.vocab_size
g = torch.Generator().manual_seed(1)
rand = lambda n: torch.randint(0, V, (n,), generator=g).tolist()
main = [
    (n, p)
    for n, p in model.named_parameters()
    if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.num_hidden_layers)
]  # no MTP layer
expert_bytes = sum(p.numel() * 2 for n, p in main if ".experts." in n and "shared" not in n)
other_bytes = sum(p.numel() * 2 for n, p in main if not (".experts." in n and "shared" not in n))
other_bytes -= cfg.vocab_size * cfg.hidden_size * 2  # the embedding: one row a token
E = cfg.n_routed_experts
for B in [int(b) for b in a.batches.split(",")]:
    ids = list(range(B))
    row = {}
    for graphs in (True, False):
        eng = Engine(model, max_batch=B, max_len=a.max_len or a.context + 64, cuda_graphs=graphs)
        eng.prefill(ids, [rand(a.context) for _ in ids])
        toks = [rand(B) for _ in range(40)]
        for t in toks[:5]:
            eng.decode(ids, t)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in toks[5:35]:
            eng.decode(ids, t)
        torch.cuda.synchronize()
        row["graph" if graphs else "eager"] = 1e3 * (time.perf_counter() - t0) / 30
        if not graphs:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for t in toks[35:38]:
                    eng.decode(ids, t)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            by: dict[str, list] = {}
            for e in ev:
                s = by.setdefault(e.name[:70], [0.0, 0])
                s[0] += e.device_time / 3
                s[1] += 1 / 3
            busy = sum(v[0] for v in by.values())
        del eng
        torch.cuda.empty_cache()
    chosen = 1 - (1 - cfg.num_experts_per_tok / E) ** B
    floor_ms = 1e3 * (expert_bytes * chosen + other_bytes) / a.bandwidth
    print(
        f"\n## {a.flavor} batch {B}, context {a.context}: graphed step {row['graph']:.2f} ms "
        f"({B / row['graph'] * 1e3:,.0f} tok/s), eager {row['eager']:.2f} ms, kernel time {busy / 1e3:.2f} ms in "
        f"{sum(v[1] for v in by.values()):.0f} kernels; floor {floor_ms:.2f} ms (experts {chosen:.0%} read)"
    )
    print("| kernel | us a step | per step | share |\n| --- | --- | --- | --- |")
    for name, (us, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"| {name} | {us:.1f} | {n:.0f} | {us / busy:.1%} |")
