"""Pick a backend per op, and say why.

Each op has backends in priority order. A backend is a name, a loader (imports lazily, returns the function),
an availability check `available(example) -> (ok, reason)` and the device types it is meant for. Choice:

- explicit: a run's context `with using(attention="sdpa", moe="reference"):` (the trainer enters one built from its
  config around everything it runs), `set_backend(op, name)` (process-wide, for interactive use), or the environment,
  `ANYSEEK_ATTENTION=name` for both attention ops, `ANYSEEK_MOE=name` for routed_experts and lora_routed_experts
  (whose backends bear the same names), `ANYSEEK_DECODE=name` for mla_decode, mla_cache_write and gumbel_argmax,
  `ANYSEEK_NORM=name` for rms_norm and add_rms_norm, `ANYSEEK_ROPE=name` for rope_rotate, `ANYSEEK_SWIGLU=name`
  for swiglu, `ANYSEEK_XENT=name` for cross_entropy_rows, `ANYSEEK_ADAMW=name` for the optimizer steps
  (adamw_flat, sq_norm, adamw_tensors),
  `ANYSEEK_ROUTER=name` for route_topk and route_weights, `ANYSEEK_LOWRANK=name` for low_rank_merge,
  `ANYSEEK_LOWRANK_LINEAR=name` for low_rank_linear, `ANYSEEK_QUANT4=name` for quant4_linear and quant4_routed_experts
  (the two seams above given 4-bit frozen weights), `ANYSEEK_FP8=name` for fp8_linear, fp8_routed_experts and the rows
  FP8 dispatch sends (fp8_pack_rows, fp8_unpack_rows).
  A backend requested explicitly that cannot run raises RuntimeError with its reason; an unknown name raises
  ValueError listing the known ones.
- automatic (no request, or "auto"): the first available backend in priority order. A backend meant for this
  device that cannot run is skipped with ONE warning per (op, backend, reason).

`describe()` returns (op, backend, why) rows for `anyseek doctor` and training logs.
Nothing here imports Triton: the triton backend's loader and check import it on first use, on CUDA only.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

AUTO = "auto"
# op -> environment variable that requests a backend for it
ENV_VARS = {
    "mla_attention": "ANYSEEK_ATTENTION",
    "varlen_attention": "ANYSEEK_ATTENTION",
    "routed_experts": "ANYSEEK_MOE",
    "lora_routed_experts": "ANYSEEK_MOE",
    "mla_decode": "ANYSEEK_DECODE",
    "mla_cache_write": "ANYSEEK_DECODE",
    "gumbel_argmax": "ANYSEEK_DECODE",
    "rms_norm": "ANYSEEK_NORM",
    "add_rms_norm": "ANYSEEK_NORM",
    "swiglu": "ANYSEEK_SWIGLU",
    "cross_entropy_rows": "ANYSEEK_XENT",
    "rope_rotate": "ANYSEEK_ROPE",
    "adamw_flat": "ANYSEEK_ADAMW",
    "sq_norm": "ANYSEEK_ADAMW",
    "adamw_tensors": "ANYSEEK_ADAMW",
    "route_topk": "ANYSEEK_ROUTER",
    "route_weights": "ANYSEEK_ROUTER",
    "low_rank_merge": "ANYSEEK_LOWRANK",
    "low_rank_linear": "ANYSEEK_LOWRANK_LINEAR",  # (its backends are not low_rank_merge's: a variable of its own)
    "quant4_linear": "ANYSEEK_QUANT4",
    "quant4_routed_experts": "ANYSEEK_QUANT4",
    "fp8_linear": "ANYSEEK_FP8",
    "fp8_routed_experts": "ANYSEEK_FP8",
    "fp8_pack_rows": "ANYSEEK_FP8",
    "fp8_unpack_rows": "ANYSEEK_FP8",
}
# short names accepted by set_backend for groups of ops
OP_GROUPS = {"attention": ("mla_attention", "varlen_attention"), "moe": ("routed_experts", "lora_routed_experts"),
             "norm": ("rms_norm", "add_rms_norm"), "rope": ("rope_rotate",), "swiglu": ("swiglu",),
             "xent": ("cross_entropy_rows",), "decode": ("mla_decode", "mla_cache_write", "gumbel_argmax"),
             "adamw": ("adamw_flat", "sq_norm", "adamw_tensors"), "router": ("route_topk", "route_weights"),
             "lowrank": ("low_rank_merge",), "quant4": ("quant4_linear", "quant4_routed_experts"),
             "fp8": ("fp8_linear", "fp8_routed_experts", "fp8_pack_rows", "fp8_unpack_rows")}


@dataclass(frozen=True)
class Backend:
    name: str
    load: Callable[[], Callable]  # returns the op's function; imports happen here, not at registration
    available: Callable[[torch.Tensor], tuple[bool, str]]
    devices: tuple[str, ...] | None = None  # device types it is meant for (None: every device)
    optional: bool = False  # an optional library: skipped without a warning when it cannot run


_BACKENDS: dict[str, list[Backend]] = {}
_requested: dict[str, str] = {}
_in_context: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("anyseek_backends", default={})
_warned: set[tuple[str, str, str]] = set()
_cache: dict[tuple, tuple[Callable, str, str]] = {}


def _import(path: str) -> Callable:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _lazy(path: str) -> Callable[[], Callable]:
    return lambda: _import(path)


def _lazy_check(path: str) -> Callable[[torch.Tensor], tuple[bool, str]]:
    return lambda example: _import(path)(example)


def _always(reason: str) -> Callable[[torch.Tensor], tuple[bool, str]]:
    return lambda example: (True, reason)


def register(op: str, backend: Backend, before: str | None = None) -> None:
    """Add `backend` to `op`, last in priority unless `before` names a backend it should precede."""
    chain = _BACKENDS.setdefault(op, [])
    chain[:] = [b for b in chain if b.name != backend.name]
    names = [b.name for b in chain]
    chain.insert(names.index(before) if before in names else len(chain), backend)
    _cache.clear()


def ops() -> list[str]:
    return list(_BACKENDS)


def backends(op: str) -> list[Backend]:
    """The backends of `op` in priority order."""
    if op not in _BACKENDS:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(_BACKENDS)}")
    return list(_BACKENDS[op])


def _targets(op: str, name: str | None) -> tuple[str, ...]:
    """The ops a request of backend `name` for `op` (an op or a group: "attention", "moe") applies to; a name that no
    op of the group has raises ValueError listing the known ones."""
    targets = OP_GROUPS.get(op, (op,))
    if name in (None, AUTO):
        return targets
    known = {t: [b.name for b in backends(t)] for t in targets}
    targets = tuple(t for t in targets if name in known[t])  # a group: the ops that have this backend
    if not targets:
        names = sorted({n for ns in known.values() for n in ns})
        raise ValueError(f"unknown backend {name!r} for {op!r}; known: {', '.join(names)} (or 'auto')")
    return targets


def set_backend(op: str, name: str | None) -> None:
    """Request backend `name` for `op` (or for a group: "attention", "moe") in this whole process; None or "auto"
    clears the request. A run requests its backends through `using` instead, for its own duration."""
    for target in _targets(op, name):
        if name in (None, AUTO):
            _requested.pop(target, None)
        else:
            _requested[target] = name
    _cache.clear()


@contextlib.contextmanager
def using(**requests: str | None) -> Iterator[None]:
    """Backends requested for the duration of the block (and this thread or task): `using(attention="sdpa",
    moe="auto")`, keys are ops or groups, "auto"/None request nothing. An unknown name raises ValueError here,
    naming it. Nested blocks add to (and may override) the outer ones; leaving a block restores them."""
    chosen = dict(_in_context.get())
    for op, name in requests.items():
        for target in _targets(op, name):
            if name in (None, AUTO):
                chosen.pop(target, None)
            else:
                chosen[target] = name
    token = _in_context.set(chosen)
    try:
        yield
    finally:
        _in_context.reset(token)


def requested(op: str) -> tuple[str, str]:
    """(name, where it came from): a run's `using` block, then set_backend, then the environment; ("auto",
    "default") when none asks."""
    in_block = _in_context.get()
    if op in in_block:
        return in_block[op], "the run's config"
    if op in _requested:
        return _requested[op], "set_backend"
    env = ENV_VARS.get(op)
    value = os.environ.get(env, "").strip() if env else ""
    if value:
        return value, env
    return AUTO, "default"


def choose(op: str, example: torch.Tensor) -> tuple[Callable, str, str]:
    """(function, backend name, why) for running `op` on tensors like `example`."""
    name, source = requested(op)
    key = (op, name, example.device.type, example.dtype, tuple(example.shape[1:]), _autocast_dtype(example))
    if key not in _cache:
        _cache[key] = _choose_explicit(op, name, source, example) if name != AUTO else _choose_auto(op, example)
    return _cache[key]


def _autocast_dtype(example: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype in force for the example's device type, or None (a backend may compute in it)."""
    kind = example.device.type
    if kind not in ("cuda", "cpu") or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _choose_explicit(op: str, name: str, source: str, example: torch.Tensor) -> tuple[Callable, str, str]:
    chain = {b.name: b for b in backends(op)}
    if name not in chain:
        raise ValueError(f"{source} asks for backend {name!r} for op {op!r}; known: {', '.join(chain)} (or 'auto')")
    ok, reason = chain[name].available(example)
    if not ok:
        raise RuntimeError(f"backend {name!r} for op {op!r} was requested ({source}) but cannot run here: {reason}")
    return chain[name].load(), name, f"requested by {source}: {reason}"


