"""The cases of benchmarks/train_step.py, each run in a process of its own: `worker` (CPU: warm-up, then timed
steps of one model-only case) and `gpu_case` (GPU: warm-up, timed windows of steps, a profile), with what they build
their step from: the trainer's own step (`trainer_step`), a plain model step with torch's AdamW (`build_case`,
`make_step`), the batches, the FLOPs per batch, and the kernel profile (`profile_steps`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

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
