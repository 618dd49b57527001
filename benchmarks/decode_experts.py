"""Where a decode step's time goes for a flavor (default 16B; random bf16 weights, one GPU): ms per `Engine.decode`
step at batch 1, 8 and 64, CUDA-graphed, with the routed experts as `infer/layers.py: ffn_forward` does them today
(gathered expert weights, or every expert on every token, by batch size) and with the routed-experts kernel
(`kernels.routed_experts`, which reads only the chosen experts) always; then the eager step's top kernels at batch 1.

    python benchmarks/decode_experts.py [16B|small]

Written at stop 45 after `anyseek serve` measured 93 tokens/s at one client on 16B (10.3 ms a step where the weights
a token reads take ~1.3 ms at an H200's bandwidth); not run yet."""
import sys, time, torch
import anyseek.infer.layers as layers
from anyseek import kernels
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3
from anyseek.infer.engine import Engine
from torch.profiler import profile, ProfilerActivity

name = sys.argv[1] if len(sys.argv) > 1 else "16B"
cfg = ModelConfig.from_name(name)
torch.manual_seed(0)
model = DeepSeekV3(cfg, device="cuda").to(device="cuda", dtype=torch.bfloat16).eval()
today = layers.ffn_forward

def kernel_always(mlp, x_TD):
    if not isinstance(mlp, layers.MoE):
        return mlp(x_TD)
    _, ids_TK, w_TK = mlp.gate(x_TD)
    shared = mlp.shared_experts(x_TD) if hasattr(mlp, "shared_experts") else None
    return kernels.routed_experts(x_TD, ids_TK, w_TK, mlp.experts.gate_up_proj, mlp.experts.down_proj, shared)

for label, ffn, graphs in (("today", today, True), ("kernel", kernel_always, True), ("today-eager", today, False)):
    layers.ffn_forward = ffn
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
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=50))
        for s in ids:
            eng.free(s)
    del eng
