"""The expected peak memory of a training run, printed before it starts, with the knob to turn when it won't fit.

    est = estimate(model_cfg, run_cfg, lora_spec=None)
    print(est.table())

Parameters are counted exactly on a model built on the meta device (LoRA applied there too); activations come from
a per-token, per-layer count of the tensors autograd keeps. Against peaks measured on an H100 (docs/benchmarks.md):
the default GPU step (`train.working_copy`, CUDA graphs) of the `small` flavor at 8,192 tokens 10.49 GiB
estimated, 10.5 measured (with train.moments_dtype=bf16 8.68 estimated, 8.7 measured; 32,768 tokens 17.66 and
17.6), and LoRA rank 16 on it 4.16 estimated, 4.1 measured (32,768 tokens: 19.5 estimated,
19.6 measured before the loss held one chunk of logits at a time); the autocast step (`train.working_copy=false`)
is estimated ~15% low (its fp32 residual and the casts autocast keeps are counted only in part; not re-measured
since the fusions).

On a CPU the estimate is of the process's resident memory (what runs it out of RAM), against peak RSS measured on
2 cores (2026-11-27, the Wikipedia sample, two steps): `tiny` (4,096 tokens, with its evaluation, checkpoint and
sample) 0.78 GiB estimated, 0.79 measured; `small` at 1,024 / 2,048 / 4,096 tokens 10.34 / 11.12 / 14.02
estimated, 10.93 / 11.89 / 13.56 measured; at its 8,192 20.21 estimated, 18.7 measured (issue 38). The GPU count
left out there: the process itself (Python, torch and its libraries, the data: ~0.45 GiB, read at the report), the
CPU kernels' larger saved tensors (padded attention buckets and softmax probabilities, the reference SwiGLU's
intermediate products: `_cpu_layer_bytes`), and the optimizer step's buffers (see `Estimate.total`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from anyseek.data.prepare import default_out
from anyseek.kernels import in_features4
from anyseek.model.loss import chunk_rows
from anyseek.model.transformer import DeepSeekV3
from anyseek.train import precision
from anyseek.transforms import lora as lora_lib
from anyseek.transforms.lora import LoRAExperts

GiB = 1 << 30


# On a CPU the gradients are freed after every step and the foreach AdamW allocates one more fp32 buffer per weight
# in its step, so the backward (activations, plus the output head's gradient the loss forms in the forward) and the
# step (gradients + that buffer) are never alive together. glibc's heap, kept whole (train.tune_allocator), reuses
# the freed blocks of one phase for the other only in part: the peak RSS measured (`small`, 1,024 to 4,096 tokens;
# `tiny`) is the larger phase plus about half of the smaller one.
PHASE_REUSE = 0.5


@dataclass
class Estimate:
    weights: float  # bytes
    grads: float
    optimizer: float
    weight_copies: float  # low-precision weight copies the backward keeps (autocast casts, merged LoRA weights)
    activations: float
    lora: bool
    activations_full_checkpointing: float = 0.0  # what activations would be with parallel.activation_checkpointing=full
    process: float = 0.0  # CPU: the process's resident memory before the model exists (Python, torch, the data)
    step_buffers: float = 0.0  # CPU: the optimizer step's own buffers; nonzero: phases (see PHASE_REUSE)
    head_grad: float = 0.0  # CPU: the output head's gradient, formed in the forward (part of `grads`)
    base4_saving: float = 0.0  # LoRA over a 16-bit base: what train.base_bits = 4 would take off the weights

    @property
    def total(self) -> float:
        resident = self.process + self.weights + self.optimizer + self.weight_copies
        if not self.step_buffers:  # GPU: every gradient counted beside the activations (as measured)
            return resident + self.grads + self.activations
        backward, step = self.activations + self.head_grad, self.grads + self.step_buffers
        return resident + max(backward, step) + PHASE_REUSE * min(backward, step)

    def table(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.grads), ("optimizer state", self.optimizer),
                 ("weight copies", self.weight_copies), ("activations", self.activations)]
        if self.step_buffers:
            parts = [("process", self.process), *parts, ("optimizer step buffers", self.step_buffers)]
        body = ", ".join(f"{name} {b / GiB:.2f}" for name, b in parts)
        note = "; activations and gradients are not alive at once" if self.step_buffers else ""
        return f"expected peak memory {self.total / GiB:.2f} GiB ({body} GiB{note})"


def estimate(model_cfg, run_cfg, lora_spec=None, base_dtype: torch.dtype = torch.float32,
             autocast: bool = True, working_copy: bool = False, triton_experts: bool = False, *, cpu: bool = False,
             doc_tokens: float | None = None, process: float = 0.0) -> Estimate:
    """Bytes for one optimizer step of `run_cfg` on `model_cfg`: AdamW's two moments on what trains (fp32; bf16
    with train.moments_dtype=bf16 and the working copy), gradients of what trains, the frozen base in `base_dtype`
    under LoRA. autocast: bf16 compute over fp32
    weights (a bf16 copy per matrix use, an fp32 residual stream); working_copy: `train.working_copy` (bf16 copies
    of the weights kept for the whole run, bf16 activations and gradients; train/precision.py); triton_experts:
    the routed experts run the Triton kernels (a GPU), which take LoRA's adapters themselves (no merged expert
    weights, no SwiGLU output kept). cpu: the run is on a CPU (its kernels' saved tensors, `_cpu_layer_bytes`; the
    phases of `Estimate.total`); doc_tokens: the mean document length of the data (the CPU attention keeps softmax
    probabilities per document; None: documents of max_seqlen); process: bytes the process holds already (CPU)."""
    model = DeepSeekV3(model_cfg, device="meta")
    # autocast keeps a bf16 copy of every matrix a layer multiplies by; not of the embedding (a lookup) or the output
    # head (cast chunk by chunk inside the loss)
    heads = {id(model.model.embed_tokens.weight), id(model.lm_head.weight)}
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in heads)
    low = 2 if autocast or working_copy else 4  # bytes of a weight copy / activation element
    resid = 2 if working_copy else 4  # the residual stream: fp32 when the weights it adds are fp32
    accumulate = run_cfg.train.grad_accum > 1
    grad_bytes = 4 if accumulate or not working_copy else 2  # the working copy's flat gradients: bf16 unless summed
    # AdamW's two moments: fp32, or bf16 with the working copy's optimizer (train.moments_dtype)
    moment_bytes = 4 if working_copy and run_cfg.train.moments_dtype == "bf16" else 8
    if lora_spec is None:
        n = model.num_parameters()
        weights, grads, optimizer = 4 * n, grad_bytes * n, moment_bytes * n
        copies = 2 * n if working_copy else (low * matrices if autocast else 0)
        trained = n
    else:
        size = torch.finfo(base_dtype).bits // 8
        targeted = sum(model.get_parameter(n).numel() for n in lora_lib.quantized_names(model, lora_spec))
        lora_lib.apply_lora(model, lora_spec, base_dtype)
        # the frozen fp32 tensors (embedding, norms, router): held in bf16 alone under the working copy; 4-bit
        # weights: their packed bytes (uint8, 17/32 byte a weight)
        other = 2 if working_copy else 4
        base = sum(p.numel() * (1 if p.dtype == torch.uint8 else size if p.dtype == base_dtype else other)
                   for n, p in model.named_parameters() if not lora_lib._is_adapter(n))
        a = lora_lib.count_adapters(model)
        weights, grads, optimizer = base + 4 * a, grad_bytes * a, moment_bytes * a
        copies = size * _merged_elements(model, triton_experts) + (2 * a if working_copy else 0)
        trained = a
    t = run_cfg.data.tokens_per_batch
    mode = getattr(getattr(run_cfg, "parallel", None), "activation_checkpointing", "none")
    expert_act = not (lora_spec is not None and triton_experts)  # the LoRA Triton experts recompute it
    docs = min(doc_tokens or run_cfg.data.max_seqlen, run_cfg.data.max_seqlen) if cpu else None
    head = dict(head_trained=lora_spec is None)  # (LoRA freezes the head: smaller loss chunks)
    acts = activation_bytes(model_cfg, t, mode, low=low, resid=resid, expert_act=expert_act, cpu_docs=docs, **head)
    full = activation_bytes(model_cfg, t, "full", low=low, resid=resid, expert_act=expert_act, cpu_docs=docs, **head)
    est = Estimate(weights, grads, optimizer, copies, acts, lora_spec is not None, full)
    if lora_spec is not None and lora_spec.base_bits == 16:
        est.base4_saving = targeted * (size - 17 / 32)
    if cpu and not working_copy:  # foreach AdamW (train/optim.py): one fp32 buffer per trained weight in its step
        head_grad = 4 * model.lm_head.weight.numel() if lora_spec is None else 0
        est.process, est.step_buffers, est.head_grad = process, 4.0 * trained, float(head_grad)
    return est


def activation_bytes(c, tokens: int, checkpointing: str = "none", *, low: int = 2, resid: int = 4,
                     expert_act: bool = True, cpu_docs: float | None = None, head_trained: bool = True) -> float:
    """Bytes autograd keeps for one micro-batch of `tokens` tokens of model config `c`: every layer's saved tensors
    (`_activation_bytes_per_token`; `checkpointing` none / selective / full as parallel.activation_checkpointing) and
    the output head's chunk. The one activation model: the pre-run report (`estimate`) and `anyseek plan`
    (train/plan.py, per GPU) both count with it. low, resid: bytes of a computed activation and of the residual
    stream (bf16 compute: 2; an fp32 residual beside fp32 weights: 4); cpu_docs: a CPU run's mean document length."""
    per_token = _activation_bytes_per_token(c, low, checkpointing, resid, expert_act, cpu_docs)
    return tokens * per_token + _head_chunk_bytes(c, tokens, low, "cuda" if cpu_docs is None else "cpu",
                                                  head_trained)


