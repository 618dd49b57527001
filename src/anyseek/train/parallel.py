"""`Parallel`: the trainer's one handle on distribution. For a plain one-process run it is inactive and every
method leaves things exactly as before; under torchrun it shards the model (expert parallelism, then FSDP2) and sums
what must be global: target counts, losses, expert loads, the gradient norm.

    par = Parallel.from_torchrun(cfg.parallel, device)    # after this, par.env.rank / world_size are known
    model = par.parallelize(model, autocast_dtype)          # before the optimizer is built
    num_targets = par.sum_(num_targets)                     # the global step's denominators
    grad_norm = par.clip_grad_norm_(model, max_norm)        # the norm of the whole (sharded) gradient
"""

from __future__ import annotations

import contextlib
import datetime
import math
from typing import Any

import torch
from torch import nn

from anyseek import kernels
from anyseek.distributed.env import DistEnv, agree, all_reduce_sum, init_from_torchrun
from anyseek.infer.generate import generate
from anyseek.infer.sampling import Sampler, SamplingParams


class Silent:
    """Stands in for the metrics log and the progress line on ranks other than 0."""

    def write(self, *args, **kwargs) -> None:
        pass

    update = close = write


class Parallel:
    def __init__(self, cfg, env: DistEnv, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        self.mesh = self.ep_mesh = None
        self.masters = None  # ShardMasters where FSDP2's shards are bf16 (parallel.shard_dtype)
        self._host_group = None  # `sum_host`'s gloo group, made at its first use
        self._norm_plan: tuple | None = None  # clip_grad_norm_'s grouping, for gradients at the same addresses
        self.expert_params: list[nn.Parameter] = []
        self.dispatch = None  # expert parallelism's `Dispatch` (fixed-shape or exact exchanges), shared by its layers
        if cfg.ep > 1 and not env.active:
            raise ValueError(f"parallel.ep={cfg.ep} needs several processes: launch with torchrun or "
                             "`anyseek train --nproc-per-node N`")
        if env.active:
            from torch.distributed.device_mesh import init_device_mesh

            if env.world_size % cfg.ep:
                raise ValueError(f"parallel.ep={cfg.ep} must divide the number of ranks ({env.world_size})")
            self.mesh = init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("dp",))
            if cfg.ep > 1:
                self.ep_mesh = init_device_mesh(device.type, (env.world_size // cfg.ep, cfg.ep),
                                                mesh_dim_names=("edp", "ep"))

    @classmethod
    def from_torchrun(cls, cfg, device_name: str) -> Parallel:
        """Start the process group when launched by torchrun (the device becomes this rank's GPU)."""
        device_type = "cuda" if device_name.startswith("cuda") or (device_name == "auto" and
                                                                   torch.cuda.is_available()) else "cpu"
        env = init_from_torchrun(device_type, cfg.backend, cfg.timeout_s)
        device = torch.device(f"cuda:{env.local_rank}") if device_type == "cuda" and env.active else None
        return cls(cfg, env, device or torch.device(device_type))

    @property
    def active(self) -> bool:
        return self.env.active

    def loader_args(self) -> dict[str, int]:
        """The packed loader's share: every rank a disjoint, deterministic stride of each epoch's documents."""
        return {"rank": self.env.rank, "world_size": self.env.world_size}

    def parallelize(self, model: nn.Module, autocast_dtype: torch.dtype | None, grad_accum: int = 1,
                    tokens: int | None = None) -> nn.Module:
        """Activation checkpointing, expert parallelism, then FSDP2 over every rank (with bf16 shards: their fp32
        masters, `self.masters`). Inactive: only checkpointing. tokens: a micro-batch's tokens at most (what the
        fixed-shape dispatch's capacity is sized for)."""
        from anyseek.distributed.fsdp import (
            ShardMasters,
            apply_activation_checkpointing,
            apply_fsdp,
            compute_dtype,
            mixed_precision,
            pick_shard_dtype,
        )

        if self.cfg.activation_checkpointing != "none":
            apply_activation_checkpointing(model, self.cfg.activation_checkpointing)
        if not self.active:
            return model
        if self.ep_mesh is not None:
            from anyseek.distributed.expert_parallel import Dispatch, apply_ep, capacity_rows

            capacity = worst = None
            if self.ep_fixed and tokens:
                moe = model.moe_layers()[0]
                rows = (tokens, moe.top_k, self.cfg.ep, moe.n_experts // self.cfg.ep)
                capacity, worst = capacity_rows(*rows, self.cfg.ep_capacity_factor), capacity_rows(*rows, 0)
            self.dispatch = Dispatch(self.device, capacity, overlap=self.cfg.ep_overlap, worst=worst,
                                     settling=self.cfg.ep_settle_steps > 0)
            self._settled = 0  # steps in a row whose fullest pair fitted C / 1.25, while settling
            self.expert_params = apply_ep(model, self.ep_mesh, self.dispatch)
        compute = compute_dtype(self.cfg.param_dtype, autocast_dtype)
        shard_dtype = pick_shard_dtype(self.cfg.shard_dtype, compute, grad_accum, self.cfg.ep)
        mp = mixed_precision(self.cfg.param_dtype, self.cfg.reduce_dtype, autocast_dtype, self.env.world_size,
                             shard_dtype)
        model = apply_fsdp(model, self.mesh, mp, self.cfg.reshard_after_forward, set(self.expert_params),
                           forward_prefetch=self.cfg.ep > 1)
        if shard_dtype != torch.float32:
            self.masters = ShardMasters(model, shard_dtype)
        return model

    @property
    def ep_fixed(self) -> bool:
        """Whether expert parallelism's training step sends fixed shapes (parallel.ep_dispatch)."""
        mode = self.cfg.ep_dispatch
        return self.cfg.ep > 1 and (mode == "fixed" or (mode == "auto" and self.device.type == "cuda"))

    def ep_overflow(self) -> torch.Tensor | None:
        """[whether any rank's fixed-shape dispatch overflowed in this step (1.0 if so), the most rows any pair of
        ranks needed] on the device (one all-reduce, no host sync); None without a fixed-shape dispatch. Zeroed
        again by `ep_reset`."""
        if self.dispatch is None or self.dispatch.capacity is None:
            return None
        import torch.distributed as dist

        flag = torch.stack([self.dispatch.overflow.float(), self.dispatch.peak.float()])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def ep_grow(self, needed: float) -> int | None:
        """After an overflow (`parallel.ep_capacity_growth`): C raised to 1.25x the most rows a pair needed (the same
        on every rank: `needed` is the all-reduced peak), rounded up to 16, at most the worst case; the new C, or
        None where it does not grow."""
        d = self.dispatch
        if not self.cfg.ep_capacity_growth or d is None or d.capacity is None or d.capacity >= d.worst:
            return None
        d.capacity = min(d.worst, -(-math.ceil(1.25 * needed) // 16) * 16)
        return d.capacity

    @property
    def ep_settling(self) -> bool:
        """Whether the training step runs the exact dispatch until the routing fits C (parallel.ep_settle_steps)."""
        return self.dispatch is not None and self.dispatch.settling

    def ep_settle(self, needed: float) -> bool:
        """After a settled step while settling: `needed` the most rows a pair needed (all-reduced: every rank the
        same). True when this was the `ep_settle_steps`-th step in a row within C / 1.25: the fixed shapes (and CUDA
        graphs) from the next step on."""
        if not self.ep_settling:
            return False
        d = self.dispatch
        self._settled = self._settled + 1 if min(1.25 * needed, d.worst) <= d.capacity else 0
        if self._settled < self.cfg.ep_settle_steps:
            return False
        d.settling, self._settled = False, 0
        return True

    def ep_unsettle(self) -> bool:
        """After an overflow: the exact dispatch again until the routing settles (True), unless parallel.ep_settle_steps
        is 0 (False)."""
        d = self.dispatch
        if d is None or self.cfg.ep_settle_steps == 0 or d.capacity >= d.worst:
            return False
        d.settling, self._settled = True, 0
        return True

    def ep_reset(self) -> None:
        if self.dispatch is not None and self.dispatch.capacity is not None:
            self.dispatch.reset()

    def ep_fixed_shapes(self):
        """A context in which expert parallelism sends fixed shapes where configured (the training step's
        micro-batches); outside it, exact splits."""
        return self.dispatch.fixed_shapes() if self.dispatch is not None else contextlib.nullcontext()

    def release(self, model: nn.Module) -> None:
        """After forwards outside the training step (evaluation, the sample): free the weights FSDP2 gathered for
        them. The root unit keeps its gathered weights until a backward reshards it; when the step replays as a CUDA
        graph no eager backward comes, and the next evaluation (or a graph captured later) would take the weights
        gathered for this one as current. Inactive: nothing."""
        if not self.active:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over every rank, in place (a no-op for one process)."""
        return all_reduce_sum(t, self.env)

    def sum_host(self, values: list[float]) -> list[float]:
        """Numbers the host holds, summed over every rank on the CPU (a gloo group beside NCCL's; the default group
        under gloo): nothing waits for the device. One rank: as given."""
        if not self.active or self.env.world_size == 1:
            return [float(v) for v in values]
        if self._host_group is None:  # (collective: every rank reaches the first call at the same step)

            import torch.distributed as dist

            self._host_group = dist.group.WORLD if self.env.device == "cpu" else dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
        return all_reduce_sum(torch.tensor(values, dtype=torch.float64), self.env, self._host_group).tolist()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, scale: bool = True) -> torch.Tensor:
        """Scale the gradients so their global L2 norm is at most max_norm; return that norm (fp32 scalar).
        scale=False: the norm only, for an optimizer that applies the factor itself.
        One process: torch.nn.utils.clip_grad_norm_. Sharded: each element's square counted once over the world
        (a DTensor's local shard, divided by how many ranks hold a replica of it), one all-reduce."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params and any(p.requires_grad for p in model.parameters()):
            # the failure a wrapper can cause silently (FSDP2 on torch <= 2.11 and an output it could not flatten):
            # the backward ran, no trainable parameter holds a gradient, and AdamW would skip every one
            raise RuntimeError("no trainable parameter received a gradient in this step: the backward did not reach "
                               "the parameters the optimizer holds (a parallel wrapper dropped them?)")
        if not self.active:
            if not scale:
                return torch.nn.utils.get_total_norm([p.grad for p in params])
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        from torch.distributed.tensor import DTensor
        if self.ep_mesh is not None:
            from anyseek.distributed.expert_parallel import sync_expert_grads

            sync_expert_grads(self.expert_params, self.ep_mesh)
        # (the local shard as an attribute: DTensor.to_local() costs ~6 us of host time a call, ~120 calls a step)
        grads = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad for p in params]
        # the grouping is kept while the gradients stay where they were (a graphed step's do), as indices only
        key = tuple((g.data_ptr(), g.numel(), g.untyped_storage().nbytes()) for g in grads)
        if self._norm_plan is None or self._norm_plan[0] != key:
            by_replicas: dict[int, list[int]] = {}
            for i, p in enumerate(params):
                by_replicas.setdefault(_replicas(p.grad, self.env.world_size), []).append(i)
            self._norm_plan = (key, [(replicas, *_tiled_storages(grads, idx)) for replicas, idx in by_replicas.items()])
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for replicas, flat, rest in self._norm_plan[1]:  # a few kernels, not three launches per parameter
            for i, n in flat:  # gradients that are all of one buffer (FSDP2's reduction output): one pass over it
                sq += kernels.sq_norm(grads[i].new_empty(0).set_(grads[i].untyped_storage(), 0, (n,))) / replicas
            if rest:
                norms = torch._foreach_norm([grads[i] for i in rest], 2.0, dtype=torch.float32)  # (bf16 gradients
                sq += torch.stack(norms).float().pow(2).sum() / replicas  # where the shards are bf16)
        norm = self.sum_(sq).sqrt()
        if scale and math.isfinite(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm

    def sum_step(self, stats, counts_on_host: bool = False) -> None:
        """A step's StepStats (loss, loss parts, expert load, tokens, stop requests) summed over every rank, in one
        all-reduce. After it every rank holds the same numbers: the same NaN verdict, the same routing-bias update,
        the same decision to stop. Nothing is read back here: the token count and the stop requests stay on the device
        as `stats.global_counts` [tokens, stops] (the trainer reads them with the step's verdict, after queueing
        the optimizer step), the rest as device tensors. counts_on_host: the token count and stop requests are summed
        on the host instead (`sum_host`), into `stats.tokens` and `stats.stop_requested` at once, without waiting
        for the device."""
        if not self.active:
            return
        if counts_on_host:
            tokens, stop = self.sum_host([stats.tokens, float(stats.stop_requested)])
            stats.tokens, stats.stop_requested = int(tokens), stop > 0
        parts = list(stats.parts)
        values = [torch.as_tensor(stats.loss, device=self.device).double().reshape(1)]
        values += [torch.as_tensor(stats.parts[k], device=self.device).double().reshape(1) for k in parts]
        if not counts_on_host:
            values.append(torch.tensor([stats.tokens, float(stats.stop_requested)], dtype=torch.float64,
                                       device=self.device))
        if stats.expert_load is not None:
            values.append(stats.expert_load.double().reshape(-1))
        flat = self.sum_(torch.cat(values))
        stats.loss = flat[0].float()
        for i, k in enumerate(parts):
            stats.parts[k] = flat[1 + i].float()
        at = 1 + len(parts)
        if not counts_on_host:
            stats.global_counts, at = flat[at:at + 2], at + 2
        if stats.expert_load is not None:
            stats.expert_load = flat[at:].view_as(stats.expert_load).to(stats.expert_load.dtype)

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                 seed: int = 0) -> list[int]:
        """The trainer's sample. One process: `anyseek.infer.generate` (latent-cached decoding). Sharded, where that
        engine cannot read the weights (FSDP gathers them only inside each module's forward): every rank runs one
        cache-free forward per token in lockstep, rank 0 draws the token with generate's sampler (its defaults and
        its noise keys, so the draws are those of one process) and broadcasts it, so no rank's sequence differs."""
        if not self.active:

            return generate(model, prompt, max_new_tokens, eos_token_id=eos_token_id, seed=seed)
        import torch.distributed as dist


        vocab, context = model.config.vocab_size, model.config.max_position_embeddings
        sampler = Sampler(SamplingParams(seed=seed), vocab, 1, self.device)
        ids, new = list(prompt), []
        was_training = model.training
        model.eval()
        try:
            while len(new) < max_new_tokens and len(ids) < context:
                logits = model(torch.tensor([ids], device=self.device)).logits[0, -1:].float()
                token = sampler(logits, [0], [(0, len(new))]) if self.env.is_main else torch.zeros(1, dtype=torch.long,
                                                                                                    device=self.device)
                dist.broadcast(token, src=0)
                t = int(token.item())
                if t == eos_token_id:
                    break
                ids.append(t)
                new.append(t)
        finally:
            model.train(was_training)
        return new

    def on_main(self, fn) -> None:
        """fn() on rank 0 only (say, cleaning up the output folder), the others waiting; an exception raised there is
        raised on every rank (`env.agree`)."""
        if not self.active:
            fn()
            return
        error = None
        if self.env.is_main:
            try:
                fn()
            except Exception as e:
                error = e
        agree(error, self.env)

    def loader_state(self, state: dict[str, Any], loader) -> dict:
        """This rank's loader state from a checkpoint's train_state (`anyseek.checkpoint.load`): its own where the
        number of ranks is the same, else remapped (`_remap_loader`) onto `loader`'s fresh state."""
        if state["loader"] is not None:
            return state["loader"]
        return _remap_loader(state["saved_loaders"], loader.state_dict(), self.env.world_size)


def _remap_loader(saved: list[dict], fresh: dict, world_size: int) -> dict:
    """A different number of ranks reads different strides of the documents, so no exact position exists: every new
    rank starts at the same fraction of the (earliest saved) epoch as the old ranks had read on average. Some
    documents of that epoch may be seen twice or not at all; the following epochs are exact."""
    epoch = min(s["epoch"] for s in saved)
    read = sum(s["position"] for s in saved if s["epoch"] == epoch)
    return {**fresh, "epoch": epoch, "position": read // world_size}


def _tiled_storages(tensors: list[torch.Tensor], idx: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Of tensors[i] for i in idx: ([(i, n)] one per storage that they tile, [the other indices]). A storage tiled
    by them (every element in exactly one of them: contiguous views of one dtype, side by side) is read as one flat
    tensor of its n elements (tensors[i] is one of its views) instead. FSDP2's sharded gradients are views of its
    reduction's output buffer (a unit's whole buffer where no shard is padded, as on one rank): a norm over that
    buffer is one read of it, where `_foreach_norm` over ~100 bf16 views took 0.7 ms a step of `small` on an H200
    against 0.2 for the one-process step's flat norm."""
    by_storage: dict[tuple, list[int]] = {}
    for i in idx:
        t = tensors[i]
        by_storage.setdefault((t.untyped_storage().data_ptr(), t.dtype, t.device), []).append(i)
    flat, rest = [], []
    for views in by_storage.values():
        first = tensors[views[0]]
        n = first.untyped_storage().nbytes() // first.element_size()
        spans = sorted((tensors[i].storage_offset(), tensors[i].numel()) for i in views)
        tiled = all(tensors[i].is_contiguous() for i in views) and sum(k for _, k in spans) == n and all(
            a + k == b for (a, k), (b, _) in zip(spans, spans[1:])) and spans[0][0] == 0
        if tiled and len(views) > 1:
            flat.append((views[0], n))
        else:
            rest += views
    return flat, rest


def _replicas(t: torch.Tensor, world_size: int) -> int:
    """How many ranks hold each element of `t`: a DTensor's Replicate dims; a plain tensor on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return world_size
    return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if isinstance(p, Replicate))
