"""Training throughput: anyseek vs Hugging Face transformers' DeepseekV3ForCausalLM, on CPU or one GPU.

Same model config (`--flavor`, default tiny), same weights (copied through a saved checkpoint), same batches (the built-in
Wikipedia sample), same optimizer (AdamW, foreach), same thread count, same run. One step = forward + backward +
clip + AdamW step. transformers has no multi-token prediction and no packed-document masking, so the like-for-like rows
run anyseek with MTP off on the same [B, S] rows; the rows after show anyseek as it really trains (packed documents,
MTP on).

CPU (the default): every case runs in a fresh process of its own, once per round, the cases taking turns round after
round (`--rounds`), so that no case inherits another's heap and a slow minute on a shared machine hits every case
alike. anyseek's cases run as `anyseek train` runs them, with glibc malloc tuned (`anyseek.runtime`); transformers
runs as it comes, and once more with the same allocator setting (`--allocator`).

    python benchmarks/train_step.py                                                   # CPU, tiny (issue 4's table)
    python benchmarks/train_step.py --device cuda --flavor small --tokens 8192 --seqlen 2048 --dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# case -> (row name, layout)
CASES = {
    "hf": ("transformers DeepseekV3ForCausalLM (sdpa)", "[B,S] rows"),
    "hf-tuned": ("transformers DeepseekV3ForCausalLM (sdpa), glibc malloc tuned as anyseek does", "[B,S] rows"),
    "hf-eager": ("transformers DeepseekV3ForCausalLM (eager)", "[B,S] rows"),
    "rows": ("anyseek, MTP off", "[B,S] rows"),
    "packed": ("anyseek, MTP off, packed documents", "packed varlen"),
    "mtp": ("anyseek, MTP on, packed documents (as trained)", "packed varlen"),
    "trainer": ("`anyseek train` step as shipped (clip, bias update; GPU: fp32 master + bf16 working copy)",
                "packed varlen"),
    "trainer-eager": ("same step without CUDA graphs (train.cuda_graphs=false)", "packed varlen"),
    "trainer-autocast": ("same step, bf16 autocast over the fp32 weights (train.working_copy=false)", "packed varlen"),
    "trainer-fsdp": ("same step under torchrun, 1 rank: FSDP2 (fully_shard; bf16 shards, fp32 masters beside them), "
                     "graphed, overlapped", "packed varlen"),
    "trainer-fsdp-fp32shards": ("the torchrun step with fp32 shards cast to bf16 at each gather "
                                "(parallel.shard_dtype=fp32, as before stop 36)", "packed varlen"),
    "trainer-fsdp-torchadamw": ("the torchrun step with fp32 shards and torch's fused AdamW (as before stop 35) "
                                "instead of TensorAdamW", "packed varlen"),
    "trainer-fsdp-eager": ("the torchrun step without CUDA graphs (train.cuda_graphs=false)", "packed varlen"),
    "trainer-fsdp-keep": ("the torchrun step keeping the gathered weights from forward to backward "
                          "(parallel.reshard_after_forward=false: one gather per step, not two)", "packed varlen"),
    "trainer-fsdp-sync": ("the torchrun step with train.overlap_steps=false", "packed varlen"),
    "trainer-fsdp-overlap": ("the torchrun step with train.overlap_steps=true (step N+1 queued before N's loss is "
                             "read; the default since stop 31)", "packed varlen"),
    "trainer-compile": ("same step with train.compile=true", "packed varlen"),
    "trainer-lora": ("same step, LoRA rank 16 on every target (train.lora_rank=16; base frozen in bf16)",
                     "packed varlen"),
    "trainer-bf16m": ("same step, AdamW moments in bf16 (train.moments_dtype=bf16)", "packed varlen"),
    "trainer-sync": ("`anyseek train` step, one at a time (train.overlap_steps=false)", "packed varlen"),
    "trainer-lora-sync": ("LoRA step, one at a time (train.overlap_steps=false)", "packed varlen"),
    "trainer-lora-overlap": ("LoRA step with train.overlap_steps=true (fused AdamW in one process: off by default)",
                             "packed varlen"),
}

# kernel name -> category for --profile (first match wins; lower-case substrings)
CATEGORIES = [
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("norms/reductions", ("rmsnorm", "rms_norm", "layer_norm")),
    ("attention", ("_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_delta_kernel", "flash", "fmha", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "_mm_")),
    ("norms/reductions", ("rmsnorm", "norm", "reduce", "softmax", "logsumexp")),
    ("index/scatter/sort", ("index", "scatter", "gather", "sort", "topk", "radix", "scan", "cumsum", "embedding")),
    ("copies/casts", ("copy", "cast", "memcpy", "memset", "fill", "cat", "_to_copy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_")),
]


LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync"}


def categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_steps(step, items, out_path: Path | None = None) -> tuple[list[int], dict[str, float], str]:
    """Profile `step` over `items` (already warm): ((host launches, GPU kernels) per step, GPU ms per step by
    category, the top-25 kernel table). Host launches: kernel, graph, copy and memset calls the host makes (a CUDA
    graph replay is one); GPU kernels: the kernels the GPU runs (a graph's count one each). User annotations on the
    GPU timeline (e.g. `Optimizer.step#AdamW.step`) span kernels already counted and are left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in items:
            step(b)
        torch.cuda.synchronize()
    kernels, host, cats, spans = 0, 0, {}, []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if getattr(e, "is_user_annotation", False) or e.name.startswith(("Optimizer.", "ProfilerStep")):
                continue
            kernels += 1
            spans.append((e.time_range.start, e.time_range.end, e.name))
            cats[categorize(e.name)] = cats.get(categorize(e.name), 0.0) + e.device_time / 1e3 / len(items)
        elif e.name in LAUNCH_CALLS:
            host += 1
    spans.sort()  # the GPU's busy time: the union of the kernels' intervals (streams may overlap), and its gaps
    first = end = spans[0][0] if spans else 0.0
    busy, last, gaps = 0.0, "", []
    for a, b, name in spans:
        if a > end:
            gaps.append((a - end, last, name))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, last = b, name
    gaps.sort(reverse=True)
    head = (f"GPU busy {busy / 1e3 / len(items):.2f} ms per step of {(end - first) / 1e3 / len(items):.2f} ms from "
            f"its first kernel to its last (union of the kernels' intervals); longest idle stretches:\n"
            + "".join(f"  idle {g / 1e3:.3f} ms between {x[:60]} and {y[:60]}\n" for g, x, y in gaps[:8]))
    averages = prof.key_averages()
    table = head + averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    if out_path is not None:  # every kernel, for comparing two cases' files
        out_path.write_text(head + averages.table(sort_by="cuda_time_total", row_limit=-1, max_name_column_width=120))
    return [host // len(items), kernels // len(items)], dict(sorted(cats.items(), key=lambda kv: -kv[1])), table


def trainer_step(args, data_dir: Path, tmp: Path, case: str = "trainer"):
    """(step function taking a dummy item, trainer, flops): one optimizer step exactly as `anyseek train` runs it
    (Trainer.advance: forward, backward, clip, NaN check, AdamW, routing-bias update, the overlap of one step with
    the next), its batches from the trainer's own loader. `tr.engine.flush()` settles the last step."""
    from anyseek.train.config import load_run_config
    from anyseek.train.trainer import Trainer

    overrides = [f"--data.path={json.dumps(str(data_dir))}", f"--data.tokens_per_batch={args.tokens}",
                 f"--data.max_seqlen={args.seqlen}", f"--train.device={json.dumps(args.device)}",
                 "--train.tensorboard=false",
                 f"--train.compile={'true' if args.compile or case == 'trainer-compile' else 'false'}"]
    name = case
    if case.endswith("-sync"):  # the host reads each step's loss before it queues the next
        overrides.append("--train.overlap_steps=false")
        case = case.removesuffix("-sync")
    if case.endswith("-overlap"):  # ... and asked for explicitly (`auto` is on under torchrun too since stop 31)
        overrides.append("--train.overlap_steps=true")
        case = case.removesuffix("-overlap")
    if case == "trainer-fsdp-eager":
        overrides.append("--train.cuda_graphs=false")
        case = "trainer-fsdp"
    if case == "trainer-fsdp-torchadamw":  # build_optimizer takes TensorAdamW only where the Triton kernel is chosen
        from anyseek.kernels import registry

        registry.set_backend("adamw_tensors", "reference")
        overrides.append("--parallel.shard_dtype=fp32")
        case = "trainer-fsdp"
    if case == "trainer-fsdp-fp32shards":
        overrides.append("--parallel.shard_dtype=fp32")
        case = "trainer-fsdp"
    if case == "trainer-fsdp-keep":
        overrides.append("--parallel.reshard_after_forward=false")
        case = "trainer-fsdp"
    if case == "trainer-eager":
        overrides.append("--train.cuda_graphs=false")
    if case == "trainer-autocast":
        overrides.append("--train.working_copy=false")
    if case == "trainer-bf16m":
        overrides.append("--train.moments_dtype=bf16")
    if case == "trainer-lora":  # the base: one full step of this same run, saved as step-1 (the data's tokenizer)
        base_cfg = load_run_config(args.flavor, overrides + ["--train.max_steps=1", "--train.cuda_graphs=false"])
        if not (tmp / "lora-base" / "step-1").is_dir():  # made once per benchmark run (--repeat reuses it)
            Trainer(base_cfg, tmp / "lora-base", log=lambda *a: None).run()
            gc.collect()  # that trainer's tensors must not count in this case's peak memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        overrides += [f"--train.init={json.dumps(str(tmp / 'lora-base' / 'step-1'))}", "--train.lora_rank=16"]
    if case == "trainer-fsdp":  # what torchrun sets for one process: the trainer then wraps the model with FSDP2
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    cfg = load_run_config(args.flavor, overrides)
    tr = Trainer(cfg, tmp / f"{name}-run", log=lambda *a: None)
    batches = iter(tr.train_loader)
    flops, tr.bench_losses = [], []

    def step(_):
        for o in tr.engine.advance(batches):  # the step queued before this one, with the overlap
            flops.append(o.flops)
            tr.bench_losses.append(o.values["loss"])
            if not o.ok:
                raise RuntimeError("non-finite step in the benchmark")

    return step, tr, flops


def batches(data_dir: Path, tokens: int, seqlen: int, n: int):
    from anyseek.data.loader import PackedLoader

    loader = iter(PackedLoader(data_dir, split="train", tokens_per_batch=tokens, max_seqlen=seqlen, seed=0))
    out = []
    while len(out) < n:
        b = next(loader)
        if b.input_ids.numel() == tokens:
            out.append(b)
    return out


def _flops(model, batch, context: int | None) -> float:
    """Training FLOPs of one batch by the trainer's formula; context: the attention span per token of [B, S] rows,
    None for packed documents (their mean span)."""
    if context is None:
        lens = batch.cu_seqlens.diff().double()
        context = float((lens * lens).sum() / lens.sum())
    a = model.flops_per_token(0)
    return batch.input_ids.numel() * (a + (model.flops_per_token(1) - a) * context)


_FLOP_MODELS: dict = {}


def _flops_cfg(cfg, batch, context: int | None) -> float:
    """_flops for a model config (MTP not counted), the model built once on the meta device."""
    from anyseek.model.transformer import DeepSeekV3

    key = id(cfg)
    if key not in _FLOP_MODELS:
        with torch.device("meta"):
            _FLOP_MODELS[key] = DeepSeekV3(dataclasses.replace(cfg, num_nextn_predict_layers=0))
    return _flops(_FLOP_MODELS[key], batch, context)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model, forward):
    fused = next(model.parameters()).device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if fused else {"foreach": True}))

    def step(b):
        loss = forward(b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def build_case(case: str, ckpt: Path, cfg, rows_shape, dtype):
    """(model, forward) for one case; the weights come from the shared checkpoint (MTP's are fresh: the checkpoint
    has none)."""
    from anyseek.hf import load_pretrained
    from anyseek.model.transformer import DeepSeekV3

    if case.startswith("hf"):
        import transformers

        impl = "eager" if case == "hf-eager" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), attn_implementation=impl,
                                                                  dtype=torch.float32)
        forward = lambda b: model(input_ids=b.input_ids.view(rows_shape), labels=b.input_ids.view(rows_shape)).loss
    elif case == "rows":
        model = load_pretrained(ckpt)
        forward = lambda b: model(b.input_ids.view(rows_shape), targets=b.targets.view(rows_shape),
                                  return_logits=False).loss
    else:
        model = load_pretrained(ckpt) if case == "packed" else DeepSeekV3(cfg)
        if case == "mtp":
            model.load_state_dict(load_pretrained(ckpt).state_dict(), strict=False)  # trunk as the others
        forward = lambda b: model(b.input_ids, cu_seqlens=b.cu_seqlens, targets=b.targets,
                                  max_seqlen=b.max_seqlen, return_logits=False).loss
    return model.to(dtype=dtype).train(), forward