def _choose_auto(op: str, example: torch.Tensor) -> tuple[Callable, str, str]:
    skipped = []
    for b in backends(op):
        if b.devices is not None and example.device.type not in b.devices:
            continue
        ok, reason = b.available(example)
        if ok:
            why = reason if not skipped else f"{reason} (skipped {'; '.join(skipped)})"
            return b.load(), b.name, why
        skipped.append(f"{b.name}: {reason}")
        if not b.optional and (op, b.name, reason) not in _warned:
            _warned.add((op, b.name, reason))
            warnings.warn(f"anyseek: {op} falls back from backend {b.name!r}: {reason}", RuntimeWarning, stacklevel=4)
    raise RuntimeError(f"no backend for op {op!r} can run on {example.device.type}: {'; '.join(skipped)}")


def get(op: str, example: torch.Tensor) -> Callable:
    """The function that runs `op` for tensors like `example`."""
    return choose(op, example)[0]


def example_for(op: str, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small tensor shaped like the first input of `op` (DeepSeek-V3 shapes) on `device`, for describe()."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    shape = {"mla_attention": (1, 16, 192), "varlen_attention": (1, 16, 128), "routed_experts": (1, 1024),
             "mla_decode": (1, 16, 576), "mla_cache_write": (1, 576), "gumbel_argmax": (1, 129280),
             "rms_norm": (1, 1024),
             "add_rms_norm": (1, 1024), "swiglu": (1, 4096),
             "cross_entropy_rows": (1, 129280),
             "adamw_flat": (1024,), "sq_norm": (1024,), "adamw_tensors": (1024,),
             "rope_rotate": (1, 16, 64), "route_topk": (1, 256), "route_weights": (1, 256),
             "low_rank_merge": (1536, 7168),
             "lora_routed_experts": (1, 1024), "low_rank_linear": (1, 7168), "quant4_linear": (1, 2048),
             "quant4_routed_experts": (1, 2048), "fp8_linear": (1, 7168), "fp8_routed_experts": (1, 1024),
             "fp8_pack_rows": (1, 2048)}
    return torch.empty(shape.get(op, (1, 16)), device=device, dtype=dtype)


