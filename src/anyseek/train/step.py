"""One optimizer step of the training loop, on the device: the step's micro-batches (forward and backward, eagerly or
replayed as CUDA graphs), the gradient norm and clip, the optimizer step and the routing-bias update, and the verdict
that skips a step with a non-finite loss or gradient (`max_bad_steps` in a row stop the run). The trainer
(`train/trainer.py`) decides when to evaluate, save and stop; this module runs the steps.

    engine = StepEngine(cfg, model, model_cfg, optimizer, par, device, autocast_dtype, working, out_dir, log)
    for outcome in engine.advance(batches):   # the steps settled by queueing the next one, oldest first
        ...
    engine.flush()                           # settle the step still in flight

The losses are normalised once for the whole step: each micro-batch's summed next-token (and per-depth MTP) loss is
divided by the step's count of valid targets (all micro-batches, all ranks), counted on the host before the step.
Overlap (`train.overlap_steps`; by default with a working copy in one process and with fused AdamW under torchrun; on
request with fused AdamW in one process): the host queues step N+1 before it reads step N's loss, so that it prepares
the next batch while the device computes. The optimizer step and the routing-bias update are queued with the step, gated
on the device by a halt flag that a non-finite loss or gradient norm sets (`FlatAdamW.skip`, fused AdamW's `found_inf`).
When the host reads a non-finite step it settles the step queued after it (halted, so not applied), clears the flag and
runs that step again with the learning rate and schedules of the step it really is. The steps applied, their order and
their numbers are those of the one-at-a-time loop. Steps after which the loop evaluates, saves or stops are settled
before anything else is queued.

Under torchrun the global token count and stop requests are read back with the step's verdict (`_settle`), not
right after their all-reduce (`Parallel.sum_step`): nothing in `_launch` waits for the device. With the overlap they
are summed on the host instead (a gloo all-reduce of two numbers): queueing step N+1 needs step N's global token
count (the schedules), and every rank must agree on a stop before it queues another step.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anyseek import checkpoint
from anyseek.kernels import registry
from anyseek.model.mtp import count_segments, count_targets
from anyseek.train import graphs as graphs_lib
from anyseek.train.config import ConfigError, RunConfig, piecewise
from anyseek.train.optim import lr_at, set_lr
from anyseek.train.parallel import Parallel


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row."""


CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: factor = max_norm / (norm + eps), at most 1


@dataclass
class StepStats:
    """Sums over the micro-batches of one optimizer step (tensors stay on the device until logged)."""

    loss: torch.Tensor | float = 0.0
    parts: dict[str, torch.Tensor | float] = field(default_factory=dict)
    expert_load: torch.Tensor | None = None
    tokens: int = 0
    flops: float = 0.0  # training FLOPs of the step, attention counted over each document's real length
    stop_requested: bool = False  # a signal asked to stop (distributed: of any rank, once the step settles)
    # distributed: [tokens, stop requests] summed over every rank (`Parallel.sum_step`), on the device until the step
    # settles (then `tokens` and `stop_requested` hold them)
    global_counts: torch.Tensor | None = None
    batches: list = field(default_factory=list)  # the host micro-batches (a step run again reads them)
    mtp_weight: float = 0.0  # the MTP loss weight the step used
    fixed: bool = False  # it ran expert parallelism's fixed-shape dispatch


_TOKENS, _STOP = "tokens (all ranks)", "stop requests (all ranks)"  # read back with a step's verdict
_OVERFLOW = "expert dispatch overflow (any rank)"  # read back with the verdict where the dispatch has fixed shapes
_PEAK = "expert dispatch peak rows (any pair)"  # with it: the most rows a pair of ranks needed


@dataclass
class _InFlight:
    """A step queued on the device whose verdict the host has not read yet."""

    stats: StepStats
    lr: float
    gamma: float  # routing-bias update speed
    gated: bool  # its optimizer step and routing-bias update are queued, gated by the trainer's halt flag
    names: list[str]  # of `host`'s values: loss, grad_norm, then the loss parts
    host: torch.Tensor  # a (pinned) host copy of those values, filled asynchronously
    event: Any = None  # recorded after the copy (CUDA), else None
    launched_at: float = field(default_factory=time.perf_counter)  # the host clock when queued

    def read(self) -> dict[str, float]:
        if self.event is not None:
            self.event.synchronize()  # this step's work only, not what was queued after it
        return dict(zip(self.names, self.host.tolist()))