def _head_chunk_bytes(c, tokens: int, low: int, device_type: str = "cuda", head_trained: bool = True) -> float:
    """The output head's loss works on [C, V] logits, chunk by chunk (`model.loss.chunk_rows` rows: thousands on
    GPUs, a few dozen on CPUs, fewer for a frozen head): one fp32 chunk and its low-precision gradient are alive at
    the end of the forward, the activations' peak."""
    rows = min(tokens, chunk_rows(c.vocab_size, device_type, tokens, head_trained))
    return float(rows * c.vocab_size * (4 + low))


def _merged_elements(model, triton_experts: bool) -> int:
    """Elements of the merged weights a LoRA forward forms and keeps for the backward: the routed experts' where
    they run on the effective weights (not the Triton kernels), counted twice (their backward also forms the full
    gradient of the merged weights)."""
    if triton_experts:
        return 0
    return sum(2 * (_dense_numel(m.base.gate_up_proj) + _dense_numel(m.base.down_proj)) for m in model.modules()
               if isinstance(m, LoRAExperts))


def _dense_numel(w: torch.Tensor) -> int:
    """Elements of a frozen weight as the computation reads it (a 4-bit one dequantized: in_features per row)."""
    return w.numel() if w.dtype != torch.uint8 else w.numel() // w.shape[-1] * in_features4(w)


