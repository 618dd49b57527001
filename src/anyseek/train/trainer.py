"""The training loop: packed Wikipedia batches -> DeepSeek-V3 -> AdamW, with validation, checkpoints and logs.

    summary = Trainer(load_run_config("tiny"), Path("runs/tiny")).run()

One optimizer step = `grad_accum` micro-batches of `data.tokens_per_batch` tokens. After each step the MoE routing
biases move toward balance (auxiliary-loss-free balancing). A NaN/Inf loss or gradient skips the step; `max_bad_steps`
in a row stop the run with the last good checkpoint intact. SIGINT/SIGTERM save a checkpoint and exit cleanly.

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
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anyseek.constants import IGNORE_INDEX
from anyseek.distributed.parallel import Parallel, Silent
from anyseek.model.mtp import count_segments, count_targets
from anyseek.train import checkpoint as ckpt_lib
from anyseek.train import precision
from anyseek.train.config import ConfigError, RunConfig, piecewise
from anyseek.train.metrics import MetricsLog, TrainProgress, peak_flops
from anyseek.train.optim import build_optimizer, lr_at, set_lr
from anyseek.train.preflight import check_prepared, check_vocab, check_writable, describe_os_error
from anyseek.train.resume import check_resume
from anyseek.train.start import Start


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder); the message says why in one line."""


MAX_FAILED_SAVES = 3  # periodic saves that may fail in a row (training goes on) before the run stops

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


_TOKENS, _STOP = "tokens (all ranks)", "stop requests (all ranks)"  # read back with a step's verdict


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