@dataclass
class Outcome:
    """A settled step: applied (ok) or skipped, the trainer's step count after it, its logged values."""

    ok: bool
    step: int
    values: dict[str, float]
    lr: float
    tokens: int
    flops: float
    tokens_seen: int
    mtp_weight: float
    launched_at: float  # host clock: the time between two steps' launches is the step time, overlapped or not
    in_a_row: int = 0  # skipped: the non-finite steps in a row so far
    halted: bool = False  # the device was halted after this step: the step queued behind it was not applied


class StepEngine:
    """The step loop's state: the step count, the tokens seen, the non-finite steps in a row, the step in flight."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, model_cfg, optimizer: torch.optim.Optimizer,
                 par: Parallel, device: torch.device, autocast_dtype: torch.dtype | None, working, out_dir: Path,
                 backends: dict[str, str] | None = None, log=print):
        """model: as the trainer built it (transforms applied, parallelized, in train mode); model_cfg: its config
        (the loss weights and schedules' defaults); working: the one-process working copy (train/precision.py) or
        None; out_dir: the run's folder (named when the run diverges); backends: the kernels the run asks for
        (`registry.using`), in force for every forward and backward here."""
        t = cfg.train
        self.cfg, self.model, self.model_cfg, self.optimizer, self.par = cfg, model, model_cfg, optimizer, par
        self.device, self.autocast_dtype, self.working, self.out_dir, self.log = (device, autocast_dtype, working,
                                                                                 Path(out_dir), log)
        self.backends = dict(backends or {})
        self.stop_requested = False  # a signal asked to stop (set by the trainer's handler)
        self.stop_agreed = False  # distributed: the stop every rank saw in the step's all-reduce (`stopping`)
        self.forward = torch.compile(model) if t.compile else model
        self.graphs, self.graphs_note = self._step_graphs()
        # fused AdamW (one process or sharded: it takes DTensors and a plain grad_scale alike) and the working copy's:
        # the clip factor goes into its kernel (grad_scale divides each gradient as it is read), which saves a pass
        # over the gradients (under torchrun on `small`: 1.4 ms a step over the fp32 sharded gradients)
        self._fold_clip = working is not None or bool(optimizer.defaults.get("fused"))
        # flops_per_token(L) = a + b*L; computed once here, not per batch (it walks every module)
        self._flops_a = model.flops_per_token(0)
        self._flops_b = model.flops_per_token(1) - self._flops_a
        self.step = 0
        self.tokens_seen = 0
        self.bad_in_a_row = 0
        self.overflows = 0  # steps run again after the fixed-shape expert dispatch overflowed
        self.fixed_from: int | None = None  # the first step applied on expert parallelism's fixed-shape dispatch
        self.overlap, self.overlap_note = self._overlap()
        self._pending: _InFlight | None = None
        self._halt = torch.zeros((), dtype=torch.float32, device=device)  # set on the device by a bad step
        if self.overlap and working is not None:
            optimizer.skip = self._halt
        elif self.overlap:  # fused AdamW: skips where found_inf is nonzero, its step counts restored on the device
            optimizer.found_inf = self._halt

    def advance(self, batches) -> list[Outcome]:
        """Queue one optimizer step on the next batches, and settle what is due: the step queued before it (with
        the overlap), or this one. Returns the settled steps, oldest first (none or one of them skipped)."""
        t = self.cfg.train
        pending, self._pending = self._pending, None
        ahead = pending is not None  # counted as applied until the host reads otherwise
        number = self.step + ahead
        tokens = self.tokens_seen + (pending.stats.tokens if ahead else 0)
        launched = self._launch(self._accumulate(batches, tokens), lr_at(number, t), tokens, gated=self.overlap)
        done = []
        if ahead:
            done.append(self._settle(pending))
            if done[-1].halted:  # the device halted: `launched` was not applied; run it again as the step it is
                done.append(self._settle(launched, halted=True))
                return done
        n = number + 1
        if not self.overlap or n % t.eval_every == 0 or n % t.save_every == 0 or n >= t.max_steps:
            done.append(self._settle(launched))
        else:
            self._pending = launched
        return done


    def flush(self) -> list[Outcome]:
        """Settle the step still in flight, if any."""
        pending, self._pending = self._pending, None
        return [] if pending is None else [self._settle(pending)]


    def _launch(self, stats: StepStats, lr: float, tokens: int, gated: bool) -> _InFlight:
        """After a step's forward and backward: the gradient norm and clip factor, and (gated) the optimizer step
        and routing-bias update, queued without a host sync; the verdict's values copied to the host
        asynchronously."""
        t = self.cfg.train
        gamma = self.bias_update_speed(tokens)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        fold = self._fold_clip and math.isfinite(max_norm)
        if self.working is not None:  # its gradients are in one flat buffer (the clip is always folded)
            grad_norm = self.working.grad_norm()
        else:
            grad_norm = self.par.clip_grad_norm_(self.model, max_norm, scale=not fold)  # global norm: ranks agree
        if fold:
            self.optimizer.grad_scale = ((grad_norm.float() + CLIP_EPS) / max_norm).clamp(min=1.0)
        stats.stop_requested = self.stop_requested
        overflow = self.par.ep_overflow()  # (fixed-shape expert dispatch: whether a pair needed more rows)
        # losses, expert loads, tokens and stop requests of every rank (no host sync; with the overlap the counts on
        # the host, for the next step's schedules and the agreed stop)
        self.par.sum_step(stats, counts_on_host=self.overlap)
        loss = torch.as_tensor(stats.loss, dtype=torch.float32, device=self.device).reshape(())
        grad_norm = grad_norm.float().reshape(())
        if gated:
            bad = ~torch.isfinite(loss + grad_norm)  # grad_norm >= 0: the sum is finite iff both are
            if overflow is not None:
                bad = bad | (overflow[0] > 0)
            self._halt.masked_fill_(bad, 1.0)
            set_lr(self.optimizer, lr)
            self.optimizer.step()  # reads `_halt` (FlatAdamW.skip, found_inf): nothing changes once halted
            self._zero_grads()
            if stats.expert_load is not None:  # a zero load moves no bias: sign(0 - 0)
                self.model.update_routing_bias(stats.expert_load.float() * (1.0 - self._halt), gamma=gamma)
        names = ["loss", "grad_norm", *stats.parts]
        values = torch.stack([loss, grad_norm, *(torch.as_tensor(v, device=self.device).float().reshape(())
                                                 for v in stats.parts.values())])
        if stats.global_counts is not None:  # read with the verdict (fp64: token counts beyond 2^24 stay exact)
            names += [_TOKENS, _STOP]
            values = torch.cat([values.double(), stats.global_counts.double()])
        if overflow is not None:
            names += [_OVERFLOW, _PEAK]
            values = torch.cat([values, overflow.to(values.dtype)])
        event = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = values
        return _InFlight(stats, lr, gamma, gated, names, host, event)


    def _settle(self, item: _InFlight, halted: bool = False) -> Outcome:
        """Read a queued step's verdict (a host sync on its own work) and finish it: a non-finite step is skipped;
        a finite one is applied (already, if gated and not halted). halted: an earlier step's verdict halted the
        device, so `item` was not applied; it runs again from its batches."""
        t = self.cfg.train
        if halted:
            if item.gated:
                self._uncount()
            again = self._launch(self._accumulate(iter(item.stats.batches), self.tokens_seen), lr_at(self.step, t),
                                 self.tokens_seen, gated=item.gated)
            return self._settle(again)
        v = item.read()
        stats = item.stats
        if stats.global_counts is not None:
            stats.tokens, stats.stop_requested = int(v.pop(_TOKENS)), v.pop(_STOP) > 0
            stats.global_counts = None
        self.stop_agreed = stats.stop_requested  # (summed over the ranks; one process: this process's own)
        needed = v.pop(_PEAK, 0.0)
        if v.pop(_OVERFLOW, 0.0) > 0:
            return self._run_exact(item, needed)
        if _PEAK in item.names:  # (metrics.jsonl: how far the routing is from fitting C)
            v["ep_peak_rows"], v["ep_capacity"] = needed, float(self.par.dispatch.capacity)
            if self.par.ep_settle(needed):
                self.log(f"note: step {self.step + 1}: expert parallelism's routing settled "
                         f"({self.cfg.parallel.ep_settle_steps} steps in a row with every pair of ranks within C / "
                         f"1.25 = {self.par.dispatch.capacity / 1.25:.0f} rows): the fixed-shape dispatch (and CUDA "
                         f"graphs) from the next step queued")
        if not (math.isfinite(v["loss"]) and math.isfinite(v["grad_norm"])):
            if item.gated:
                self._uncount()
                self._halt.zero_()  # after the steps already queued, which it halted
            self._zero_grads()
            self.bad_in_a_row += 1
            self.log(f"warning: step {self.step + 1}: non-finite loss {v['loss']} / grad norm {v['grad_norm']}; "
                     f"step skipped ({self.bad_in_a_row} in a row)")
            if self.bad_in_a_row >= t.max_bad_steps:
                raise TrainingDiverged(
                    f"{self.bad_in_a_row} non-finite steps in a row at step {self.step + 1}; stopping. "
                    + (f"The last good checkpoint in {self.out_dir} is intact; resume it with a lower --train.lr."
                       if checkpoint.latest(self.out_dir, log=lambda s: None) is not None
                       else "No checkpoint was written yet; start again with a lower --train.lr.")
                )
            return Outcome(False, self.step, v, item.lr, stats.tokens, stats.flops, self.tokens_seen,
                           stats.mtp_weight, item.launched_at, self.bad_in_a_row, halted=item.gated)
        self.bad_in_a_row = 0
        if stats.fixed and self.fixed_from is None:
            self.fixed_from = self.step + 1
        if not item.gated:
            set_lr(self.optimizer, item.lr)
            self.optimizer.step()
            self._zero_grads()
            if stats.expert_load is not None:
                self.model.update_routing_bias(stats.expert_load, gamma=item.gamma)
        self.step += 1
        self.tokens_seen += stats.tokens
        return Outcome(True, self.step, v, item.lr, stats.tokens, stats.flops, self.tokens_seen, stats.mtp_weight,
                       item.launched_at)


    def _run_exact(self, item: _InFlight, needed: float) -> Outcome:
        """A step whose fixed-shape expert dispatch overflowed (a pair of ranks needed `needed` rows, more than its
        C; every rank read the same numbers): nothing of it was applied (gated: the device halted it and the steps
        queued behind it). Run it again from its batches on the exact dispatch, eagerly, as the step it is; then,
        with parallel.ep_capacity_growth, C grows past `needed` (the graphs, captured with the old C, are captured
        again), so that a routing still finding its balance does not run every step twice."""
        if item.gated:
            self._uncount()
            self._halt.zero_()
        self._zero_grads()
        self.overflows += 1
        old = self.par.dispatch.capacity
        self.log(f"note: step {self.step + 1}: expert parallelism's fixed-shape dispatch overflowed (a pair of ranks "
                 f"needed {needed:.0f} rows, more than {old}); the step runs again on the exact dispatch "
                 f"({self.overflows} so far)")
        unsettled = self.par.ep_unsettle()
        grown = None if unsettled else self.par.ep_grow(needed)
        if self.graphs is not None and (unsettled or grown is not None or not self.graphs.room()):
            self.graphs.forget()  # before the eager re-run: beside a 16B graph's pool it ran out of memory (4 H200s)
        again = self._launch(self._accumulate(iter(item.stats.batches), self.tokens_seen, exact=True),
                             lr_at(self.step, self.cfg.train), self.tokens_seen, gated=item.gated)
        done = self._settle(again)
        done.halted = done.halted or item.gated
        if unsettled:
            self.log(f"note: the exact dispatch from step {self.step + 1} until the routing settles again "
                     f"(parallel.ep_settle_steps)")
        if grown is not None:
            self.log(f"note: parallel.ep_capacity_growth: C {old} -> {grown} rows per pair of ranks from step "
                     f"{self.step + 1} (CUDA graphs captured again)")
        return done

    def _apply(self, stats: StepStats) -> tuple[bool, float, float]:
        """One accumulated step finished at once, as the loop without the overlap runs it: (applied, loss, grad
        norm); the step count goes up when applied."""
        o = self._settle(self._launch(stats, lr_at(self.step, self.cfg.train), self.tokens_seen, gated=False))
        return o.ok, o.values["loss"], o.values["grad_norm"]


    def _accumulate(self, batches, tokens: int | None = None, exact: bool = False) -> StepStats:
        """Forward and backward over the step's micro-batches. The losses are normalised once for the whole step:
        each micro-batch's summed next-token (and per-depth MTP) loss is divided by the step's count of valid
        targets, and its summed balance loss by the step's count of segments (per MoE layer group), both counted on
        the host copies of the batches before any of them runs (no device sync) and summed over the ranks, so a
        micro-batch with few targets or segments weighs no more than they do. exact: eagerly (no graphs), for a
        step run again on expert parallelism's exact dispatch."""
        t = self.cfg.train
        micro = [next(batches) for _ in range(t.grad_accum)]
        mtp_weight = self.mtp_loss_weight(tokens)
        stats = StepStats(batches=micro, mtp_weight=mtp_weight)
        if self.working is not None:
            self.working.before_step()
        depths = len(self.model.mtp)
        # [targets: next token, each MTP depth; segments: main layers, each MTP depth] of each micro-batch
        per_batch = [count_targets(b.targets, b.cu_seqlens, depths) + count_segments(b.targets, b.cu_seqlens, depths)
                     for b in micro]
        step_counts = [sum(c[i] for c in per_batch) for i in range(2 * (depths + 1))]
        counts = _to_device(torch.tensor(step_counts, dtype=torch.float32), self.device)
        counts = self.par.sum_(counts)  # the global batch's: every rank divides by the same counts (one all-reduce)
        num_targets, num_segments = counts[:depths + 1], counts[depths + 1:]
        self.par.ep_reset()
        exact = exact or self.par.ep_settling  # (the exact dispatch syncs with the host: no graphs)
        stats.fixed = not exact and self.par.dispatch is not None and self.par.dispatch.capacity is not None
        graphs = self.graphs if not exact else None
        with contextlib.nullcontext() if exact else self.par.ep_fixed_shapes():
            for batch in micro:
                done = graphs.run(batch, num_targets, num_segments, mtp_weight) if graphs is not None else None
                if done is None:
                    done = self._micro_eager(batch, num_targets, num_segments, mtp_weight)
                self._add(stats, batch, *done)  # (before the next replay overwrites a graph's outputs)
        return stats

    def _add(self, stats: StepStats, batch, loss, parts, load) -> None:
        """One micro-batch's results into the step's sums."""
        stats.loss = stats.loss + loss
        for name, value in parts.items():
            stats.parts[name] = stats.parts.get(name, 0.0) + value
        if load is not None:
            stats.expert_load = load if stats.expert_load is None else stats.expert_load + load
        stats.tokens += batch.num_tokens
        lens = batch.cu_seqlens.diff().double()
        mean_context = float((lens * lens).sum() / lens.sum())  # per-token attention span of this packing
        stats.flops += batch.num_tokens * (self._flops_a + self._flops_b * mean_context)

    def _micro_eager(self, batch, num_targets, num_segments, mtp_weight):
        dev = _to_device(batch, self.device)
        return self._micro(dev.input_ids, dev.cu_seqlens, dev.targets, dev.max_seqlen, num_targets, num_segments,
                           mtp_weight)

    def _micro(self, input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments, mtp_weight,
               graphed=False):
        """One micro-batch's forward and backward: (loss, parts, expert_load), detached. num_targets, num_segments:
        the step's loss denominators (device tensors). The same code runs eagerly and inside a CUDA graph
        (`train/graphs.py`; graphed: autocast's weight cache off, as graph capture needs)."""
        with registry.using(**self.backends), (self.working.active() if self.working is not None
                                                else contextlib.nullcontext()):
            return self._micro_inner(input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments,
                                     mtp_weight, graphed)


    def _micro_inner(self, input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments, mtp_weight,
                     graphed):
        alpha = self.model_cfg.aux_loss_alpha
        # no autocast where the weights are in the low precision already (a working copy, FSDP2's bf16 shards)
        low_weights = self.working is not None or self.par.masters is not None
        with self.autocast(cache=not graphed) if not low_weights else contextlib.nullcontext():
            out = self.forward(input_ids, cu_seqlens=cu_seqlens, targets=targets, max_seqlen=max_seqlen,
                               return_logits=False, num_targets=num_targets, num_segments=num_segments)
        parts = {"lm_loss": out.lm_loss}
        loss = out.lm_loss
        if out.mtp_loss is not None:
            parts["mtp_loss"] = out.mtp_loss
            loss = loss + mtp_weight * out.mtp_loss
        if out.balance_loss is not None:
            # divided by the step's segments already: summed over micro-batches and ranks, the step's mean
            parts["balance_loss"] = out.balance_loss
            loss = loss + alpha * parts["balance_loss"]
        loss.backward()
        if self.working is not None:
            self.working.collect()  # the gradients into its flat buffer
        load = out.expert_load.detach() if out.expert_load is not None else None
        return loss.detach(), {k: v.detach().float() for k, v in parts.items()}, load


    def _step_graphs(self):
        """(StepGraphs or None, a line saying which and why) from train.cuda_graphs."""
        mode = self.cfg.train.cuda_graphs
        if mode == "false":
            return None, "off (train.cuda_graphs=false)"
        why = graphs_lib.unavailable(self.device, self.cfg.train.compile, torchrun=self.par.active,
                                 ep=self.cfg.parallel.ep, grad_accum=self.cfg.train.grad_accum,
                                 ep_fixed=self.par.ep_fixed)
        if why is not None:
            if mode == "true":
                raise ConfigError(f"train.cuda_graphs=true but {why}")
            return None, f"off: {why}"
        # with a working copy its `collect` (inside the graph) moves the gradients; the graphs own none
        params = [] if self.working is not None else [p for p in self.model.parameters() if p.requires_grad]
        d = self.cfg.data
        agree = (lambda ok: self.par.sum_host([0.0 if ok else 1.0])[0] == 0) if self.par.active else None
        g = graphs_lib.StepGraphs(self._micro, params, self.device, d.tokens_per_batch, d.max_seqlen,
                              accumulate=self.cfg.train.grad_accum > 1, log=self.log, agree=agree)
        fsdp = " with FSDP2's gathers and gradient reductions inside" if self.par.active else ""
        return g, f"on: each micro-batch's forward and backward replays as one CUDA graph{fsdp} (train/graphs.py)"


    def _overlap(self):
        """(whether the host queues a step before reading the last one's verdict, a line saying why)."""
        mode = self.cfg.train.overlap_steps
        if mode == "false":
            return False, "off (train.overlap_steps=false)"
        if self.working is None and not self.optimizer.defaults.get("fused"):
            why = "it needs an optimizer that skips a step on the device (the working copy's, or fused AdamW: CUDA)"
            if mode == "true":
                raise ConfigError(f"train.overlap_steps=true but {why}")
            return False, f"off: {why}"
        if self.working is None and mode == "auto" and not self.par.active:
            return False, ("off: with fused AdamW in one process only when asked (train.overlap_steps=true; measured "
                           "under torchrun only)")
        how = "the working copy's optimizer" if self.working is not None else "fused AdamW (found_inf)"
        return True, (f"on: the host queues step N+1 before it reads step N's loss; a non-finite step is skipped on "
                      f"the device by {how}")


    def _uncount(self) -> None:
        """Take back the step count of a step the device skipped: FlatAdamW counts on the host; fused AdamW took its
        own back on the device (found_inf)."""
        if self.working is not None:
            self.optimizer.uncount()


    def _zero_grads(self) -> None:
        """After a step: freed, except where CUDA graphs add several micro-batches into kept tensors. With a working
        copy: nothing (its gradients are overwritten, or zeroed before the next step's first micro-batch)."""
        if self.working is not None:
            return
        self.optimizer.zero_grad(set_to_none=self.graphs is None or not self.graphs.accumulate)


    def stopping(self) -> bool:
        """Whether a signal asked the run to stop. Distributed: the request as all ranks agreed on it in the last
        step's all-reduce (a signal reaches the ranks at different moments; acting on it alone would split them)."""
        return self.stop_agreed if self.par.active else self.stop_requested


    def mtp_loss_weight(self, tokens: int | None = None) -> float:
        """lambda: train.mtp_loss_weight_schedule at `tokens` (default: the tokens seen so far), else
        model.mtp_loss_weight."""
        return piecewise(self.cfg.train.mtp_loss_weight_schedule, self.tokens_seen if tokens is None else tokens,
                         self.model_cfg.mtp_loss_weight)


    def bias_update_speed(self, tokens: int | None = None) -> float:
        """gamma: train.bias_update_speed_schedule at `tokens` (default: the tokens seen so far), else
        model.bias_update_speed."""
        return piecewise(self.cfg.train.bias_update_speed_schedule, self.tokens_seen if tokens is None else tokens,
                         self.model_cfg.bias_update_speed)

    def autocast(self, cache: bool = True):
        """torch.autocast to the run's compute dtype (a null context where it computes in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def settled(self, what: str) -> None:
        """Check that no step is in flight before `what` (an evaluation, a save): `advance` settles such steps."""
        if self._pending is not None:
            raise RuntimeError(f"internal error: {what} with an optimizer step still in flight")


def _to_device(x, device: torch.device):
    """A host tensor or `Batch` on `device`, queued without waiting: on CUDA through pinned memory (a copy from
    pageable memory waits for the stream first, which left the GPU idle while the host prepared the next step; torch's
    pinned-memory cache keeps a block until the copies queued from it have run)."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