def describe(device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> list[tuple[str, str, str]]:
    """(op, chosen backend, why) for every op on `device` (default: the first GPU, else the CPU)."""
    rows = []
    for op in _BACKENDS:
        try:
            _, name, why = choose(op, example_for(op, device, dtype))
        except (RuntimeError, ValueError) as e:
            name, why = "-", str(e)
        rows.append((op, name, why))
    return rows


def _register_defaults() -> None:
    triton_ok = _lazy_check("anyseek.kernels.triton.check.available")
    for op in ("mla_attention", "varlen_attention"):
        register(op, Backend("triton", _lazy(f"anyseek.kernels.ops.attention.{op}"), triton_ok, ("cuda",)))
        if op == "varlen_attention":
            flash_ok = _lazy_check("anyseek.kernels.native.flash_attn_available")
            flash = _lazy("anyseek.kernels.native.flash_attn_varlen_attention")
            register(op, Backend("flash_attn", flash, flash_ok, ("cuda",), optional=True))
        register(op, Backend("bmm", _lazy(f"anyseek.kernels.torch_backends.bmm_{op}"),
                             _lazy_check("anyseek.kernels.torch_backends.bmm_available"), ("cpu",),
                             optional=True))  # bf16/fp16 or autocast: SDPA, by design, without a warning
        register(op, Backend("sdpa", _lazy(f"anyseek.kernels.torch_backends.sdpa_{op}"), _sdpa_ok))
        register(op, Backend("reference", _lazy(f"anyseek.kernels.reference.{op}"), _always("pure PyTorch oracle")))
    register("routed_experts", Backend("grouped_mm", _lazy("anyseek.kernels.torch_backends.grouped_mm_routed_experts"),
                                       _lazy_check("anyseek.kernels.torch_backends.grouped_mm_available"), ("cuda",)))
    register("routed_experts", Backend("triton", _lazy("anyseek.kernels.ops.moe.routed_experts"),
                                       _lazy_check("anyseek.kernels.triton.check.moe_available"), ("cuda",)),
             before="grouped_mm")  # fmt: skip
    register("routed_experts", Backend("reference", _lazy("anyseek.kernels.reference.routed_experts"),
                                       _always("pure PyTorch (grouped by expert)")))
    # LoRA's experts: the same backends by name (ANYSEEK_MOE and set_backend("moe", ...) pick for both); triton adds
    # the adapters inside its GEMMs, the others run routed_experts' backend of that name on the effective weights
    register("lora_routed_experts", Backend("triton", _lazy("anyseek.kernels.ops.moe.lora_routed_experts"),
                                            _lazy_check("anyseek.kernels.triton.check.moe_available"), ("cuda",)))
    register("lora_routed_experts", Backend(
        "grouped_mm", _lazy("anyseek.kernels.torch_backends.grouped_mm_lora_routed_experts"),
        _lazy_check("anyseek.kernels.torch_backends.grouped_mm_available"), ("cuda",)))
    register("lora_routed_experts", Backend("reference", _lazy("anyseek.kernels.reference.moe.lora_routed_experts"),
                                            _always("pure PyTorch (the effective weights, grouped by expert)")))
    # LoRA's linear layers: PyTorch matmuls with their own backward everywhere (no kernel of their own), beside the
    # plain formula through autograd
    register("low_rank_linear", Backend("torch", _lazy("anyseek.kernels.torch_lowrank.low_rank_linear"),
                                        _always("PyTorch matmuls, merged weight or added term (torch_lowrank.py)")))
    register("low_rank_linear", Backend("reference", _lazy("anyseek.kernels.reference.lowrank.low_rank_linear"),
                                        _always("pure PyTorch (the formula through autograd)")))
    # 4-bit frozen weights (LoRA over a 4-bit base: the two seams above given packed weights): Triton GEMMs that
    # dequantize in their loops on CUDA; elsewhere the weights dequantized in PyTorch, then the matmuls
    moe_ok = _lazy_check("anyseek.kernels.triton.check.moe_available")
    register("quant4_linear", Backend("triton", _lazy("anyseek.kernels.triton.quant4_linear.low_rank_linear"), moe_ok,
                                      ("cuda",)))  # fmt: skip
    register("quant4_linear", Backend("reference", _lazy("anyseek.kernels.reference.quant4.low_rank_linear"),
                                      _always("pure PyTorch (dequantized per product, then matmuls)")))
    register("quant4_routed_experts", Backend("triton", _lazy("anyseek.kernels.triton.quant4_moe.lora_routed_experts"),
                                              moe_ok, ("cuda",)))  # fmt: skip
    register("quant4_routed_experts", Backend(
        "reference", _lazy("anyseek.kernels.reference.quant4.lora_routed_experts"),
        _always("pure PyTorch (the stacks dequantized, then the reference LoRA experts)")))
    # FP8 training's linear layers and routed experts (transforms/fp8.py): Triton quantize and promoted-GEMM kernels
    # on GPUs with FP8 tensor cores (kernels/ops/fp8.py), the PyTorch emulation of the same recipe elsewhere
    # (kernels/fp8.py)
    register("fp8_linear", Backend("triton", _lazy("anyseek.kernels.ops.fp8.fp8_linear"),
                                   _lazy_check("anyseek.kernels.triton.check.fp8_available"), ("cuda",)))
    register("fp8_linear", Backend("reference", _lazy("anyseek.kernels.fp8.fp8_linear_reference"),
                                   _always("pure PyTorch emulation (E4M3 casts, a matmul per 128-wide K-block)")))
    register("fp8_routed_experts", Backend("triton", _lazy("anyseek.kernels.ops.fp8.fp8_routed_experts"),
                                           _lazy_check("anyseek.kernels.triton.check.fp8_available"), ("cuda",)))
    register("fp8_routed_experts", Backend("reference", _lazy("anyseek.kernels.fp8.fp8_routed_experts_reference"),
                                           _always("pure PyTorch emulation (a loop over experts)")))
    # expert parallelism's FP8 dispatch (distributed/expert_parallel.py): rows to E4M3 bytes and power-of-two scales
    for op in ("fp8_pack_rows", "fp8_unpack_rows"):
        fn = op.removeprefix("fp8_")
        register(op, Backend("triton", _lazy(f"anyseek.kernels.triton.fp8_quant.{fn}"),
                             _lazy_check("anyseek.kernels.triton.check.fp8_available"), ("cuda",)))
        register(op, Backend("reference", _lazy(f"anyseek.kernels.reference.fp8.{fn}"),
                             _always("pure PyTorch (E4M3 casts)")))
    register("mla_decode", Backend("triton", _lazy("anyseek.kernels.triton.mla_decode.mla_decode"),
                                   _lazy_check("anyseek.kernels.triton.mla_decode.available"), ("cuda",)))
    register("mla_decode", Backend("reference", _lazy("anyseek.kernels.reference.decode.mla_decode"),
                                   _always("pure PyTorch (gathers the pages)")))
    # the fused chains: a Triton kernel on CUDA, its PyTorch twin everywhere; op -> (module in kernels/triton/ and
    # kernels/reference/, what the twin runs)
    fused = {"rms_norm": ("rmsnorm", "norm", "F.rms_norm in fp32"),
             "add_rms_norm": ("rmsnorm", "norm", "an add, then F.rms_norm in fp32"),
             "swiglu": ("swiglu", "swiglu", "silu, mul"),
             "cross_entropy_rows": ("xent", "xent", "fp32 softmax"),
             "rope_rotate": ("rope", "rope", "complex multiply in fp32"),
             "mla_cache_write": ("cache", "cache", "F.rms_norm, complex multiply, index_copy_"),
             "gumbel_argmax": ("sampling", "sampling", "the [B, V] noise in int64 ops, then argmax"),
             "adamw_flat": ("adamw", "adamw", "foreach-free flat ops"),
             "sq_norm": ("adamw", "adamw", "foreach-free flat ops"),
             "adamw_tensors": ("adamw", "adamw", "the flat twin, tensor by tensor"),
             "route_topk": ("router", "router", "three topk calls"),
             "route_weights": ("router", "router", "softmax or sigmoid, three topk calls, gather, normalize"),
             "low_rank_merge": ("lowrank", "lowrank", "addmm")}
    for op, (mod, ref, what) in fused.items():
        register(op, Backend("triton", _lazy(f"anyseek.kernels.triton.{mod}.{op}"),
                             _lazy_check(f"anyseek.kernels.triton.{mod}.available"), ("cuda",)))
        register(op, Backend("reference", _lazy(f"anyseek.kernels.reference.{ref}.{op}"),
                             _always(f"pure PyTorch ({what})")))


def _sdpa_ok(example: torch.Tensor) -> tuple[bool, str]:
    from anyseek.kernels.torch_backends import sdpa_available

    return sdpa_available(example)


_register_defaults()
