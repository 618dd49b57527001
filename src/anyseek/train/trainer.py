"""The training loop: packed Wikipedia batches -> DeepSeek-V3 -> AdamW, with validation, checkpoints and logs.

    summary = Trainer(load_run_config("tiny"), Path("runs/tiny")).run()

One optimizer step = `grad_accum` micro-batches of `data.tokens_per_batch` tokens. After each step the MoE routing
biases move toward balance (auxiliary-loss-free balancing). A NaN/Inf loss or gradient skips the step; `max_bad_steps`
in a row stop the run with the last good checkpoint intact. SIGINT/SIGTERM save a checkpoint and exit cleanly.

How a step runs (micro-batches, CUDA graphs, the overlap of step N+1 with step N's verdict, skipped and re-run
steps): `train/step.py`, which owns it; this module decides when to evaluate, save and stop.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from anyseek import checkpoint
from anyseek.constants import IGNORE_INDEX
from anyseek.data.loader import PackedLoader
from anyseek.data.prepare import ensure_prepared
from anyseek.data.shards import read_manifest
from anyseek.data.tokenizer import load_tokenizer, tokenizer_files
from anyseek.kernels import registry
from anyseek.model.transformer import DeepSeekV3
from anyseek.runtime import tune_cpu_allocator
from anyseek.train import precision
from anyseek.train.config import ConfigError, RunConfig, profile_window
from anyseek.train.metrics import MetricsLog, TrainProgress, peak_flops, read_metrics
from anyseek.train.optim import build_optimizer
from anyseek.train.parallel import Parallel, Silent
from anyseek.train.plot import write_loss_curve
from anyseek.train.precision import build_flat_adamw
from anyseek.train.preflight import check_prepared, check_vocab, claim_out_dir
from anyseek.train.profile import StepProfiler
from anyseek.train.resume import check_resume
from anyseek.train.saving import MAX_FAILED_SAVES, SaveFailed, Saves  # noqa: F401 (the trainer's names for them)
from anyseek.train.start import Start
from anyseek.train.step import Outcome, StepEngine, TrainingDiverged


class Trainer:
    def __init__(self, cfg: RunConfig, out_dir: Path, resume: bool = False, log: Callable[[str], None] = print,
                 resume_overrides: tuple[str, ...] = ()):
        """resume_overrides: run-config keys (e.g. "train.lr") that may differ from the checkpoint's on --resume."""
        self.cfg, self.out_dir, self.resume, self.log = cfg, Path(out_dir), resume, log
        self.resume_overrides = tuple(resume_overrides)
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        self.par = Parallel.from_torchrun(cfg.parallel, t.device)  # inactive unless launched by torchrun
        if not self.par.env.is_main:
            self.log = lambda message: None  # rank 0 prints and writes; every rank computes
        self.device = self.par.device if self.par.active else _pick_device(t.device)
        self.allocator = "allocator left as is"
        if self.device.type == "cpu" and t.tune_allocator:

            self.allocator = tune_cpu_allocator()
        self.autocast_dtype = precision.compute_dtype(t.dtype, self.device)
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        # the kernels this run asks for, in force while it runs (`registry.using`); an unknown name raises here
        self.backends = {"attention": t.attention_backend, "moe": t.moe_backend}
        with registry.using(**self.backends):
            pass

        if t.lora_rank and self.par.active:
            raise ConfigError("train.lora_rank: LoRA runs in one process for now (its checkpoints hold adapters, "
                              "sharded ones the whole model); launch without torchrun / --nproc-per-node")
        self.start = Start(cfg, self.device, self.autocast_dtype, self.log)  # --init and LoRA (train/start.py)
        self.data_dir = self._prepare_data()

        self.manifest = read_manifest(self.data_dir)  # first: its error says how to prepare the folder
        self.has_val = check_prepared(self.data_dir, self.manifest, self.log)
        self.tokenizer = load_tokenizer(self.data_dir)
        self.tokenizer_files = tokenizer_files(self.data_dir)


        self.model_cfg = self.start.model_config(self.data_dir, self.manifest)  # --init: the folder's config
        if self.model_cfg is None:
            self.model_cfg = cfg.model_config(vocab_size=int(self.manifest["vocab_size"]))
            check_vocab(self.data_dir, self.manifest, self.model_cfg.vocab_size)
        if not self.par.active:  # sharded runs: `anyseek plan` estimates the memory per GPU
            self.start.report_memory(self.model_cfg)
        self.model = self.start.build_model() or self._new_model()
        self.model_cfg = self.start.adapt(self.model)  # LoRA: wraps targets, freezes the base
        # EP, FSDP2, checkpointing: from outside
        self.model = self.par.parallelize(self.model, self.autocast_dtype, t.grad_accum, cfg.data.tokens_per_batch)
        self.model.train()
        self.working, self.working_note = self._working_copy()  # before the optimizer and graphs: its buffers
        if self.working is not None:

            self.optimizer = build_flat_adamw(self.working, t)
        else:
            if t.moments_dtype != "fp32":
                raise ConfigError(f"train.moments_dtype={t.moments_dtype} needs the working copy's optimizer, and "
                                  f"this run has none; weights: {self.working_note}")
            masters = self.par.masters.by_param() if self.par.masters is not None else None
            self.optimizer = build_optimizer(self.model, t, self.device, masters)
        self.engine = StepEngine(cfg, self.model, self.model_cfg, self.optimizer, self.par, self.device,
                                 self.autocast_dtype, self.working, self.out_dir, self.backends, self.log)
        self.train_loader = self._loader("train", loop=True)
        self.saves = Saves(cfg, self.out_dir, self.par, self.device, self.tokenizer_files, self.log)  # train/saving.py

    # the step loop's counters and choices live in the engine (train/step.py)
    step = property(lambda self: self.engine.step)
    tokens_seen = property(lambda self: self.engine.tokens_seen)
    bad_in_a_row = property(lambda self: self.engine.bad_in_a_row)
    graphs = property(lambda self: self.engine.graphs)
    overlap = property(lambda self: self.engine.overlap)

    # ------------------------------------------------------------------------------------------ setup

    def _prepare_data(self) -> Path:
        d = self.cfg.data
        if d.path:
            return Path(d.path)  # read_manifest below says so if it is not a prepared folder
        if self.start.init is not None:
            return self.start.prepare_data(d)

        return Path(ensure_prepared(source=d.source, vocab_size=d.vocab_size))

    def _loader(self, split: str, loop: bool):

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
        ckpts = checkpoint.checkpoints(self.out_dir)
        if not ckpts:
            self.log(f"--resume: {self.out_dir} holds no checkpoint yet; starting from scratch")
            return
        damaged = []
        for ckpt in reversed(ckpts):
            try:
                checkpoint.verify(ckpt.path, self.par.env)  # distributed: every rank the same verdict
            except checkpoint.CheckpointDamaged as e:
                self.log(f"warning: {e}; trying the previous checkpoint")
                damaged.append(ckpt.path.name)
                continue
            changes = check_resume(ckpt.path, self.cfg.to_dict(), self.data_identity(), self.resume_overrides,
                                   world_size=self.par.env.world_size, init_identity=self.start.ref)
            state = checkpoint.load(ckpt.path, self.model, self.optimizer, env=self.par.env,
                                    masters=self.par.masters, adapters=self.start.adapters, verified=True)
            self.train_loader.load_state_dict(self.par.loader_state(state, self.train_loader))
            if self.working is not None:
                self.working.refresh()  # the loaded master weights into the working copy
            engine = self.engine
            engine.step, engine.tokens_seen = state["step"], state["tokens_seen"]
            engine.bad_in_a_row = int(state.get("bad_in_a_row", 0))
            self.log(f"resumed from {ckpt.path} at step {self.step}" + (f" (changed: {'; '.join(changes)})"
                                                                         if changes else ""))
            return
        raise checkpoint.CheckpointDamaged(
            f"every checkpoint in {self.out_dir} is damaged ({', '.join(damaged)}); nothing was changed. "
            "Move them away to start over, or pass --out NEW_DIR"
        )

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        """Train to train.max_steps (or a stop request), evaluating, saving and logging on the config's cadence;
        returns the summary (validation loss, the last checkpoint, the sample)."""
        with registry.using(**self.backends), contextlib.ExitStack() as held:
            # rank 0 takes the folder for the run's life (another live run there: FolderInUse on every rank) and
            # cleans up what killed saves left; a crash or kill -9 releases it with the process
            self.par.on_main(lambda: held.callback(claim_out_dir(self.out_dir, self.log).release))
            return self._run()

    def _run(self) -> dict[str, Any]:
        t = self.cfg.train
        if self.resume:
            self._resume()
        elif checkpoint.checkpoints(self.out_dir):
            raise FileExistsError(
                f"{self.out_dir} already holds checkpoints; pass --resume to continue that run or --out NEW_DIR"
            )
        self._describe()
        main, engine = self.par.env.is_main, self.engine
        metrics = MetricsLog(self.out_dir, tensorboard=t.tensorboard, log=self.log) if main else Silent()
        progress = TrainProgress(t.max_steps, start=self.step, every=t.log_every,
                                 balance_layers=len(self.model.moe_layers())) if main else Silent()
        old_handlers = self._install_signal_handlers()
        peak = peak_flops(self.device)
        batches = iter(self.train_loader)
        t_start = time.perf_counter()
        window = {"t": time.perf_counter(), "tokens": 0, "flops": 0.0}
        summary: dict[str, Any] = {}
        prof_window = profile_window(t.profile)
        profiler = (StepProfiler(prof_window, self.out_dir, self.par.env.rank, self.device, self.log) if prof_window
                    else None)

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
            self.saves.poll()  # a checkpoint written in the background since: "saved ..." (or its failure)
            self.saves.prepare(self.model, self.optimizer, self.par.masters)  # (once the optimizer's state exists)

        try:
            while True:
                if engine.stopping():
                    for o in engine.flush():
                        record(o)
                    break
                if self.step >= t.max_steps:
                    break
                if profiler:
                    profiler.before(self.step + 1)
                for o in engine.advance(batches):
                    record(o)
            if profiler:
                profiler.close()
            progress.close()
            if engine.stopping():
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
        except KeyboardInterrupt:  # a second Ctrl-C: leave now, without the save in flight
            self.saves.abandon()
            raise
        finally:
            self.saves.drain()  # leaving on an error: the background save in flight completes first
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
                with registry.using(**self.backends), self.engine.autocast():
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
        self.engine.settled("an evaluation")
        loss, count = self.evaluate()
        ppl = math.exp(loss) if loss < 50 else float("inf")
        metrics.write("val", self.step, {"loss": loss, "perplexity": ppl, "tokens": count})
        self.log(f"step {self.step}: validation loss {loss:.4f}, perplexity {ppl:.2f} ({count:,} tokens)")
        return loss

    def _save(self, periodic: bool = False) -> Path | None:
        """Write step-N, in the background or not (train.async_save); what a failed write means: `Saves`
        (train/saving.py). Returns the folder once complete (None while in the background, or after a tolerated
        failure)."""
        self.engine.settled("a save")
        state = {"tokens_seen": self.tokens_seen, "loader": self.train_loader.state_dict(),
                 "bad_in_a_row": self.bad_in_a_row, "data": self.data_identity(), **self.start.record()}
        return self.saves.save(self.step, self.model, self.optimizer, state, periodic, masters=self.par.masters,
                               adapters=self.start.adapters)

    def _finish(self, metrics: MetricsLog) -> dict[str, Any]:
        val_loss = self._evaluate(metrics) if self.has_val else float("nan")
        path = self._save()

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
        if self.engine.graphs is not None:
            self.engine.graphs.release()

    def sample(self) -> str:
        t = self.cfg.train
        prompt = self.tokenizer.encode(t.sample_prompt).ids
        with registry.using(**self.backends), self.engine.autocast():  # sharded: a lockstep twin every rank runs
            new = self.par.generate(self.model, prompt, t.sample_tokens, eos_token_id=self.manifest.get("eos_token_id"),
                                    seed=t.seed)
        self.par.release(self.model)
        return self.tokenizer.decode(new)

    # ------------------------------------------------------------------------------------------ helpers

    def _new_model(self) -> DeepSeekV3:
        """A fresh model (train.seed), on the device. Under torchrun on GPUs it is initialised there, by the GPU's
        generator: on the host every rank would hold the whole fp32 model at once (4 ranks of 16B: 250 GB) and
        initialise it on the one thread torchrun gives each process (16B: minutes). Every rank draws the same
        weights either way (the same seed); one process keeps the host's generator (its runs as before)."""
        if self.par.active and self.device.type == "cuda":
            return DeepSeekV3(self.model_cfg, device=self.device).to(self.device)  # (the rope tables: host)
        return DeepSeekV3(self.model_cfg).to(self.device)

    def _describe(self) -> None:
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
        self.log(f"CUDA graphs: {self.engine.graphs_note}")
        self.log(f"overlap: {self.engine.overlap_note}")
        self.log(f"checkpoints: {self.saves.note}")
        with registry.using(**self.backends):
            for row in registry.describe(device=self.device):
                self.log("kernel: " + " | ".join(str(c) for c in row))

    def _install_signal_handlers(self) -> dict:
        def request_stop(signum, frame):
            if self.engine.stop_requested:  # a second Ctrl-C: stop now
                raise KeyboardInterrupt
            self.engine.stop_requested = True
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
