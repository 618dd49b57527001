"""Expert-parallel dispatch + combine (`anyseek.distributed.expert_parallel.dispatch_combine`) against its floors.

    torchrun --nproc-per-node N benchmarks/ep.py [--tokens 8192,16384,32768] [--out DIR]    # N GPUs, NCCL
    python benchmarks/ep.py --cpu-ranks 2                                                   # logic check: gloo, tiny

Per GPU: T tokens of hidden D, each routed to K of E experts (balanced: K distinct experts drawn uniformly per token;
skewed: popularity ~ 1/rank, `kernels.accuracy.moe_routing`), the experts split evenly over the N ranks (EP = N).
Timed, forward only, median of `--reps` after a warm-up, every rank in lockstep (a barrier before each rep):
  fixed shapes      the same with `dispatch_combine_fixed` (no host sync; C = twice a pair's fair share of rows)
  dispatch+combine  anyseek's path with the experts replaced by "multiply by the routing weight": counts
                    all-to-all, the host read of the split sizes, sort by expert, rows all-to-all there and back,
                    fp32 combine. What EP adds to a step beyond the expert matmuls.
  fixed shapes      the same through `dispatch_combine_fixed` (parallel.ep_dispatch=fixed: no host sync; C = twice
                    a pair's fair share of rows, so each exchange moves ep*C rows whatever the routing)
  FP8 dispatch      both of the above as FP8 training sends the rows (fp8=True: E4M3 bytes and power-of-two 1x128
                    scales out, packed and unpacked; the outputs back in bf16)
  a2a floor         two raw `all_to_all_single` of the same [T*K, D] rows in even splits (no counts, no sort, no
                    combine): the bytes the dispatch must move, at NCCL's speed.
  all-gather        the alternative without all-to-all: all-gather every rank's tokens [N*T, D], then
                    reduce-scatter the [N*T, D] outputs back (each rank would run its experts on all tokens).
GB/s: the bytes that leave each rank in the two exchanges, 2 * T*K*D*elt * (N-1)/N, over the time.
Issue 12's target: dispatch+combine within 1.3x the a2a floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

SHAPES = {"16B": (64, 6, 2048), "671B": (256, 8, 7168)}  # name: (E experts, K top-k, D hidden)


def _time(fn, reps: int, device: torch.device) -> float:
    """Median seconds of fn() over reps, every rank starting each rep together."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median: a collective ends when its last rank does
    return float(t)


