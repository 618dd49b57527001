"""How long a checkpoint stops training: a synchronous save against a save in the background (train.async_save).

    python benchmarks/checkpoint_save.py --flavor small                                   # one GPU
    torchrun --nproc-per-node 4 benchmarks/checkpoint_save.py --flavor 16B --out /nvme/x   # 4 GPUs (sharded folders)
    python benchmarks/checkpoint_save.py --flavor tiny --device cpu --layers 2 \
        --override=--data.tokens_per_batch=512 --override=--data.max_seqlen=128           # logic check on the CPU

The trainer builds the model as `anyseek train` does (the flavor, `--layers` decoder layers, the flavor's own
vocabulary; under torchrun FSDP2 with bf16 shards and their fp32 masters; in one GPU process the fp32 masters and
their bf16 working copy) and trains `--steps` steps on the built-in sample, so that every AdamW moment exists. Then,
into `--out` (one step-N folder at a time there, deleted after each row: a 16B save is ~186 GB):

  synchronous save          `checkpoint.save`, as with train.async_save=false: the loop waits for every file
  host buffers              as the trainer does after its first step: made (and pinned) in a thread while the
                            loop trains on; the time they took and the steps meanwhile (--unprepared: not made)
  background, first save    the loop is blocked while the state is copied to the host buffers (made at this save
                            with --unprepared); then the thread writes (serialize, fsync, sha256, checkpoint.json,
                            rename)
  background, next save     the same with the buffers kept from the first (every save of a run after its first)
  training step             ms per step alone, and while the thread writes (the loop trains on until every rank's
                            write is done: the writer's share of the host, the GIL included); the loop time lost
                            is the blocked copy plus what those steps took beyond a step alone

Under torchrun every time is the slowest rank's. The table is printed by rank 0 (and written to OUT/result.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from anyseek import checkpoint
from anyseek.train.config import load_run_config
from anyseek.train.trainer import Trainer


def build(args) -> Trainer:
    from anyseek.model.config import ModelConfig

    vocab = args.vocab or ModelConfig.from_name(args.flavor).vocab_size
    overrides = [f"--model.vocab_size={vocab}", f"--train.device={args.device}", "--train.tensorboard=false",
                 "--train.max_steps=1000000", "--train.save_every=1000000", "--train.eval_every=1000000",
                 *args.override]
    if args.layers:
        overrides.append(f"--model.num_hidden_layers={args.layers}")
    cfg = load_run_config(args.flavor, overrides)
    return Trainer(cfg, Path(args.out) / "run", log=lambda s: None)


def train(trainer: Trainer, batches, n: int) -> float:
    """Run `n` optimizer steps; seconds per step (this rank's)."""
    engine, target = trainer.engine, trainer.step + n
    sync(trainer)
    t0 = time.perf_counter()
    while engine.step < target:
        engine.advance(batches)
    engine.flush()
    sync(trainer)
    return (time.perf_counter() - t0) / n


def save_args(trainer: Trainer, out: Path) -> tuple:
    """What `Trainer._save` hands the checkpoint package (see train/trainer.py)."""
    state = {"tokens_seen": trainer.tokens_seen, "loader": trainer.train_loader.state_dict(),
             "bad_in_a_row": trainer.bad_in_a_row, "data": trainer.data_identity(), **trainer.start.record()}
    return (out, trainer.step, trainer.model, trainer.optimizer, state, trainer.cfg.to_dict(),
            trainer.tokenizer_files, 1)


def sync(trainer: Trainer) -> None:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def slowest(trainer: Trainer, seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective under torchrun)."""
    env = trainer.par.env
    if not env.active or env.world_size == 1:
        return seconds
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def barrier(trainer: Trainer) -> None:
    from anyseek.distributed.env import barrier as dist_barrier

    dist_barrier(trainer.par.env)


def clear(trainer: Trainer, out: Path) -> int:
    """Bytes of the checkpoint folders in `out`; then delete them (rank 0), every rank waiting."""
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    if trainer.par.env.is_main:
        shutil.rmtree(out, ignore_errors=True)
    barrier(trainer)
    return size


def measure(trainer: Trainer, args) -> dict:
    out, env = Path(args.out) / "ckpt", trainer.par.env
    batches = iter(trainer.train_loader)
    saver = checkpoint.BackgroundSaver(env)
    train(trainer, batches, 1)  # every moment exists
    if not args.unprepared:  # as the trainer does after its first step: the host buffers made in a thread
        t0 = time.perf_counter()
        saver.prepare(trainer.model, trainer.optimizer, masters=trainer.par.masters)
        during = []
        while slowest(trainer, float(saver.reserving())) > 0:
            during.append(slowest(trainer, train(trainer, batches, 1)))
        saver.reserved()
        row_prep = {"prepare_s": slowest(trainer, time.perf_counter() - t0), "prepare_steps": len(during),
                    "prepare_step_ms": 1e3 * sum(during) / max(len(during), 1)}
    train(trainer, batches, args.steps)  # warm-up
    row = {"step_alone_ms": 1e3 * slowest(trainer, train(trainer, batches, args.steps))}
    if not args.unprepared:
        row.update(row_prep)
        if env.is_main:
            print(f"host buffers made in a thread in {row['prepare_s']:.1f} s, {len(during)} steps meanwhile at "
                  f"{row['prepare_step_ms']:.1f} ms mean (alone {row['step_alone_ms']:.1f} ms)", flush=True)

    rows = args.rows.split(",")
    if "sync" in rows:
        barrier(trainer)
        t0 = time.perf_counter()
        checkpoint.save(*save_args(trainer, out), env=env, masters=trainer.par.masters,
                        adapters=trainer.start.adapters)
        row["sync_s"] = slowest(trainer, time.perf_counter() - t0)
        row["bytes"] = clear(trainer, out)

    for name in [r for r in ("first", "next") if r in rows]:
        barrier(trainer)
        staged = saver.start(*save_args(trainer, out), masters=trainer.par.masters, adapters=trainer.start.adapters)
        steps = []  # every rank trains on, one step at a time, while any rank's thread still writes
        while slowest(trainer, float(saver.running())) > 0 and len(steps) < args.max_steps_during:
            steps.append(slowest(trainer, train(trainer, batches, 1)))
        if args.abandon:  # the loop's side only: how long it was blocked, its steps while the thread writes
            if env.is_main:
                ms = [1e3 * t for t in steps]
                print(f"{name}: loop blocked {slowest(trainer, staged):.2f} s; {len(ms)} steps during the write, "
                      f"{sum(ms) / max(len(ms), 1):.1f} ms mean / {max(ms, default=0):.1f} max; alone "
                      f"{row['step_alone_ms']:.1f} ms; host buffers {saver.host.nbytes() / 2**30:.1f} GiB a rank; "
                      f"the write abandoned (--abandon)", flush=True)
            else:
                slowest(trainer, staged)
            barrier(trainer)
            os._exit(0)
        saver.wait()
        row[f"{name}_blocked_s"] = slowest(trainer, staged)
        row[f"{name}_write_s"] = slowest(trainer, saver.write_s)
        row[f"{name}_steps"] = len(steps)
        row[f"{name}_step_ms"] = 1e3 * sum(steps) / max(len(steps), 1)
        row[f"{name}_step_max_ms"] = 1e3 * max(steps, default=0.0)
        row[f"{name}_lost_s"] = row[f"{name}_blocked_s"] + sum(max(t - row["step_alone_ms"] / 1e3, 0) for t in steps)
        row["bytes"] = clear(trainer, out)
        if env.is_main:  # as it comes: a long run stopped later still tells this row
            print(f"{name}: blocked {row[f'{name}_blocked_s']:.2f} s, written in {row[f'{name}_write_s']:.2f} s, "
                  f"{row['bytes'] / 1e9:.1f} GB", flush=True)
    row["host_buffer_gib"] = saver.host.nbytes() / 2**30
    return row


def report(trainer: Trainer, args, row: dict) -> None:
    env, m = trainer.par.env, trainer.model
    device = torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "CPU"
    print(f"\ncheckpoint save of `{args.flavor}` ({trainer.model_cfg.num_hidden_layers} layers, "
          f"{m.num_parameters() / 1e6:,.1f}M parameters, vocab {trainer.model_cfg.vocab_size}), "
          f"{env.world_size if env.active else 1} x {device}, {row['bytes'] / 1e9:.2f} GB a checkpoint, "
          f"{row['host_buffer_gib']:.2f} GiB of host buffers a rank; torch {torch.__version__}, "
          f"{datetime.date.today()}; {args.out}\n")
    print("| what | loop blocked (s) | written in (s) | steps during the write: n, mean / max ms | loop time lost (s) |")
    print("| --- | --- | --- | --- | --- |")
    if "sync_s" in row:
        print(f"| synchronous save (train.async_save=false) | {row['sync_s']:.2f} | {row['sync_s']:.2f} | - | "
              f"{row['sync_s']:.2f} |")
    if "prepare_s" in row:
        lost = row["prepare_steps"] * max(row["prepare_step_ms"] - row["step_alone_ms"], 0) / 1e3
        print(f"| host buffers made in a thread (the trainer: after its first step) | 0.00 | {row['prepare_s']:.2f} | "
              f"{row['prepare_steps']}, {row['prepare_step_ms']:.1f} / - | {lost:.2f} |")
    first = "background save, first of the run (" + ("host buffers made here)" if args.unprepared else
                                                     "host buffers made beforehand in a thread)")
    for name, what in (("first", first),
                       ("next", "background save, later ones (buffers reused)")):
        if f"{name}_blocked_s" not in row:
            continue
        print(f"| {what} | {row[f'{name}_blocked_s']:.2f} | {row[f'{name}_write_s']:.2f} | {row[f'{name}_steps']}, "
              f"{row[f'{name}_step_ms']:.1f} / {row[f'{name}_step_max_ms']:.1f} | {row[f'{name}_lost_s']:.2f} |")
    print(f"\ntraining step without a save in flight: {row['step_alone_ms']:.1f} ms ({args.steps} steps, mean); loop "
          "time lost: the blocked copy plus what the steps during the write took beyond that")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small", help="a model flavor or shipped config (tiny, small, 16B, 671B)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: the flavor's)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the flavor's)")
    p.add_argument("--device", default="auto", help="auto, cuda, cpu")
    p.add_argument("--steps", type=int, default=5, help="training steps timed alone (after as many to warm up)")
    p.add_argument("--max-steps-during", type=int, default=1000, help="at most this many steps during a write")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "anyseek-ckpt-bench"),
                   help="where the checkpoints are written, the same path on every rank (default: %(default)s)")
    p.add_argument("--unprepared", action="store_true",
                   help="no host buffers made beforehand (the trainer makes them in a thread after its first step)")
    p.add_argument("--rows", default="sync,first,next",
                   help="which saves to time, comma-separated: sync, first, next (a 16B save writes ~186 GB each)")
    p.add_argument("--abandon", action="store_true",
                   help="after the first background row's --max-steps-during steps, print what the loop saw and exit "
                        "without waiting for the write (a 16B save to a slow disk takes minutes)")
    p.add_argument("--keep", action="store_true", help="keep --out afterwards (only result.json is left in it)")
    p.add_argument("--override", action="append", default=[], metavar="--section.key=value",
                   help="any run-config override, repeatable (e.g. --override=--data.tokens_per_batch=8192)")
    args = p.parse_args()
    trainer = build(args)
    try:
        row = measure(trainer, args)
        if trainer.par.env.is_main:
            report(trainer, args, row)
            (Path(args.out) / "result.json").write_text(json.dumps({"args": vars(args), **row}, indent=1))
    finally:
        trainer.close()
        from anyseek.distributed.env import shutdown_process_group

        shutdown_process_group()
    if not args.keep and trainer.par.env.is_main:
        shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
