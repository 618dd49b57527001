"""Decoding benchmarks: (a) the MLA decode kernel alone, (b) `anyseek.generate` end to end against transformers.

(a) batch x context grid, H = 16 and 128, DeepSeek-V3 latent width (L 512 + R 64 = 576): anyseek's paged kernel as
    shipped (on Hopper, heads in blocks of 64 go to the warp-specialised Gluon kernel), the Triton kernel alone, with
    and without TMA loads, eagerly and as GPU time in a CUDA graph,
    SDPA over the expanded per-head K/V (what a cache of full keys and values costs: 128 + 64 key and 128 value
    dims per head), and a naive PyTorch absorbed path (einsum + softmax + einsum over a contiguous latent cache).
    Bytes: the cache rows each row reads (+ q and out); FLOPs: 2 * H * S * (576 + 512) per row.
(b) the `small` flavor, random weights, bf16, 128-token prompts, 256 new tokens, greedy, batch 1 and 32:
    anyseek.generate (paged latent cache, CUDA graphs) against transformers' generate (sdpa, its default cache).

(c) `--cpu`: (b) on the CPU with the `tiny` flavor, fp32, 2 threads, 128-token prompts, 128 new tokens, batch 1
    and 8. One process measures each peer once after a warm-up call; the CPU is noisy: run it several times in fresh
    processes and take medians.

    python3 benchmarks/decode.py [--kernel] [--e2e] [--sweep] [--out DIR]    (default: all; needs a GPU for (a))
    python3 benchmarks/decode.py --cpu [--batches 1,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _bench(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3  # seconds


def _graph_time(fn, launches: int = 10) -> float:
    """GPU time of one call of `fn`: `launches` calls captured in one CUDA graph, median over replays (seconds)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    t = _bench(g.replay) / launches
    del g
    return t