def worker(args) -> None:
    """One case, one process: warm-up then timed steps; prints one JSON line of step times (seconds)."""
    torch.set_num_threads(args.threads)
    if args.tuned:
        from anyseek.runtime import tune_cpu_allocator

        tune_cpu_allocator()
    torch.manual_seed(0)
    from anyseek.hf import config_from_hf

    spec = json.loads(args.worker)
    cfg = config_from_hf(spec["config"])
    data = batches(Path(spec["data"]), args.tokens, args.seqlen, spec["first"] + args.steps)[spec["first"]:]
    warm = batches(Path(spec["data"]), args.tokens, args.seqlen, args.warmup)
    model, forward = build_case(spec["case"], Path(spec["ckpt"]), cfg, (args.tokens // args.seqlen, args.seqlen),
                                torch.float32)
    step = make_step(model, forward)
    for b in warm:
        step(b)
    times = []
    for b in data:
        t0 = time.perf_counter()
        step(b)
        times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps(times), flush=True)


def gpu_case(args) -> None:
    """One case on the GPU, in its own process: warm-up, timed steps, then (last, so that its hooks slow no timed
    step) a profile of 3 steps for launches and the time by kernel category. Prints one RESULT JSON line."""
    from anyseek.hf import config_from_hf
    from anyseek.train.metrics import peak_flops

    torch.manual_seed(0)
    spec = json.loads(args.gpu_case)
    case, device = spec["case"], torch.device(args.device)
    cfg = config_from_hf(spec["config"])
    peak = peak_flops(device)
    data = batches(Path(spec["data"]), args.tokens, args.seqlen, args.steps + args.warmup)
    if case.startswith("trainer"):
        step, tr, flops = trainer_step(args, Path(spec["data"]), Path(spec["tmp"]), case)
        items = [None] * len(data)
    else:
        model, forward = build_case(case, Path(spec["ckpt"]), cfg, (args.tokens // args.seqlen, args.seqlen),
                                    torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        model.to(device)
        step = make_step(model, forward)
        items = [b.to(device) for b in data]
        ctx = args.seqlen if case == "rows" or case.startswith("hf") else None
        flops = [_flops_cfg(cfg, b, ctx) for b in data]
    torch.cuda.reset_peak_memory_stats(device)
    for b in items[:args.warmup]:
        step(b)
    # the timed steps run back to back, as `anyseek train` runs them (the host prepares the next step while the
    # GPU finishes this one); a sync only at the end of each window of --window steps: t = ms per step per window
    t, timed = [], items[args.warmup:]
    for i in range(0, len(timed), args.window):
        chunk = timed[i:i + args.window]
        _sync(device)
        t0 = time.perf_counter()
        for b in chunk:
            step(b)
        _sync(device)
        t.append((time.perf_counter() - t0) / len(chunk))
    mem = torch.cuda.max_memory_allocated(device) / 2**30
    if case.startswith("trainer"):  # the step must really train (a wrapper that drops gradients is fast and wrong)
        tr.engine.flush()
        losses = list(tr.bench_losses)
        k = min(5, len(losses) // 2)
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        print(f"{case}: mean loss of the first {k} steps {first:.4f}, of the last {k} {last:.4f}", flush=True)
        if len(losses) >= 10 and not last < first:  # fewer steps: too early in warm-up to insist
            raise RuntimeError(f"{case}: the loss did not go down ({first:.4f} -> {last:.4f}): not training")
        g = tr.graphs
        if g is not None:
            print(f"{case}: CUDA graphs {'on' if g.enabled else 'OFF'}: {len(g.graphs)} captured, {g.replays} "
                  f"micro-batches replayed, {g.eager} eager warm-ups", flush=True)
    out = Path(args.profile) / f"{case}-{args.tokens}.txt" if args.profile else None
    launches, cats, table = profile_steps(step, items[:3], out)
    mfu = statistics.median(flops[args.warmup:len(items)]) / statistics.median(t) / peak if peak else float("nan")
    print("RESULT " + json.dumps({"times": t, "mem": mem, "mfu": mfu, "launches": launches, "cats": cats,
                                  "table": table if case.startswith("trainer") else ""}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--data", default=None, help="prepared data folder (default: the built-in sample)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--seqlen", type=int, default=512, help="row length for the [B, S] layout / max document segment")
    p.add_argument("--steps", type=int, default=24, help="timed steps per case (CPU: in all rounds together)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=5, help="GPU: steps timed back to back between two syncs (1: a "
                   "sync around every step); the table gives the median over windows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="GPU: parameter dtype of both models")
    p.add_argument("--vocab", type=int, default=4096, help="BPE size when preparing the built-in sample")
    p.add_argument("--skip-eager", action="store_true")
    p.add_argument("--rounds", type=int, default=4, help="CPU: rounds of one fresh process per case")
    p.add_argument("--repeat", type=int, default=1, help="GPU: run the cases in turn this many times (the table: "
                   "medians over all; each round's ratios printed)")
    p.add_argument("--allocator", default="as-shipped", choices=["as-shipped", "default", "tuned"],
                   help="CPU: as-shipped = anyseek tuned as `anyseek train` does, transformers both ways; default = "
                        "nothing tuned; tuned = everything tuned")
    p.add_argument("--cases", default="", help="comma-separated cases to run (default: all for the device): "
                   + ", ".join(CASES))
    p.add_argument("--compile", action="store_true", help="trainer case: train.compile=true")
    p.add_argument("--profile", default="", help="GPU: folder for the trainer step's kernel table (printed too)")
    p.add_argument("--json", default="", help="write the results as JSON to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpu-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.gpu_case:
        return gpu_case(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)

    import transformers

    from anyseek.data.prepare import ensure_prepared
    from anyseek.data.shards import read_manifest
    from anyseek.hf import config_to_hf, save_pretrained
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    data_dir = Path(args.data) if args.data else ensure_prepared("wiki-sample", vocab_size=args.vocab)
    vocab = read_manifest(data_dir)["vocab_size"]
    cfg = dataclasses.replace(ModelConfig.from_name(args.flavor), vocab_size=vocab)
    cfg_nomtp = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    results = []

    def record(case, times, mem, tuned=None):
        name, layout = CASES[case]
        med = statistics.median(times)
        results.append((case, name, layout, med * 1e3, args.tokens / med, mem, tuned))
        print(f"  {name:78s} {med * 1e3:8.1f} ms/step {args.tokens / med:10,.0f} tok/s", flush=True)

    cases = ["hf"] + ([] if args.skip_eager else ["hf-eager"]) + ["rows", "packed", "mtp"]
    if device.type == "cuda":
        cases.append("trainer")
    if args.cases:
        cases = [c for c in args.cases.split(",") if c]
        unknown = [c for c in cases if c not in CASES]
        if unknown:  # before any case runs (a name missing here used to fail only when its row was printed)
            raise SystemExit(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    extra = {}  # case -> (mfu, launches per step, {category: ms})
    with tempfile.TemporaryDirectory() as tmp:
        base = DeepSeekV3(cfg_nomtp)
        ckpt = Path(tmp) / "ckpt"
        save_pretrained(base, ckpt)
        if device.type == "cpu":
            plan = []  # (case, allocator tuned)
            for case in cases:
                anyseek_case = not case.startswith("hf")
                if args.allocator == "as-shipped":
                    plan.append((case, anyseek_case))
                    if case == "hf":
                        plan.append(("hf-tuned", True))
                else:
                    plan.append((case, args.allocator == "tuned"))
            times = {c: [] for c, _ in plan}
            per_round = max(1, args.steps // args.rounds)
            for r in range(args.rounds):
                for case, tuned in plan:
                    spec = {"case": case, "ckpt": str(ckpt), "data": str(data_dir),
                            "config": config_to_hf(cfg), "first": r * per_round}
                    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--steps", str(per_round),
                           "--warmup", str(args.warmup), "--tokens", str(args.tokens), "--seqlen", str(args.seqlen),
                           "--threads", str(args.threads)] + (["--tuned"] if tuned else [])
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode != 0 or not line:
                        raise SystemExit(f"case {case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
                    times[case] += json.loads(line[0][len("RESULT "):])
                print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{c} {statistics.median(t) * 1e3:.0f} ms" for c, t in times.items()), flush=True)
            for case, tuned in plan:
                record(case, times[case], float("nan"), tuned)
        else:
            # each case in a fresh process: no case inherits another's allocator state or a profiler's hooks;
            # --repeat R: the cases take turns R times (the peer's speed follows the host, which drifts)
            gathered, mems = {c: [] for c in cases}, {}
            for rnd in range(args.repeat):
                this = {}
                for case in cases:
                    spec = {"case": case, "ckpt": str(ckpt), "data": str(data_dir), "config": config_to_hf(cfg),
                            "tmp": tmp}
                    cmd = [sys.executable, __file__, "--gpu-case", json.dumps(spec)] + sys.argv[1:]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode != 0 or not line:
                        raise SystemExit(f"case {case} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
                    r = json.loads(line[0][len("RESULT "):])
                    for x in out.stdout.splitlines():
                        if "mean loss of the first" in x or "CUDA graphs" in x:
                            print(x, flush=True)
                    if args.profile and rnd == args.repeat - 1:
                        print(r["table"])
                    extra[case] = (r["mfu"], r["launches"], r["cats"])
                    gathered[case] += r["times"]
                    mems[case] = max(mems.get(case, 0.0), r["mem"])
                    this[case] = statistics.median(r["times"]) * 1e3
                    # each case's numbers as soon as it ends (the table comes at the end; a timeout keeps these)
                    print(f"done {case}: {this[case]:.1f} ms/step, {args.tokens / this[case] * 1e3:,.0f} tokens/s, "
                          f"MFU {r['mfu']:.1%}, peak {r['mem']:.1f} GiB", flush=True)
                if args.repeat > 1:
                    ratios = [f"{c} {this['hf'] / ms:.2f}x" for c, ms in this.items() if c != "hf" and "hf" in this]
                    print(f"round {rnd + 1}/{args.repeat}: " + ", ".join(f"{c} {ms:.1f} ms" for c, ms in this.items())
                          + (f" (vs transformers in this round: {', '.join(ratios)})" if ratios else ""), flush=True)
            for case in cases:
                record(case, gathered[case], mems[case])

    ref = {r[0]: r[4] for r in results}  # case -> tokens/s
    hf_plain = ref.get("hf")
    hf_tuned = ref.get("hf-tuned")
    print()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"Training step, {args.flavor} flavor ({base.num_parameters() / 1e6:.2f}M parameters), {args.tokens} "
          f"tokens/step, {args.dtype} parameters, {where}")
    method = (f"each case in a fresh process per round, {args.rounds} rounds, allocator {args.allocator}"
              if device.type == "cpu" else (f"each case in a fresh process, steps back to back in windows of "
                                            f"{args.window} (median window), profiled after its timed steps"))
    print(f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, median of {args.steps} steps after {args.warmup} warm-up, {method}")
    print()
    if device.type == "cuda":
        print("MFU = training FLOPs (6 x active parameters + causal attention over real document lengths, "
              "model.flops_per_token) / time / dense bf16 peak (train.metrics.peak_flops)")
        print()
        print("| path | layout | ms/step | tokens/s | vs transformers | MFU | host launches / GPU kernels per step "
              "| peak GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for case, name, layout, ms, tps, mem, _ in results:
            mfu, (host, kernels), _ = extra.get(case, (float("nan"), (0, 0), {}))
            vs = f"{tps / hf_plain:.2f}x" if hf_plain else "-"
            print(f"| {name} | {layout} | {ms:.1f} | {tps:,.0f} | {vs} | {mfu:.1%} | {host} / {kernels} | {mem:.1f} |")
        print()
        for case, (_, _, cats) in extra.items():
            print(f"{case}: GPU ms/step by kernel category: " + ", ".join(f"{k} {v:.1f}" for k, v in cats.items()))
        if args.json:
            Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__,
                                                   "transformers": transformers.__version__, "tokens": args.tokens,
                                                   "results": results, "extra": extra}, indent=1))
        return
    tuned_col = hf_tuned is not None
    print("| path | layout | malloc | ms/step | tokens/s | vs transformers |" + (" vs transformers, malloc tuned |"
                                                                              if tuned_col else " peak GiB |"))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, name, layout, ms, tps, mem, tuned in results:
        malloc = "-" if tuned is None else ("tuned" if tuned else "default")
        last = f" {tps / hf_tuned:.2f}x |" if tuned_col else f" {mem:.1f} |"
        vs = f"{tps / hf_plain:.2f}x" if hf_plain else "-"
        print(f"| {name} | {layout} | {malloc} | {ms:.1f} | {tps:,.0f} | {vs} |{last}")


if __name__ == "__main__":
    main()