def _activation_bytes_per_token(c, low: int, checkpointing: str = "none", resid: int = 4,
                                expert_act: bool = True, cpu_docs: float | None = None) -> float:
    """What autograd keeps per token, tensor by tensor as the model saves them (low: bytes of a computed
    activation; resid: of the residual stream). Per layer: the residual input of each norm and the normed x,
    MLA's q_a and its norm, the kv latent and its norm, the attention's q, k_nope|v (one buffer), k_pe, output and
    log-sum-exp; a dense MLP's [gate | up] and SwiGLU output; a MoE's K routed rows ([gate | up] and activation), its
    fp32 scores and the shared experts' [gate | up] and activation. The MTP modules add their embedding, two norms
    and the joined input. `checkpointing` (parallel.activation_checkpointing, the layers
    `anyseek.distributed.fsdp.apply_activation_checkpointing` picks): a recomputed layer keeps only its inputs, and
    one such layer's activations are alive again during its backward. expert_act: the routed rows' SwiGLU output
    is kept (not by LoRA's Triton experts, which recompute it from [gate | up]). cpu_docs: the run is on a CPU, its
    documents this long on average (`_cpu_layer_bytes`). Against peaks measured on an H100
    (docs/benchmarks.md): see the module docstring."""
    H, D, E = c.num_attention_heads, c.hidden_size, c.n_routed_experts
    Q, L, R = c.q_lora_rank or 0, c.kv_lora_rank, c.qk_rope_head_dim
    core = low * (H * c.qk_head_dim + H * (c.qk_nope_head_dim + c.v_head_dim) + R) + 4 * H  # the GPU kernel's
    attn = (resid + low) * D + low * (2 * Q + 2 * L) + core + low * H * c.v_head_dim
    post = (resid + low) * D + 8
    dense = low * 3 * c.intermediate_size
    moe = 0
    if E:
        K, I = c.num_experts_per_tok, c.moe_intermediate_size
        moe = low * (3 if expert_act else 2) * I * K + 8 * K + 4 * E + low * 3 * I * c.n_shared_experts
    if cpu_docs is not None:
        attn, dense, moe = _cpu_layer_bytes(c, low, attn - core, cpu_docs)
    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers) if E else c.num_hidden_layers
    # decoder layers, then the MTP modules (counted as MoE layers, with their own inputs)
    units = [attn + post + dense] * n_dense + [attn + post + moe] * (c.num_hidden_layers - n_dense)
    units += [attn + post + moe + (low + 2 * resid + 2 * low) * D] * c.num_nextn_predict_layers
    recomputed = [i for i in range(len(units)) if checkpointing == "full" or
                  (checkpointing == "selective" and i < c.num_hidden_layers and i % 2 == 0)]
    # a recomputed layer keeps its input: h + the previous FFN output, added before the checkpoint (fsdp.py)
    kept = sum(resid * D if i in recomputed else u for i, u in enumerate(units))
    heads = (1 + c.num_nextn_predict_layers) * (resid + low) * D  # final norms' inputs, the loss's saved grad_h
    return float(kept + max((units[i] for i in recomputed), default=0) + heads)