def _case(B: int, S: int, H: int, dev, dtype=torch.bfloat16, L=512, R=64, page=64, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    M = -(-S // page)
    perm = torch.randperm(B * M, generator=g, device=dev).to(torch.int32) + 1
    cache = torch.randn(B * M + 1, page, L + R, device=dev, dtype=dtype, generator=g)
    q = torch.randn(B, H, L + R, device=dev, dtype=dtype, generator=g)
    table = perm.view(B, M)
    lens = torch.full((B,), S, dtype=torch.int32, device=dev)
    return q, cache, table, lens


def kernel_grid(out_rows: list, sweep: bool) -> None:
    from anyseek.kernels.triton.mla_decode import launch_config, mla_decode

    dev = torch.device("cuda")
    L, R = 512, 64
    if sweep:
        for H, B, S in ((16, 64, 4096), (128, 64, 4096), (16, 1, 32768)):
            q, cache, table, lens = _case(B, S, H, dev)
            base = launch_config(B, H, table.shape[1], dev, q.dtype)
            res = []
            for bh in [16] if H == 16 else [32, 64]:
                for bn in (16, 32, 64):
                    for w in (4, 8):
                        for st in (1, 2, 3):
                            for sp in sorted({base["splits"], max(1, base["splits"] // 2), base["splits"] * 2}):
                                cfg = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "splits": sp}
                                try:
                                    t = _bench(lambda cfg=cfg: mla_decode(q, cache, table, lens, L, config=cfg))  # noqa: B023
                                except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                                    res.append((float("inf"), cfg, type(e).__name__))
                                    continue
                                res.append((t, cfg, ""))
            res.sort(key=lambda r: r[0])
            gb = B * S * (L + R) * 2 / 1e9
            print(f"sweep H={H} B={B} S={S} default={base}")
            for t, cfg, err in res[:6]:
                print(f"  {t * 1e6:8.1f} us {gb / t:7.0f} GB/s {cfg} {err}")
            out_rows.append({"sweep": f"H={H} B={B} S={S}", "default": base,
                             "best": [(t, c) for t, c, _ in res[:6]]})  # fmt: skip
    for H in (16, 128):
        for B in (1, 16, 64, 128):
            for S in (512, 4096, 32768):
                if B * S > 128 * 8192 and H == 128 and B > 16:
                    continue  # keep the grid inside a few minutes
                row = _kernel_case(H, B, S, dev)
                out_rows.append(row)
                print(f"H={H:3d} B={B:3d} S={S:5d}  anyseek {row['triton_us']:8.1f} us {row['triton_GBps']:6.0f} GB/s "
                      f"{row['triton_TFLOPs']:6.1f} TFLOP/s | in a graph {row['graph_us']:8.1f} us "
                      f"{row['graph_GBps']:6.0f} GB/s {row['graph_TFLOPs']:6.1f} TFLOP/s | Triton kernel "
                      f"{row['triton_kernel_us']:8.1f} us, in a graph {row['graph_triton_kernel_us']:8.1f} us "
                      f"{row['graph_triton_kernel_TFLOPs']:6.1f} TFLOP/s | no TMA {row['no_tma_us']:8.1f} us "
                      f"| naive {row['naive_us']:8.1f} us | sdpa(expanded) {row['sdpa_us']:8.1f} us "
                      f"| err {row['err']:.1e} pt {row['err_pt']:.1e}", flush=True)  # fmt: skip
                torch.cuda.empty_cache()


def _kernel_case(H: int, B: int, S: int, dev: torch.device, L: int = 512, R: int = 64) -> dict:
    from anyseek.kernels.reference.decode import mla_decode as ref_decode
    from anyseek.kernels.triton.mla_decode import mla_decode

    q, cache, table, lens = _case(B, S, H, dev)
    t_tri = _bench(lambda: mla_decode(q, cache, table, lens, L))  # as shipped: on Hopper, 64-head blocks by Gluon
    t_trk = _bench(lambda: mla_decode(q, cache, table, lens, L, config={"ws": False}))  # the Triton kernel
    t_ptr = _bench(lambda: mla_decode(q, cache, table, lens, L, config={"ws": False, "tma": False}))  # no TMA
    g_ship = _graph_time(lambda: mla_decode(q, cache, table, lens, L))
    g_trk = _graph_time(lambda: mla_decode(q, cache, table, lens, L, config={"ws": False}))
    err = err_pt = float("nan")
    if B * S <= 64 * 4096:  # the 2x rule against the fp32 oracle, where the oracle fits
        ref = ref_decode(q.float(), cache.float(), table, lens, L)
        pt = ref_decode(q, cache, table, lens, L, compute_dtype=q.dtype).float()
        err = (mla_decode(q, cache, table, lens, L).float() - ref).abs().max().item()
        err_pt = (pt - ref).abs().max().item()
    lat = torch.randn(B, S, L + R, device=dev, dtype=q.dtype)  # naive absorbed PyTorch over a contiguous cache

    def naive():
        s = torch.einsum("bhx,bsx->bhs", q, lat).float() * 0.0417
        return torch.einsum("bhs,bsl->bhl", s.softmax(-1).to(q.dtype), lat[..., :L])

    t_naive = _bench(naive)
    kv_bytes = B * H * S * (192 + 128) * 2  # SDPA over expanded per-head K/V: k [B, H, S, 192], v [B, H, S, 128]
    t_sdpa = float("nan")
    if kv_bytes < 24e9:
        k = torch.randn(B, H, S, 192, device=dev, dtype=q.dtype)
        v = torch.randn(B, H, S, 128, device=dev, dtype=q.dtype)
        qq = torch.randn(B, H, 1, 192, device=dev, dtype=q.dtype)
        t_sdpa = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v))
    cache_bytes, flops = B * S * (L + R) * 2, 2 * B * H * S * (L + R + L)
    return {"H": H, "B": B, "S": S, "triton_us": t_tri * 1e6, "triton_GBps": cache_bytes / t_tri / 1e9,
            "triton_TFLOPs": flops / t_tri / 1e12, "triton_kernel_us": t_trk * 1e6, "graph_us": g_ship * 1e6,
            "graph_GBps": cache_bytes / g_ship / 1e9, "graph_TFLOPs": flops / g_ship / 1e12,
            "graph_triton_kernel_us": g_trk * 1e6, "graph_triton_kernel_TFLOPs": flops / g_trk / 1e12,
            "no_tma_us": t_ptr * 1e6, "naive_us": t_naive * 1e6,
            "sdpa_us": t_sdpa * 1e6,
            "sdpa_GBps": kv_bytes / t_sdpa / 1e9, "err": err, "err_pt": err_pt}  # fmt: skip


def e2e(out_rows: list, batches=(1, 32), new_tokens=256, prompt_len=128, skip_hf=False) -> None:
    import anyseek
    from anyseek.model.config import ModelConfig
    from anyseek.model.flavors import FLAVORS
    from anyseek.model.transformer import DeepSeekV3

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = ModelConfig(**FLAVORS["small"])
    model = DeepSeekV3(cfg, device=dev, dtype=torch.bfloat16).eval()
    hf = None
    if not skip_hf:
        import transformers

        from anyseek.hf import config_to_hf

        hf_cfg = transformers.DeepseekV3Config(**config_to_hf(cfg))
        hf_cfg._attn_implementation = "sdpa"
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg).to(dev, torch.bfloat16).eval()
        hf.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=g).tolist()
        anyseek.generate(model, prompts, max_new_tokens=8, temperature=0, eos_token_id=None)  # compile, warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs, stats = anyseek.generate(model, prompts, max_new_tokens=new_tokens, temperature=0, return_stats=True)
        torch.cuda.synchronize()
        t_ours = time.perf_counter() - t0
        n_ours = sum(len(o) for o in outs)
        row = {"B": B, "ours_tok_s": n_ours / t_ours, "ours_ms_per_step": t_ours / new_tokens * 1e3,
               "ours_decode_tok_s": stats.tokens_per_second}  # fmt: skip
        if hf is not None:
            ids = torch.tensor(prompts, device=dev)
            hf.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ho = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
            torch.cuda.synchronize()
            t_hf = time.perf_counter() - t0
            n_hf = (ho.shape[1] - prompt_len) * B
            same = sum(o == h for o, h in zip(outs, ho[:, prompt_len:].tolist()))
            row.update(hf_tok_s=n_hf / t_hf, hf_ms_per_step=t_hf / new_tokens * 1e3, speedup=(n_ours / t_ours) / (n_hf / t_hf),
                       identical_rows=f"{same}/{B}")  # fmt: skip
        out_rows.append(row)
        print(json.dumps(row), flush=True)