def one_case(shape: str, T: int, routing: str, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    from anyseek import kernels
    from anyseek.distributed import expert_parallel
    from anyseek.kernels.accuracy import moe_routing

    E, K, D = SHAPES[shape]
    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, D, generator=g).to(device, dtype)
    ids = moe_routing(T, E, K, routing, g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    e_loc = E // n
    gate_up, down = torch.empty(e_loc, 2, D, device=device, dtype=dtype), torch.empty(e_loc, D, 1, device=device,
                                                                                     dtype=dtype)
    real, real8 = kernels.routed_experts, kernels.fp8_routed_experts
    expert_parallel.kernels.routed_experts = lambda rows, i, wt, gu, dn: rows * wt.to(rows.dtype)  # no expert maths
    expert_parallel.kernels.fp8_routed_experts = expert_parallel.kernels.routed_experts
    try:
        with torch.no_grad():  # passthrough experts: every token comes back as sum_k w[t, k] * x[t]
            y = expert_parallel.dispatch_combine(x, ids, w, gate_up, down, None)
            want = (x.float() * w.sum(-1, keepdim=True)).to(dtype)
            torch.testing.assert_close(y, want, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
            t_ep = _time(lambda: expert_parallel.dispatch_combine(x, ids, w, gate_up, down, None), reps, device)
            C = expert_parallel.capacity_rows(T, K, n, e_loc, 2.0)
            flag = torch.zeros((), dtype=torch.bool, device=device)
            y = expert_parallel.dispatch_combine_fixed(x, ids, w, gate_up, down, None, C, flag)
            if not flag:  # (skewed routing can overflow twice the fair share: then only timed)
                torch.testing.assert_close(y, want, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
            t_fixed = _time(lambda: expert_parallel.dispatch_combine_fixed(x, ids, w, gate_up, down, None, C, flag),
                            reps, device)  # fmt: skip
            # FP8 dispatch: the rows arrive as their E4M3 values (at most 1/16 off each, relative)
            y8 = expert_parallel.dispatch_combine(x, ids, w, gate_up, down, None, fp8=True)
            torch.testing.assert_close(y8, want, rtol=0.07, atol=1e-2)
            t_ep8 = _time(lambda: expert_parallel.dispatch_combine(x, ids, w, gate_up, down, None, fp8=True), reps,
                          device)  # fmt: skip
            t_fixed8 = _time(lambda: expert_parallel.dispatch_combine_fixed(x, ids, w, gate_up, down, None, C, flag,
                                                                            fp8=True), reps, device)  # fmt: skip
    finally:
        expert_parallel.kernels.routed_experts, expert_parallel.kernels.fp8_routed_experts = real, real8
    M = T * K
    rows = torch.randn(M, D, generator=g).to(device, dtype)
    back = torch.empty_like(rows)

    def floor():
        dist.all_to_all_single(back, rows)
        dist.all_to_all_single(rows, back)

    gathered = torch.empty(n * T, D, device=device, dtype=dtype)
    scattered = torch.empty(T, D, device=device, dtype=dtype)

    def all_gather():
        dist.all_gather_into_tensor(gathered, x)
        dist.reduce_scatter_tensor(scattered, gathered)

    t_floor, t_ag = _time(floor, reps, device), _time(all_gather, reps, device)
    moved = 2 * M * D * rows.element_size() * (n - 1) / n
    return {"shape": shape, "E": E, "K": K, "D": D, "tokens": T, "routing": routing, "ranks": n,
            "ep_ms": t_ep * 1e3, "fixed_ms": t_fixed * 1e3, "ep8_ms": t_ep8 * 1e3, "fixed8_ms": t_fixed8 * 1e3, "overflow": bool(flag), "floor_ms": t_floor * 1e3, "allgather_ms": t_ag * 1e3,
            "ep_GBps": moved / t_ep / 1e9, "floor_GBps": moved / t_floor / 1e9, "ratio": t_ep / t_floor}


def run(args) -> None:
    """One rank's part of the benchmark (torchrun's variables set)."""
    cpu = args.cpu_ranks > 0
    dist.init_process_group("gloo" if cpu else "nccl")
    rank = dist.get_rank()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not cpu:
        torch.cuda.set_device(device)
    dtype = torch.float32 if cpu else torch.bfloat16
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        for T in tokens:
            for routing in ("balanced", "skewed"):
                rows.append(one_case(shape, T, routing, args.reps, device, dtype))
                if rank == 0:
                    r = rows[-1]
                    print(f"{shape} T={T} {routing}: dispatch+combine {r['ep_ms']:.3f} ms ({r['ep_GBps']:.0f} GB/s), "
                          f"a2a floor {r['floor_ms']:.3f} ms, all-gather {r['allgather_ms']:.3f} ms, "
                          f"ratio {r['ratio']:.2f}", flush=True)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if not cpu else "CPU (gloo)"
        print(f"\n{dist.get_world_size()} x {name}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}, {dtype}, forward only, median of {args.reps}\n")
        print("| shape | tokens/GPU | routing | dispatch+combine ms (GB/s) | fixed shapes, factor 2: ms | "
              "FP8 dispatch: exact / fixed ms | a2a floor ms (GB/s) | vs floor | all-gather + reduce-scatter ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['shape']} (E {r['E']}, K {r['K']}, D {r['D']}) | {r['tokens']} | {r['routing']} | "
                  f"{r['ep_ms']:.3f} ({r['ep_GBps']:.0f}) | {r['fixed_ms']:.3f}"
                  f"{' (overflowed)' if r['overflow'] else ''} | {r['ep8_ms']:.3f} / {r['fixed8_ms']:.3f} | "
                  f"{r['floor_ms']:.3f} ({r['floor_GBps']:.0f}) | "
                  f"{r['ratio']:.2f}x | {r['allgather_ms']:.3f} |")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "ep.json").write_text(json.dumps({"device": name, "torch": torch.__version__,
                                                                 "rows": rows}, indent=1))
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    run(parse(argv))


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384,32768", help="tokens per GPU, comma-separated")
    p.add_argument("--shapes", default="16B,671B", help=f"comma-separated of {', '.join(SHAPES)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    p.add_argument("--cpu-ranks", type=int, default=0, help="spawn this many gloo ranks on the CPU (logic check)")
    return p.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    if args.cpu_ranks and "RANK" not in os.environ:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.cpu_ranks, port, sys.argv[1:]), nprocs=args.cpu_ranks, join=True)
        return
    run(args)


if __name__ == "__main__":
    main()