# The CPU's length buckets (kernels/torch_backends.py) hold documents within 1.5x of each other's length: ~9% padding
# measured on the Wikipedia sample.
_BUCKET_PADDING = 1.1


def _cpu_layer_bytes(c, low: int, attn_outside: float, docs: float) -> tuple[float, float, float]:
    """(attention, dense MLP, MoE) bytes per token a layer keeps on a CPU, where `_activation_bytes_per_token`
    counts what the GPU kernels keep. Counted against `torch.autograd.graph.saved_tensors_hooks` on `tiny` and
    `small` (2026-11-27; within 2% of every layer): the `bmm` attention keeps q (scaled), k, v and the output in
    padded buckets, plus the gathered k and v the buckets view (3 x H x (qk + v) per token), and the softmax
    probabilities of causal tiles of 64 queries, H x (doc/2 + 32) per token, for documents up to 1024 tokens
    (longer ones go to SDPA, which keeps none); MLA's joined [q_a | kv_a | k_pe] is kept twice and the normed input
    once more; the reference SwiGLU keeps [gate | up], silu(gate), the product and the weighted product (6 x I per
    token of a dense or shared MLP; a routed row 5 x I, its gathered input and its output, 2 x D)."""
    H, D, I = c.num_attention_heads, c.hidden_size, c.moe_intermediate_size
    Q, L, R, K = c.q_lora_rank or 0, c.kv_lora_rank, c.qk_rope_head_dim, c.num_experts_per_tok
    probs = 4 * H * (docs / 2 + 32) if docs <= 1024 else 0.0
    core = _BUCKET_PADDING * low * 3 * H * (c.qk_head_dim + c.v_head_dim) + probs
    attn = attn_outside + core + low * (2 * (Q + L + R) + D)
    dense = low * 6 * c.intermediate_size
    moe = 0.0
    if c.n_routed_experts:
        moe = low * K * (2 * D + 5 * I) + 8 * K + 4 * c.n_routed_experts + low * 6 * I * c.n_shared_experts
    return attn, dense, moe