def e2e_cpu(out_rows: list, batches=(1, 8), new_tokens=128, prompt_len=128, threads=2, reps=3) -> None:
    """(c): `tiny` flavor, fp32, on the CPU; anyseek.generate vs transformers' generate (sdpa), same weights. Each
    peer runs `reps` times, interleaved (a shared machine's load hits both alike); medians per peer."""
    import statistics

    import transformers

    import anyseek
    from anyseek.hf import config_to_hf
    from anyseek.model.config import ModelConfig
    from anyseek.model.flavors import FLAVORS
    from anyseek.model.transformer import DeepSeekV3

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**FLAVORS["tiny"])
    model = DeepSeekV3(cfg).eval()
    hf_cfg = transformers.DeepseekV3Config(**config_to_hf(cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    hf.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}, strict=False)
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, prompt_len), generator=g).tolist()
        ids = torch.tensor(prompts)

        def ours(prompts=prompts):
            return anyseek.generate(model, prompts, max_new_tokens=new_tokens, temperature=0)

        def theirs(ids=ids):
            with torch.no_grad():
                return hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)  # fmt: skip

        anyseek.generate(model, prompts, max_new_tokens=8, temperature=0)  # warm up both
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        for r in range(reps):
            for name, fn in (("ours", ours), ("hf", theirs)) if r % 2 == 0 else (("hf", theirs), ("ours", ours)):
                t0 = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - t0)
                if name == "ours":
                    outs = out
                else:
                    ho = out
        n_ours, n_hf = sum(len(o) for o in outs), (ho.shape[1] - prompt_len) * B
        same = sum(o == h for o, h in zip(outs, ho[:, prompt_len:].tolist()))
        t_ours, t_hf = statistics.median(times["ours"]), statistics.median(times["hf"])
        row = {"B": B, "ours_tok_s": n_ours / t_ours, "hf_tok_s": n_hf / t_hf, "speedup": t_hf / t_ours * n_ours / n_hf,
               "identical_rows": f"{same}/{B}", "reps": reps}  # fmt: skip
        out_rows.append(row)
        print(json.dumps(row), flush=True)