class Trainer:
    def __init__(self, cfg: RunConfig, out_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
                 resume_overrides: tuple[str, ...] = ()):
        """resume_overrides: run-config keys (e.g. "train.lr") that may differ from the checkpoint's on --resume."""
        self.cfg, self.out_dir, self.resume, self.log = cfg, Path(out_dir), resume, log
        self.resume_overrides = tuple(resume_overrides)
        self.stop_requested = False
        self.stop_agreed = False  # distributed: the stop every rank saw in the step's all-reduce (`_stopping`)
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.par = Parallel.from_torchrun(cfg.parallel, t.device)  # inactive unless launched by torchrun
        if not self.par.env.is_main:
            self.log = lambda message: None  # rank 0 prints and writes; every rank computes
        self.device = self.par.device if self.par.active else _pick_device(t.device)
        self.allocator = "allocator left as is"
        if self.device.type == "cpu" and t.tune_allocator:
            from anyseek.runtime import tune_cpu_allocator

            self.allocator = tune_cpu_allocator()
        self.autocast_dtype = precision.compute_dtype(t.dtype, self.device)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        from anyseek.kernels import registry

        registry.set_backend("attention", t.attention_backend)  # an unknown name raises here, naming it
        registry.set_backend("moe", t.moe_backend)

        if t.lora_rank and self.par.active:
            raise ConfigError("train.lora_rank: LoRA runs in one process for now (its checkpoints hold adapters, "
                              "sharded ones the whole model); launch without torchrun / --nproc-per-node")
        self.start = Start(cfg, self.device, self.autocast_dtype, self.log)  # --init and LoRA (train/start.py)
        self.data_dir = self._prepare_data()
        from anyseek.data.shards import read_manifest
        from anyseek.data.tokenizer import load_tokenizer, tokenizer_files

        self.manifest = read_manifest(self.data_dir)  # first: its error says how to prepare the folder
        self.has_val = check_prepared(self.data_dir, self.manifest, self.log)
        self.tokenizer = load_tokenizer(self.data_dir)
        self.tokenizer_files = tokenizer_files(self.data_dir)

        from anyseek.model.transformer import DeepSeekV3

        self.model_cfg = self.start.model_config(self.data_dir, self.manifest)  # --init: the folder's config
        if self.model_cfg is None:
            self.model_cfg = cfg.model_config(vocab_size=int(self.manifest["vocab_size"]))
            check_vocab(self.data_dir, self.manifest, self.model_cfg.vocab_size)
        if not self.par.active:  # sharded runs: `anyseek plan` estimates the memory per GPU
            self.start.report_memory(self.model_cfg)
        self.model = self.start.build_model() or DeepSeekV3(self.model_cfg).to(self.device)
        self.model_cfg = self.start.adapt(self.model)  # LoRA: wraps targets, freezes the base
        # EP, FSDP2, checkpointing: from outside
        self.model = self.par.parallelize(self.model, self.autocast_dtype, t.grad_accum)
        self.model.train()
        self.working, self.working_note = self._working_copy()  # before the optimizer and graphs: its buffers
        if self.working is not None:
            from anyseek.train.precision import build_flat_adamw

            self.optimizer = build_flat_adamw(self.working, t)
        else:
            if t.moments_dtype != "fp32":
                raise ConfigError(f"train.moments_dtype={t.moments_dtype} needs the working copy's optimizer, and "
                                  f"this run has none; weights: {self.working_note}")
            masters = self.par.masters.by_param() if self.par.masters is not None else None
            self.optimizer = build_optimizer(self.model, t, self.device, masters)
        self.forward = torch.compile(self.model) if t.compile else self.model
        self.graphs, self.graphs_note = self._step_graphs()
        # fused AdamW (one process or sharded: it takes DTensors and a plain grad_scale alike) and the working copy's:
        # the clip factor goes into its kernel (grad_scale divides each gradient as it is read), which saves a pass
        # over the gradients (under torchrun on `small`: 1.4 ms a step over the fp32 sharded gradients)
        self._fold_clip = self.working is not None or bool(self.optimizer.defaults.get("fused"))
        # flops_per_token(L) = a + b*L; computed once here, not per batch (it walks every module)
        self._flops_a = self.model.flops_per_token(0)
        self._flops_b = self.model.flops_per_token(1) - self._flops_a
        self.step = 0
        self.tokens_seen = 0
        self.bad_in_a_row = 0
        self.train_loader = self._loader("train", loop=True)
        self.overlap, self.overlap_note = self._overlap()
        self._pending: _InFlight | None = None
        self._halt = torch.zeros((), dtype=torch.float32, device=self.device)  # set on the device by a bad step
        if self.overlap and self.working is not None:
            self.optimizer.skip = self._halt
        elif self.overlap:  # fused AdamW: skips where found_inf is nonzero, its step counts restored on the device
            self.optimizer.found_inf = self._halt

    # ------------------------------------------------------------------------------------------ setup

    def _prepare_data(self) -> Path:
        d = self.cfg.data
        if d.path:
            return Path(d.path)  # read_manifest below says so if it is not a prepared folder
        if self.start.init is not None:
            return self.start.prepare_data(d)
        from anyseek.data.prepare import ensure_prepared

        return Path(ensure_prepared(source=d.source, vocab_size=d.vocab_size))

    def _loader(self, split: str, loop: bool):
        from anyseek.data.loader import PackedLoader

        d = self.cfg.data
        share = self.par.loader_args() if loop else {}  # every rank validates on the same batches
        return PackedLoader(self.data_dir, split=split, tokens_per_batch=d.tokens_per_batch, max_seqlen=d.max_seqlen,
                            seed=self.cfg.train.seed, loop=loop, **share)

    def data_identity(self) -> dict[str, Any]:
        """What the prepared data is, recorded in every checkpoint and compared on --resume."""
        return {"fingerprint": self.manifest.get("fingerprint"), "vocab_size": int(self.manifest["vocab_size"])}

    def _resume(self) -> None:
        """Continue from the newest checkpoint that is intact and was written by this run on this data.
        A damaged checkpoint (files not as recorded) falls back to the previous one; a mismatching or unloadable one
        is an error that changes nothing; only a folder without any checkpoint starts from scratch."""
        ckpts = ckpt_lib.list_checkpoints(self.out_dir)
        if not ckpts:
            self.log(f"--resume: {self.out_dir} holds no checkpoint yet; starting from scratch")
            return
        damaged = []
        for ckpt in reversed(ckpts):
            try:
                self.par.verify(ckpt.path)  # distributed: every rank the same verdict, each hashing a share
            except ckpt_lib.CheckpointDamaged as e:
                self.log(f"warning: {e}; trying the previous checkpoint")
                damaged.append(ckpt.path.name)
                continue
            changes = check_resume(ckpt.path, self.cfg.to_dict(), self.data_identity(), self.resume_overrides,
                                   world_size=self.par.env.world_size, init_identity=self.start.ref)
            if self.par.loads(ckpt.path):  # sharded checkpoints, or any checkpoint into a sharded model (reshards)
                state = self.par.load_checkpoint(ckpt.path, self.model, self.optimizer, self.train_loader)
            else:  # LoRA: start.load_model reads the adapters
                state = ckpt_lib.load_training_state(ckpt.path, self.model, self.optimizer, self.start.load_model)
            self.train_loader.load_state_dict(state["loader"])
            if self.working is not None:
                self.working.refresh()  # the loaded master weights into the working copy
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.bad_in_a_row = int(state.get("bad_in_a_row", 0))
            self.log(f"resumed from {ckpt.path} at step {self.step}" + (f" (changed: {'; '.join(changes)})"
                                                                         if changes else ""))
            return
        raise ckpt_lib.CheckpointDamaged(
            f"every checkpoint in {self.out_dir} is damaged ({', '.join(damaged)}); nothing was changed. "
            "Move them away to start over, or pass --out NEW_DIR"
        )

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        t = self.cfg.train
        self.par.on_main(lambda: check_writable(self.out_dir, self.log))  # rank 0 cleans up; every rank learns
        if self.resume:
            self._resume()
        elif ckpt_lib.list_checkpoints(self.out_dir):
            raise FileExistsError(
                f"{self.out_dir} already holds checkpoints; pass --resume to continue that run or --out NEW_DIR"
            )
        self._describe()
        main = self.par.env.is_main
        metrics = MetricsLog(self.out_dir, tensorboard=t.tensorboard) if main else Silent()
        progress = TrainProgress(t.max_steps, start=self.step, every=t.log_every) if main else Silent()
        old_handlers = self._install_signal_handlers()
        peak = peak_flops(self.device)
        batches = iter(self.train_loader)
        t_start = time.perf_counter()
        window = {"t": time.perf_counter(), "tokens": 0, "flops": 0.0}
        summary: dict[str, Any] = {}

        def record(o: Outcome) -> None:
            window["tokens"] += o.tokens
            window["flops"] += o.flops
            if not o.ok:
                metrics.write("skip", o.step, {"loss": o.values["loss"], "grad_norm": o.values["grad_norm"],
                                               "in_a_row": o.in_a_row})
                return
            if o.step % t.log_every == 0 or o.step == t.max_steps:
                # timed from launch to launch: with the overlap a step settles one step after it was queued
                elapsed = max(o.launched_at - window["t"], 1e-9)
                self._log_step(metrics, progress, o, window["tokens"] / elapsed, window["flops"] / elapsed, peak)
                window.update(t=o.launched_at, tokens=0, flops=0.0)
            # a step after which the loop evaluates or saves is settled before anything else is queued (`advance`)
            if o.step % t.eval_every == 0 and o.step < t.max_steps and self.has_val:
                self._evaluate(metrics)
            if o.step % t.save_every == 0 and o.step < t.max_steps:
                self._save(periodic=True)

        try:
            while True:
                if self._stopping():
                    for o in self.flush():
                        record(o)
                    break
                if self.step >= t.max_steps:
                    break
                for o in self.advance(batches):
                    record(o)
            progress.close()
            if self._stopping():
                self.log(f"stop requested: saving step {self.step} and exiting")
                self._save()
                summary = {"stopped_early": True}
            else:
                summary = self._finish(metrics)
        except TrainingDiverged as e:
            progress.close()
            self.log(f"error: {e}")
            summary = {"diverged": str(e)}
            raise
        finally:
            metrics.close()
            self._restore_signal_handlers(old_handlers)
            summary.update(step=self.step, tokens_seen=self.tokens_seen, wall_s=time.perf_counter() - t_start)
        return summary

    def _log_step(self, metrics, progress, o: Outcome, tokens_per_s, flops_per_s, peak) -> None:
        v = o.values
        row = {"loss": v["loss"], "lr": o.lr, "grad_norm": v["grad_norm"], "tokens_per_s": tokens_per_s,
               "tokens_seen": o.tokens_seen, "tflops": flops_per_s / 1e12}
        row.update({k: x for k, x in v.items() if k not in ("loss", "grad_norm")})
        if "mtp_loss" in v:
            row["mtp_loss_weight"] = o.mtp_weight
        if peak:
            row["mfu"] = flops_per_s / peak
        metrics.write("train", o.step, row)
        shown = {"mtp": row["mtp_loss"]} if "mtp_loss" in row else {}
        if "balance_loss" in row:
            shown["balance"] = row["balance_loss"]
        progress.update(o.step, row.get("lm_loss", v["loss"]), tokens_per_s, shown)

    # ------------------------------------------------------------------------------------------ one step

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
            if not done[-1].ok:  # the device halted: `launched` was not applied; run it again as the step it is
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
        # losses, expert loads, tokens and stop requests of every rank (no host sync; with the overlap the counts on
        # the host, for the next step's schedules and the agreed stop)
        self.par.sum_step(stats, counts_on_host=self.overlap)
        loss = torch.as_tensor(stats.loss, dtype=torch.float32, device=self.device).reshape(())
        grad_norm = grad_norm.float().reshape(())
        if gated:
            bad = ~torch.isfinite(loss + grad_norm)  # grad_norm >= 0: the sum is finite iff both are
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
                       if ckpt_lib.latest_checkpoint(self.out_dir, log=lambda s: None) is not None
                       else "No checkpoint was written yet; start again with a lower --train.lr.")
                )
            return Outcome(False, self.step, v, item.lr, stats.tokens, stats.flops, self.tokens_seen,
                           stats.mtp_weight, item.launched_at, self.bad_in_a_row)
        self.bad_in_a_row = 0
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

    def _apply(self, stats: StepStats) -> tuple[bool, float, float]:
        """One accumulated step finished at once, as the loop without the overlap runs it: (applied, loss, grad
        norm); the step count goes up when applied."""
        o = self._settle(self._launch(stats, lr_at(self.step, self.cfg.train), self.tokens_seen, gated=False))
        return o.ok, o.values["loss"], o.values["grad_norm"]

    def _accumulate(self, batches, tokens: int | None = None) -> StepStats:
        """Forward and backward over the step's micro-batches. The losses are normalised once for the whole step:
        each micro-batch's summed next-token (and per-depth MTP) loss is divided by the step's count of valid
        targets, and its summed balance loss by the step's count of segments (per MoE layer group), both counted on
        the host copies of the batches before any of them runs (no device sync) and summed over the ranks, so a
        micro-batch with few targets or segments weighs no more than they do."""
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
        for batch in micro:
            done = (self.graphs.run(batch, num_targets, num_segments, mtp_weight) if self.graphs is not None
                    else None)
            if done is None:
                dev = _to_device(batch, self.device)
                done = self._micro(dev.input_ids, dev.cu_seqlens, dev.targets, dev.max_seqlen, num_targets,
                                   num_segments, mtp_weight)
            loss, parts, load = done
            stats.loss = stats.loss + loss
            for name, value in parts.items():
                stats.parts[name] = stats.parts.get(name, 0.0) + value
            if load is not None:
                stats.expert_load = load if stats.expert_load is None else stats.expert_load + load
            stats.tokens += batch.num_tokens
            lens = batch.cu_seqlens.diff().double()
            mean_context = float((lens * lens).sum() / lens.sum())  # per-token attention span of this packing
            stats.flops += batch.num_tokens * (self._flops_a + self._flops_b * mean_context)
        return stats

    def _micro(self, input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments, mtp_weight,
               graphed=False):
        """One micro-batch's forward and backward: (loss, parts, expert_load), detached. num_targets, num_segments:
        the step's loss denominators (device tensors). The same code runs eagerly and inside a CUDA graph
        (`train/graphs.py`; graphed: autocast's weight cache off, as graph capture needs)."""
        with self.working.active() if self.working is not None else contextlib.nullcontext():
            return self._micro_inner(input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments,
                                     mtp_weight, graphed)

    def _micro_inner(self, input_ids, cu_seqlens, targets, max_seqlen, num_targets, num_segments, mtp_weight,
                     graphed):
        alpha = self.model_cfg.aux_loss_alpha
        # no autocast where the weights are in the low precision already (a working copy, FSDP2's bf16 shards)
        low_weights = self.working is not None or self.par.masters is not None
        with self._autocast(cache=not graphed) if not low_weights else contextlib.nullcontext():
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
        from anyseek.train import graphs

        mode = self.cfg.train.cuda_graphs
        if mode == "false":
            return None, "off (train.cuda_graphs=false)"
        why = graphs.unavailable(self.device, self.cfg.train.compile, torchrun=self.par.active,
                                 ep=self.cfg.parallel.ep, grad_accum=self.cfg.train.grad_accum)
        if why is not None:
            if mode == "true":
                raise ConfigError(f"train.cuda_graphs=true but {why}")
            return None, f"off: {why}"
        # with a working copy its `collect` (inside the graph) moves the gradients; the graphs own none
        params = [] if self.working is not None else [p for p in self.model.parameters() if p.requires_grad]
        d = self.cfg.data
        g = graphs.StepGraphs(self._micro, params, self.device, d.tokens_per_batch, d.max_seqlen,
                              accumulate=self.cfg.train.grad_accum > 1, log=self.log)
        fsdp = " with FSDP2's gathers and gradient reductions inside" if self.par.active else ""
        return g, f"on: each micro-batch's forward and backward replays as one CUDA graph{fsdp} (train/graphs.py)"

    def _working_copy(self):
        """(WorkingCopy or None, a line saying which and why) from train.working_copy."""
        mode = self.cfg.train.working_copy
        low = self.autocast_dtype
        if self.par.masters is not None:  # (train.working_copy=true too: these are its equivalent under torchrun)
            shards = str(self.par.masters.dtype).replace("torch.bfloat16", "bf16")
            return None, (f"FSDP2's shards in {shards}, their fp32 master weights beside them, written by the "
                          "optimizer kernel (parallel.shard_dtype)")
        if mode == "false":
            return None, f"fp32, autocast to {low} at each use (train.working_copy=false)" if low else "fp32"
        why = precision.unavailable(self.device, self.par.active, low, asked=mode == "true")
        if why is not None:
            if mode == "true":
                raise ConfigError(f"train.working_copy=true but {why}")
            return None, "fp32" + (f", autocast to {low}" if low else "") + f" (no working copy: {why})"
        w = precision.WorkingCopy(self.model, low, accumulate=self.cfg.train.grad_accum > 1)
        return w, (f"fp32 master weights, forward and backward on a {str(low).replace('torch.', '')} working copy "
                   f"written by the optimizer kernel (+{w.nbytes() / 2**20:,.0f} MiB; train/precision.py)")

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

    def _stopping(self) -> bool:
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

    # ------------------------------------------------------------------------------------------ eval, save, end

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int]:
        """Mean next-token loss on the first `eval_tokens` validation tokens, and how many targets it covered."""
        self.model.eval()
        total, count = 0.0, 0
        try:
            for batch in self._loader("val", loop=False):
                n = int((batch.targets != IGNORE_INDEX).sum())  # on the host copy: no device sync
                if n == 0:
                    continue
                dev = batch.to(self.device)
                with self._autocast():
                    out = self.model(dev.input_ids, cu_seqlens=dev.cu_seqlens, targets=dev.targets,
                                     max_seqlen=dev.max_seqlen, return_logits=False)
                total += float(out.lm_loss) * n
                count += n
                if count >= self.cfg.train.eval_tokens:
                    break
        finally:
            self.model.train()
            self.par.release(self.model)
        return (total / count if count else float("nan")), count

    def _evaluate(self, metrics: MetricsLog) -> float:
        self._settled("an evaluation")
        loss, count = self.evaluate()
        ppl = math.exp(loss) if loss < 50 else float("inf")
        metrics.write("val", self.step, {"loss": loss, "perplexity": ppl, "tokens": count})
        self.log(f"step {self.step}: validation loss {loss:.4f}, perplexity {ppl:.2f} ({count:,} tokens)")
        return loss

    def _save(self, periodic: bool = False) -> Path | None:
        """Write step-N. A periodic save that fails (full disk, read-only folder) is reported in one line and
        training goes on (the staging folder is already gone) until MAX_FAILED_SAVES fail in a row; any other
        failed save raises SaveFailed."""
        self._settled("a save")
        state = {"tokens_seen": self.tokens_seen, "loader": self.train_loader.state_dict(),
                 "bad_in_a_row": self.bad_in_a_row, "data": self.data_identity(), **self.start.record()}
        args = (self.out_dir, self.step, self.model, self.optimizer, state, self.cfg.to_dict(), self.tokenizer_files,
                self.cfg.train.keep_last)
        try:  # distributed: a failure on any rank raises OSError on every rank, so all decide alike below
            if self.par.active:
                path = self.par.save_checkpoint(*args)
            else:  # LoRA: the adapters (start.write_model) in place of the model files
                path = ckpt_lib.save_checkpoint(*args, write_model=self.start.write_model)
        except OSError as e:
            self.failed_saves = getattr(self, "failed_saves", 0) + 1
            why = f"could not save step {self.step} in {self.out_dir}: {describe_os_error(e)}"
            if periodic and self.failed_saves < MAX_FAILED_SAVES:
                self.log(f"warning: {why}; training goes on and tries again at the next save")
                return None
            raise SaveFailed(why) from None
        self.failed_saves = 0
        self.log(f"saved {path}")
        return path

    def _settled(self, what: str) -> None:
        if self._pending is not None:  # `advance` settles such steps at once: reaching this is a bug
            raise RuntimeError(f"internal error: {what} with an optimizer step still in flight")

    def _finish(self, metrics: MetricsLog) -> dict[str, Any]:
        val_loss = self._evaluate(metrics) if self.has_val else float("nan")
        path = self._save()
        from anyseek.train.metrics import read_metrics
        from anyseek.train.plot import write_loss_curve

        rows = read_metrics(metrics.path) if self.par.env.is_main else []
        curve = write_loss_curve(
            self.out_dir / "loss.png",
            [(r["step"], r.get("lm_loss", r["loss"])) for r in rows if r["kind"] == "train"],
            [(r["step"], r["loss"]) for r in rows if r["kind"] == "val"],
            title=f"{self.cfg.model.flavor} on {self.cfg.data.path or self.cfg.data.source}",
        ) if self.par.env.is_main else None
        sample = self.sample()
        self.log(f"loss curve: {curve}")
        self.log(f"sample: {self.cfg.train.sample_prompt}{sample}")
        return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss) if val_loss < 50 else float("inf"),
                "checkpoint": str(path), "sample": sample}

    def close(self) -> None:
        """Release what holds the process group's communicators before the group is destroyed: the CUDA graphs
        (`StepGraphs.release`). The trainer can still evaluate or sample afterwards, eagerly."""
        if self.graphs is not None:
            self.graphs.release()

    def sample(self) -> str:
        t = self.cfg.train
        prompt = self.tokenizer.encode(t.sample_prompt).ids
        with self._autocast():  # anyseek.generate; sharded, a lockstep twin every rank runs
            new = self.par.generate(self.model, prompt, t.sample_tokens, eos_token_id=self.manifest.get("eos_token_id"),
                                    seed=t.seed)
        self.par.release(self.model)
        return self.tokenizer.decode(new)

    # ------------------------------------------------------------------------------------------ helpers

    def _describe(self) -> None:
        from anyseek.kernels import registry

        m = self.model
        d = self.cfg.data
        name = self.cfg.train.init or self.cfg.model.flavor
        self.log(f"model: {name} | {m.num_parameters() / 1e6:.2f}M parameters "
                 f"({m.num_parameters(active_only=True) / 1e6:.2f}M active) | device {self.device} "
                 f"| computes in {self.autocast_dtype or torch.float32} | {torch.get_num_threads()} threads "
                 f"| {self.allocator}")
        self.log(f"data: {self.data_dir} | {self.manifest.get('vocab_size')} vocab | {d.tokens_per_batch} tokens x "
                 f"{self.cfg.train.grad_accum} micro-batches per step")
        moments = ("bf16 with stochastic rounding (train.moments_dtype=bf16)" if self.cfg.train.moments_dtype == "bf16"
                   else "fp32")
        self.log(f"weights: {self.working_note} | AdamW moments {moments}")
        self.log(f"CUDA graphs: {self.graphs_note}")
        self.log(f"overlap: {self.overlap_note}")
        describe = getattr(registry, "describe", None)
        if describe is not None:
            for row in describe(device=self.device):
                self.log("kernel: " + " | ".join(str(c) for c in row))

    def _autocast(self, cache: bool = True):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype, cache_enabled=cache)

    def _install_signal_handlers(self) -> dict:
        def request_stop(signum, frame):
            if self.stop_requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.stop_requested = True
            self.log(f"\nreceived signal {signum}: finishing step {self.step + 1}, then saving")

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not the main thread
                pass
        return old

    @staticmethod
    def _restore_signal_handlers(old: dict) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name!r} but this PyTorch build sees no CUDA GPU (see `anyseek doctor`)")
    return device


def _to_device(x, device: torch.device):
    """A host tensor or `Batch` on `device`, queued without waiting: on CUDA through pinned memory (a copy from
    pageable memory waits for the stream first, which left the GPU idle while the host prepared the next step; torch's
    pinned-memory cache keeps a block until the copies queued from it have run)."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)