def available(device: torch.device) -> float | None:
    """Bytes the device has in all (GPU: its memory; CPU: physical RAM); None when unknown."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def advice(est: Estimate, run_cfg, have: float) -> list[str]:
    """Which knobs bring `est` under `have` bytes, most effective first."""
    tips = []
    if est.base4_saving > 0.05 * have:
        tips.append(f"a 4-bit base (--train.base_bits=4) holds LoRA's targets, routed experts included, in NF4: about "
                    f"{est.base4_saving / GiB:.1f} GiB less")
    if not est.lora and (est.grads + est.optimizer) > 0:
        tips.append(f"LoRA (--train.lora_rank=16 with --init) drops gradients and optimizer state of the base: "
                    f"about {(est.grads + est.optimizer + est.weights / 2) / GiB:.1f} GiB less")
    t = run_cfg.data.tokens_per_batch
    if est.activations > 0.1 * have and t > run_cfg.data.max_seqlen:
        half = max(t // 2, run_cfg.data.max_seqlen)
        tips.append(f"a smaller micro-batch (--data.tokens_per_batch={half} --train.grad_accum="
                    f"{run_cfg.train.grad_accum * 2}: same tokens per step) saves about "
                    f"{est.activations * (1 - half / t) / GiB:.1f} GiB of activations")
    saved = est.activations - est.activations_full_checkpointing
    if est.activations > 0.1 * have and saved > 0:
        tips.append(f"--parallel.activation_checkpointing=full (or selective: every other layer) recomputes layers in "
                    f"backward and keeps only their inputs: about {saved / GiB:.1f} GiB of activations less")
    return tips


def report(model_cfg, run_cfg, device: torch.device, lora_spec, base_dtype: torch.dtype, log=print) -> Estimate:
    """Print the estimate for a one-process run on `device` (its precision as the trainer decides it); on a CPU also
    how long the run will take (`duration`)."""
    low = precision.compute_dtype(run_cfg.train.dtype, device)
    working = precision.wanted(run_cfg.train.working_copy, device, False, low)
    cpu = device.type == "cpu"
    docs = mean_document_tokens(run_cfg) if cpu else None
    rate = matmul_flops_per_s() if cpu else 0.0  # first: it pages in the maths libraries the run will use
    est = estimate(model_cfg, run_cfg, lora_spec, base_dtype, low is not None, working, device.type == "cuda",
                   cpu=cpu, doc_tokens=docs)
    if cpu:  # after the meta model too: its first build imports and registers ~150 MB of torch the run needs
        est.process = resident_bytes() + LATER_PAGES
    have = available(device)
    where = f"of {have / GiB:.1f} GiB on {device}" if have else f"on {device}"
    log(f"memory: {est.table()} {where}")
    if have and est.total > 0.9 * have:
        log(f"warning: this run will likely not fit in {device}'s {have / GiB:.1f} GiB. Try:")
        for tip in advice(est, run_cfg, have):
            log(f"  - {tip}")
    if cpu:
        for line in duration(model_cfg, run_cfg, docs or run_cfg.data.max_seqlen, rate):
            log(line)
    return est


def resident_bytes() -> float:
    """This process's resident memory now (Linux: /proc; elsewhere its peak so far, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError, AttributeError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def mean_document_tokens(run_cfg) -> float | None:
    """Mean length of the training documents of the run's prepared data (its manifest.json: data.path, or the cache
    folder of data.source); None where there is none yet."""
    d = run_cfg.data
    folder = Path(d.path).expanduser() if d.path else default_out(d.source, d.vocab_size)
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        return float(manifest["tokens"]["train"]) / float(manifest["documents"]["train"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


# What a CPU run's process adds after the report besides its tensors: library code and state the first steps, the
# evaluation, the checkpoint and the loss plot page in (matplotlib alone ~25 MB). Measured on `tiny`: 60-70 MB.
LATER_PAGES = 64 * 2**20

# A training step on a CPU runs at this share of a plain fp32 matmul's rate (`matmul_flops_per_s`), measured on 2
# cores (2026-11-27): 0.42 for `tiny` (6,000 tokens/s), 0.50 for `small` at 2,048 tokens (88 tokens/s): these models'
# small matrices, attention tiles and per-expert loops. The lower one, so the estimate errs long.
CPU_TRAINING_EFFICIENCY = 0.4
LONG_RUN_S = 3 * 3600  # longer than this on a CPU: a warning


def matmul_flops_per_s() -> float:
    """fp32 FLOP/s of this CPU on a [512, 1024] x [1024, 1024] matmul, at torch's thread count: the best of three
    rounds of four (~0.1 s on 2 cores). Measured rather than looked up: it includes what else the machine runs."""
    g = torch.Generator().manual_seed(0)  # its own: the run's random stream (its weights' init) stays untouched
    a, b = torch.rand(512, 1024, generator=g), torch.rand(1024, 1024, generator=g)
    a @ b  # warm-up
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * 512 * 1024 * 1024 / max(time.perf_counter() - start, 1e-9))
    return best


def duration(model_cfg, run_cfg, doc_tokens: float, flops_per_s: float) -> list[str]:
    """One line with the expected time of the run's training steps on this CPU (FLOPs per token, as the trainer
    counts them for MFU, at CPU_TRAINING_EFFICIENCY of `flops_per_s`), and a warning beyond LONG_RUN_S."""
    t = run_cfg.train
    per_token = DeepSeekV3(model_cfg, device="meta").flops_per_token(int(doc_tokens))
    tokens_per_s = CPU_TRAINING_EFFICIENCY * flops_per_s / per_token
    seconds = t.max_steps * run_cfg.data.tokens_per_batch * t.grad_accum / tokens_per_s
    lines = [(f"time: about {_human(seconds)} for {t.max_steps:,} steps on this CPU (~{tokens_per_s:,.0f} tokens/s: "
              f"{per_token / 1e9:.3g} GFLOP per token at {CPU_TRAINING_EFFICIENCY:.0%} of its "
              f"{flops_per_s / 1e9:.0f} GFLOP/s matmul rate)")]
    if seconds > LONG_RUN_S:
        lines.append(f"warning: this run would take about {_human(seconds)} on this CPU; a GPU, --config tiny or "
                     f"fewer --train.max_steps make it practical (Ctrl-C saves a checkpoint and stops)")
    return lines


def _human(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