def profile(out_rows: list, kernel_only: bool = False) -> None:
    """Where a decode step's time goes on the `small` flavor: graph replay alone (GPU time), eager kernels by CUDA
    time, and the kernel alone at small batch inside a graph (no launch overhead)."""
    from anyseek.infer.engine import Engine
    from anyseek.kernels.triton.mla_decode import mla_decode
    from anyseek.model.config import ModelConfig
    from anyseek.model.flavors import FLAVORS
    from anyseek.model.transformer import DeepSeekV3

    dev = torch.device("cuda")
    for H, B, S in ((16, 1, 512), (16, 1, 4096), (16, 32, 512), (16, 64, 4096), (16, 128, 4096), (128, 64, 4096)):
        q, cache, table, lens = _case(B, S, H, dev)
        t = _graph_time(lambda a=(q, cache, table, lens): mla_decode(*a, 512), launches=20)
        gbs, tfs = B * S * 576 * 2 / t / 1e9, 2 * B * H * S * 1088 / t / 1e12
        print(f"kernel in a graph H={H} B={B} S={S}: {t * 1e6:.1f} us, {gbs:.0f} GB/s, {tfs:.0f} TFLOP/s", flush=True)
        out_rows.append({"graph_kernel": f"H={H} B={B} S={S}", "us": t * 1e6, "GBps": gbs, "TFLOPs": tfs})
        del q, cache, table, lens
    if kernel_only:
        return
    torch.manual_seed(0)
    model = DeepSeekV3(ModelConfig(**FLAVORS["small"]), device=dev, dtype=torch.bfloat16).eval()
    for B in (1, 32):
        eng = Engine(model, B, 512)
        eng.prefill(list(range(B)), [list(range(1, 129))] * B)
        eng.decode(list(range(B)), [5] * B)
        g = eng._graphs[next(b for b in (1, 2, 4, 8, 16, 24, 32) if b >= B)][0]
        t = _bench(g.replay)
        print(f"small flavor decode step B={B}: graph replay {t * 1e3:.3f} ms", flush=True)
        t0 = time.perf_counter()
        for _ in range(50):
            x = eng.decode(list(range(B)), [5] * B).argmax(-1).tolist()
        step = (time.perf_counter() - t0) / 50
        print(f"  engine.decode + argmax + read ids: {step * 1e3:.3f} ms", flush=True)
        out_rows.append({"B": B, "graph_ms": t * 1e3, "step_ms": step * 1e3})
        eng.use_graphs = False
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.decode(list(range(B)), [5] * B)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        del eng, x


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="(c): tiny flavor on the CPU, fp32")
    ap.add_argument("--batches", default="1,8", help="batch sizes for --cpu")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per peer for --cpu (interleaved; medians)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    both = not (args.kernel or args.e2e or args.profile)
    import transformers

    if args.cpu:
        meta = {"device": "cpu", "threads": 2, "torch": torch.__version__, "transformers": transformers.__version__,
                "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        print(json.dumps(meta))
        rows: list = []
        e2e_cpu(rows, batches=tuple(int(b) for b in args.batches.split(",")), reps=args.reps)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "decode_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print(json.dumps(meta))
    rows: list = []
    if args.profile:
        profile(rows, kernel_only=args.kernel)
    if (args.kernel and not args.profile) or both or args.sweep:
        kernel_grid(rows, args.sweep)
    if args.e2e or both:
        e2e(rows, skip_hf=args.skip_hf)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
