"""LoRA on the `16B` shape with a bf16 base and with a 4-bit (NF4) base, and the transformers + PEFT + bitsandbytes
4-bit peer: peak GPU memory (allocated, and reserved: what the caching allocator holds) and tokens/s.

    python benchmarks/finetune_4bit.py [--layers 27] [--tokens 4096] [--seqlen 2048] [--steps 5] [--ckpt none|full]
                                       [--step autocast|trainer] [--moments fp32|bf16] [--expandable]
                                       [--peer] [--peer-layers N] [--out results.json]

Random weights (the 16B flavor: Moonlight / DeepSeek-V2-Lite widths, vocab 163840), one optimizer step as the
trainer runs it (bf16 autocast, packed documents, AdamW on the adapters; or with --step trainer, the trainer's
default one-process step: a bf16 working copy of the adapters and FlatAdamW, --moments its moments), LoRA rank 16
on every target (attention, dense MLP, shared and routed experts). The 4-bit base is made tensor by tensor (no bf16
model ever whole on the GPU). First a correctness check on one layer's shapes: the Triton 4-bit kernels (dense linear and the routed experts, with
adapters, forward and gradients) against an fp64 computation over the dequantized weights, next to PyTorch's own
bf16 error (the 2x rule); the script stops if it fails. Then one row per mode and a markdown table.

The peer (--peer): a DeepseekV3 folder of the same shape and random weights (written to --peer-dir, bf16), loaded by
transformers with BitsAndBytesConfig(load_in_4bit, nf4, bf16 compute), PEFT LoRA rank 16 on all linear layers; it
reports how many expert weights bitsandbytes actually quantized. Skipped, saying why, where bitsandbytes, peft or
transformers cannot be imported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
from finetune_memory import batch  # (beside this script: its folder is sys.path[0])

from anyseek.kernels.reference import quant4 as ref4
from anyseek.model.config import ModelConfig
from anyseek.model.mtp import count_targets
from anyseek.model.transformer import DeepSeekV3
from anyseek.train.config import load_run_config
from anyseek.train.memory import estimate
from anyseek.train.optim import build_optimizer
from anyseek.transforms import lora as lora_lib

GiB = 1 << 30


def timed(step, steps: int) -> tuple[float, float]:
    """(ms per step over `steps` steps, the last step's loss)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        last = step()
    last = float(last.detach())
    return (time.perf_counter() - t0) / steps * 1e3, last


# ---------------------------------------------------------------- correctness first


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _grads(fn, leaves, dy):
    """[fn(*leaves), then the gradient of each leaf] for the output gradient dy."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    y = fn(*leaves)
    return [y.detach()] + list(torch.autograd.grad(y, leaves, dy.to(y.dtype)))


def check_kernels(mc: ModelConfig, dev: torch.device, rank: int = 16, tokens: tuple[int, int] = (512, 256)
                  ) -> list[tuple[str, float, float]]:  # fmt: skip
    """(what, err of the Triton kernel in bf16, err of the PyTorch reference in bf16) against the reference in fp64
    (which dequantizes, then computes): the shared experts' gate|up projection and one MoE layer's routed experts."""
    from anyseek.kernels.triton import quant4_linear, quant4_moe

    g = torch.Generator(device=dev).manual_seed(0)
    D, I, E, K = mc.hidden_size, mc.moe_intermediate_size, mc.n_routed_experts, mc.num_experts_per_tok
    T, Fs = tokens[0], 2 * I * mc.n_shared_experts
    W = ref4.quantize4(torch.randn(Fs, D, device=dev, generator=g) * 0.02)
    x = torch.randn(T, D, device=dev, generator=g)
    A, B = torch.randn(rank, D, device=dev, generator=g) * 0.02, torch.randn(Fs, rank, device=dev, generator=g) * 0.02
    dy = torch.randn(T, Fs, device=dev, generator=g)

    def linear(impl, dt):
        return _grads(lambda x_, A_, B_: impl(x_, W, A_, B_, None, 2.0), [t.to(dt) for t in (x, A, B)], dy)

    rows = []
    truth, pt, got = linear(ref4.low_rank_linear, torch.float64), linear(ref4.low_rank_linear, torch.bfloat16), \
        linear(quant4_linear.low_rank_linear, torch.bfloat16)  # fmt: skip
    rows += [(f"linear {n}", _err(a, t), _err(b, t)) for n, a, b, t in zip(("y", "dx", "dA", "dB"), got, pt, truth)]
    T = tokens[1]
    gu = ref4.quantize4(torch.randn(E, 2 * I, D, device=dev, generator=g) * 0.02)
    dn = ref4.quantize4(torch.randn(E, D, I, device=dev, generator=g) * 0.02)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev, generator=g)
    x = torch.randn(T, D, device=dev, generator=g)
    ad = [torch.randn(E, rank, D, device=dev, generator=g) * 0.02, torch.randn(E, 2 * I, rank, device=dev, generator=g)
          * 0.02, torch.randn(E, rank, I, device=dev, generator=g) * 0.02,
          torch.randn(E, D, rank, device=dev, generator=g) * 0.02]  # fmt: skip
    dy = torch.randn(T, D, device=dev, generator=g)

    def experts(impl, dt):
        def fn(x_, *a):
            return impl(x_, ids, w, gu, dn, *a, 2.0)
        return _grads(fn, [x.to(dt)] + [a.to(dt) for a in ad], dy)

    truth = experts(ref4.lora_routed_experts, torch.float64)
    pt, got = experts(ref4.lora_routed_experts, torch.bfloat16), experts(quant4_moe.lora_routed_experts, torch.bfloat16)
    names = ("y", "dx", "dA_gu", "dB_gu", "dA_dn", "dB_dn")
    rows += [(f"experts {n}", _err(a, t), _err(b, t)) for n, a, b, t in zip(names, got, pt, truth)]
    return rows


# ---------------------------------------------------------------- anyseek


def random_model(mc: ModelConfig, dev: torch.device, spec: lora_lib.LoRASpec) -> DeepSeekV3:
    """A random-weight model built parameter by parameter on `dev` (bf16 matrices, fp32 vectors), LoRA's targets
    packed in 4 bits as they are made where spec.base_bits is 4: the bf16 model never exists whole."""
    model = DeepSeekV3(mc, device="meta")
    packed = set(lora_lib.quantized_names(model, spec)) if spec.base_bits == 4 else set()
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        if p.dim() < 2:
            t = (torch.ones if name.endswith("norm.weight") else torch.zeros)(p.shape, device=dev)
        elif name in packed:  # one expert (or one weight) at a time
            rows = p.reshape(-1, *p.shape[-2:])
            t = torch.stack([ref4.quantize4(torch.randn(rows.shape[1:], device=dev, generator=gen,
                                                        dtype=torch.bfloat16) * mc.init_std)
                             for _ in range(rows.shape[0])]).reshape(*p.shape[:-1], -1)  # fmt: skip
        else:
            t = torch.randn(p.shape, device=dev, generator=gen, dtype=torch.bfloat16) * mc.init_std
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    for name, b in list(model.named_buffers()):
        if b.is_meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype, device=dev)
    return model.to(dev)


def anyseek_row(mc: ModelConfig, dev: torch.device, base_bits: int, tokens: int, seqlen: int, steps: int,
                ckpt: str, step_mode: str = "autocast", moments: str = "fp32", graphs: bool = False) -> dict:  # fmt: skip
    """One row. step_mode "autocast": fp32 adapters under bf16 autocast, torch's AdamW, clip_grad_norm_ (the
    measurements of stop 45); "trainer": as `anyseek train` runs one process on a GPU by default (train.working_copy:
    bf16 working copy of the adapters, bf16 activations and gradients, FlatAdamW with `moments` moments and the clip
    folded into its step; train/precision.py), eager, or with `graphs` its forward and backward as one CUDA graph."""
    spec = lora_lib.LoRASpec(rank=16, alpha=32, base_bits=base_bits)
    torch.cuda.reset_peak_memory_stats()
    model = random_model(mc, dev, spec)
    lora_lib.apply_lora(model, spec, torch.bfloat16)
    if ckpt != "none":
        from anyseek.distributed.fsdp import apply_activation_checkpointing

        apply_activation_checkpointing(model, ckpt)
    model.train()
    run_cfg = load_run_config("small", [f"--data.tokens_per_batch={tokens}", f"--data.max_seqlen={seqlen}",
                                        f"--parallel.activation_checkpointing={ckpt}",
                                        f"--train.moments_dtype={moments}"])  # fmt: skip
    ids, targets, cu = batch(mc.vocab_size, tokens, seqlen, dev)
    n = torch.tensor(count_targets(targets.cpu(), cu.cpu(), len(model.mtp)), dtype=torch.float32, device=dev)
    if step_mode == "trainer":
        step = _trainer_step(model, run_cfg, dev, (ids, targets, cu, n), seqlen, graphs)
    else:
        step = _autocast_step(model, run_cfg, dev, (ids, targets, cu, n), seqlen)
    gc.collect()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated()
    build_peak = torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    first = float(step().detach())
    steady = torch.cuda.memory_allocated()  # + the optimizer's state and what a step leaves behind
    step()
    ms, last = timed(step, steps)
    est = estimate(mc, run_cfg, spec, torch.bfloat16, autocast=step_mode == "autocast",
                   working_copy=step_mode == "trainer", triton_experts=True)  # fmt: skip
    stats = torch.cuda.memory_stats()
    base = "4-bit NF4" if base_bits == 4 else "bf16"
    extra = "" if step_mode == "autocast" else f", trainer step (working copy, {moments} moments{', CUDA graph' if graphs else ''})"
    row = {"mode": f"anyseek LoRA r16, {base} base{extra}", "resident_GiB": resident / GiB,
           "build_peak_reserved_GiB": build_peak / GiB, "after_step_GiB": steady / GiB,
           "peak_alloc_GiB": torch.cuda.max_memory_allocated() / GiB,
           "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GiB, "estimate_GiB": est.total / GiB,
           "alloc_retries": stats.get("num_alloc_retries", 0), "ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3,
           "first_loss": first, "last_loss": last}  # fmt: skip
    return row


def _autocast_step(model, run_cfg, dev, data, seqlen):
    ids, targets, cu, n = data
    opt = build_optimizer(model, run_cfg.train, dev)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(ids, cu_seqlens=cu, targets=targets, max_seqlen=seqlen, return_logits=False, num_targets=n)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    return step


def _trainer_step(model, run_cfg, dev, data, seqlen, graphs: bool = False):
    """The trainer's one-process step (train/step.py: `_micro_inner`, `_launch`) without its logging and overlap.
    graphs: the forward and backward replayed as one CUDA graph, as `anyseek train` runs it on a GPU (the batch here
    is one fixed batch, so the graph's inputs never change); where the capture fails, the step says so and stays
    eager (as the trainer does)."""
    from anyseek.train import precision

    ids, targets, cu, n = data
    working = precision.WorkingCopy(model, torch.bfloat16, accumulate=False)
    opt = precision.build_flat_adamw(working, run_cfg.train)
    max_norm = run_cfg.train.grad_clip

    def micro():
        with working.active():
            out = model(ids, cu_seqlens=cu, targets=targets, max_seqlen=seqlen, return_logits=False, num_targets=n)
            out.loss.backward()
            working.collect()
        return out.loss.detach()

    def apply(loss):
        opt.grad_scale = ((working.grad_norm() + 1e-6) / max_norm).clamp(min=1.0)
        opt.step()
        return loss

    if graphs:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # (Triton compiles, cuBLAS sets up, the allocator warms)
                micro()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_loss = micro()
        except Exception as e:  # noqa: BLE001 - reported: the row is then the eager step
            print(f"CUDA graph capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); eager", flush=True)
            graph = None
        if graph is not None:
            return lambda: apply((graph.replay(), static_loss)[1])
    return lambda: apply(micro())


# ---------------------------------------------------------------- the peer


def peer_row(mc: ModelConfig, dev: torch.device, tokens: int, seqlen: int, steps: int, folder: str,
             ckpt: str = "none") -> dict:  # fmt: skip
    """transformers + PEFT + bitsandbytes 4-bit on the same shapes. Like for like where PEFT allows: LoRA r16 on
    every linear and, where PEFT has `target_parameters` (0.17+), on the fused routed experts too (transformers v5
    keeps them as 3-D parameters, which `all-linear` misses: stop 47's peer trained no expert adapters); gradient
    checkpointing where `ckpt` asks for recomputation (the usual QLoRA setup). The row says what it trained."""
    try:
        import bitsandbytes  # noqa: F401
        import peft
        import transformers
    except ImportError as e:
        return {"mode": "transformers + PEFT + bitsandbytes 4-bit", "skipped": f"cannot import: {e}"}
    from pathlib import Path

    from anyseek import hf

    if not (Path(folder) / "config.json").is_file():
        torch.manual_seed(0)
        cpu_model = DeepSeekV3(mc, dtype=torch.bfloat16)
        hf.save_pretrained(cpu_model, folder, dtype=torch.bfloat16)
        del cpu_model
        gc.collect()
    torch.cuda.reset_peak_memory_stats()
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                                              device_map={"": dev.index or 0})  # fmt: skip
    four = sum(p.numel() * 2 for n, p in model.named_parameters() if p.dtype == torch.uint8)  # 2 weights a byte
    expert_16 = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.is_floating_point())
    expert_4 = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n and p.dtype == torch.uint8)
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    if "target_parameters" in peft.LoraConfig.__dataclass_fields__:
        lora["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    try:
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    except Exception as e:  # noqa: BLE001 - an older PEFT that cannot adapt these parameters: linears only, said
        print(f"peer: PEFT could not target the fused experts ({type(e).__name__}: {str(e)[:120]}); linears only")
        lora.pop("target_parameters", None)
        model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    adapters = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    expert_adapters = sum(v for n, v in adapters.items() if ".experts." in n)
    if ckpt != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = batch(mc.vocab_size, tokens, seqlen, dev)[0].view(-1, seqlen)
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step().detach())
    ms, last = timed(step, steps)
    row = {"mode": "transformers + PEFT + bitsandbytes 4-bit", "resident_GiB": resident / GiB,
           "peak_alloc_GiB": torch.cuda.max_memory_allocated() / GiB,
           "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GiB, "ms_per_step": ms,
           "tokens_per_s": tokens / ms * 1e3, "first_loss": first, "last_loss": last,
           "weights_in_4bit_M": four / 1e6, "expert_weights_4bit_M": expert_4 / 1e6,
           "expert_weights_16bit_M": expert_16 / 1e6, "adapters_M": sum(adapters.values()) / 1e6,
           "expert_adapters_M": expert_adapters / 1e6, "checkpointing": ckpt != "none"}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27, help="decoder layers of the 16B shape (27: the whole model)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ckpt", default="none", choices=("none", "selective", "full"),
                    help="parallel.activation_checkpointing for the anyseek rows")
    ap.add_argument("--skip-bf16", action="store_true", help="no bf16-base row (e.g. a GPU smaller than ~40 GB)")
    ap.add_argument("--step", default="autocast", choices=("autocast", "trainer"),
                    help="autocast: fp32 adapters under autocast, torch's AdamW; trainer: anyseek train's default "
                         "one-process step (bf16 working copy, FlatAdamW)")
    ap.add_argument("--graphs", action="store_true", help="--step trainer: forward and backward as one CUDA graph, "
                    "as anyseek train runs them on a GPU")
    ap.add_argument("--moments", default="fp32", choices=("fp32", "bf16"), help="train.moments_dtype (--step trainer)")
    ap.add_argument("--expandable", action="store_true",
                    help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less held by the caching allocator)")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--peer-layers", type=int, default=None, help="default: --layers")
    ap.add_argument("--peer-dir", default="/tmp/anyseek-16B-random")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.expandable:  # (read when CUDA first allocates: before anything does)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    dev = torch.device("cuda")
    mc = ModelConfig.from_name("16B", num_hidden_layers=args.layers, num_nextn_predict_layers=0)
    table = check_kernels(mc, dev)
    ok = all(err <= 2 * err_pt + 1e-3 for _, err, err_pt in table)
    print("correctness (what, err Triton bf16, err PyTorch bf16; vs fp64):")
    for what, err, err_pt in table:
        print(f"  {what:16s} {err:.3e} {err_pt:.3e} {'ok' if err <= 2 * err_pt + 1e-3 else 'FAIL'}")
    if not ok:
        raise SystemExit("the 4-bit kernels fail the 2x rule: no timings")
    rows = []
    for bits in ((4,) if args.skip_bf16 else (16, 4)):
        t0 = time.perf_counter()
        rows.append(anyseek_row(mc, dev, bits, args.tokens, args.seqlen, args.steps, args.ckpt, args.step,
                                args.moments, args.graphs))  # fmt: skip
        gc.collect()  # the row's model and optimizer went with its frame
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.peer:
        pc = ModelConfig.from_name("16B", num_hidden_layers=args.peer_layers or args.layers,
                                   num_nextn_predict_layers=0)  # fmt: skip
        rows.append(peer_row(pc, dev, args.tokens, args.seqlen, args.steps, f"{args.peer_dir}-{pc.num_hidden_layers}",
                             args.ckpt))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | 16B shape, {args.layers} layers | "
          f"{args.tokens} tokens/step | activation checkpointing {args.ckpt} | step {args.step}, {args.moments} moments"
          f"{' | expandable segments' if args.expandable else ''}")
    print("| mode | resident GiB | peak allocated GiB | peak reserved GiB | estimate GiB | ms/step | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['mode']} | skipped: {r['skipped']} | | | | | |")
            continue
        print(f"| {r['mode']} | {r['resident_GiB']:.2f} | {r['peak_alloc_GiB']:.2f} | {r['peak_reserved_GiB']:.2f} | "
              f"{r.get('estimate_GiB', float('nan')):.2f} | {r['ms_per_step']:.0f} | {r['tokens_per_s']:,.0f} |")
    peer = next((r for r in rows if r["mode"].startswith("transformers") and "skipped" not in r), None)
    if peer:
        print(f"peer: {peer['adapters_M']:.1f}M adapter weights, {peer['expert_adapters_M']:.1f}M of them on the routed "
              f"experts; gradient checkpointing {'on' if peer['checkpointing'] else 'off'}")
        print(f"peer: {peer['weights_in_4bit_M']:.0f}M weights in 4 bits; routed experts "
              f"{peer['expert_weights_4bit_M']:.0f}M"
              f" in 4 bits, {peer['expert_weights_16bit_M']:.0f}M left in 16 bits")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "correctness": table, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
