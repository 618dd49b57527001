"""How the step runs under torchrun: overlapped (fused AdamW gated on the device) it is the loop that reads each
verdict first, with a bad step on one rank; with bf16 compute, FSDP2's bf16 shards keep fp32 masters, are the
one-process working copy bit for bit on one rank, and resume exactly on two; on GPUs (marked cuda) one rank follows
the plain run with and without CUDA graphs and the overlap, and two ranks train, exit and resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    EVERY,
    LAST,
    STEPS,
    N,
    batch_key,
    count_halts,
    fused_adamw,
    poison,
    spawn,
    tiny_cfg,
    train_losses,
    train_ranks,
)

from anyseek.train.metrics import read_metrics
from anyseek.train.trainer import Trainer


# ---------------------------------------------------------------------------------------------- workers (per rank)
def _train_overlapped(data: str, out: str, overrides: list[str], poisoned: list[int]) -> None:
    """A 2-rank run with fused AdamW (the CUDA optimizer, here on the CPU), rank 1's batches at `poisoned` (indices
    into its share) NaN; rank 0 writes the final weights (gathered from the shards) and how the steps settled."""
    from safetensors.torch import save_file

    import anyseek.train.trainer as trainer_mod
    from anyseek.data.loader import PackedLoader

    patch = pytest.MonkeyPatch()  # (this process ends with the run)
    patch.setattr(trainer_mod, "build_optimizer", fused_adamw)
    cfg = tiny_cfg(Path(data), *overrides)
    d = cfg.data
    mine = iter(PackedLoader(Path(data), "train", d.tokens_per_batch, d.max_seqlen, cfg.train.seed, rank=1,
                             world_size=2))  # fmt: skip
    shares = [batch_key(next(mine).input_ids) for _ in range(max(poisoned) + 1)]
    poison(patch, {shares[i] for i in poisoned})
    halts = count_halts(patch)
    trainer = Trainer(cfg, Path(out), log=lambda s: None)
    trainer.run()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()}  # (collective: every rank gathers)
    if trainer.par.env.is_main:
        save_file(full, str(Path(out) / "final.safetensors"))
        (Path(out) / "settled.json").write_text(json.dumps({"overlap": trainer.overlap, "halts": sum(halts)}))


# ---------------------------------------------------------------------------------------------- on CPU ranks
@pytest.mark.slow
def test_two_ranks_overlapped_equal_the_loop_with_a_bad_step_on_one_rank(data_dir, tmp_path):
    """train.overlap_steps=true under torchrun (fused AdamW gated on the device, the token count and stop requests
    summed on the host): the same rows, checkpoints' steps and final weights as the loop that reads each verdict
    first, with NaN batches on rank 1 only (every rank skips them, and the step queued behind runs again)."""
    from safetensors.torch import load_file

    over = ["--train.max_steps=10", "--train.save_every=4", "--train.keep_last=3", "--train.eval_every=5",
            "--model.bias_update_speed=0.01"]
    for mode in ("false", "true"):
        assert spawn(_train_overlapped, str(data_dir), str(tmp_path / mode), [*over, f"--train.overlap_steps={mode}"],
                     [1, 6], timeout=180) == [0, 0], mode  # fmt: skip
    a, b = (json.loads((tmp_path / m / "settled.json").read_text()) for m in ("false", "true"))
    assert a == {"overlap": False, "halts": 0} and b["overlap"] and b["halts"] >= 1, (a, b)
    rows = [[{k: (v if v == v else "nan") for k, v in r.items() if k not in ("time", "elapsed", "tokens_per_s",
                                                                               "mfu", "tflops")}
             for r in read_metrics(tmp_path / m / "metrics.jsonl")] for m in ("false", "true")]
    assert rows[0] == rows[1] and sum(r["kind"] == "skip" for r in rows[1]) == 2
    x, y = (load_file(str(tmp_path / m / "final.safetensors")) for m in ("false", "true"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_one_rank_bf16_shards_are_the_working_copy_bit_for_bit_and_resume(data_dir, tmp_path):
    """bf16 compute under torchrun (one gloo rank): FSDP2's shards are bf16 with their fp32 masters beside them (the
    default, parallel.shard_dtype=auto), and the run is the one-process working-copy run bit for bit: every loss,
    and the fp32 weights its sharded checkpoint holds (the masters, not the bf16 shards). Resumed from a sharded
    checkpoint, and from the working copy's one-process checkpoint, it continues the same losses exactly. (Without
    clipping: the two sum the gradient norm in different orders.)"""
    from anyseek.checkpoint.sharded import load_consolidated
    from anyseek.hf import load_pretrained

    over = [*STEPS, "--train.dtype=bf16", "--train.grad_clip=0"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "fsdp"), over, False, world=1, timeout=300) == [0]
    assert "bf16, their fp32 master" in json.loads((tmp_path / "fsdp" / "graphs.json").read_text())["weights"]
    Trainer(tiny_cfg(data_dir, *over, "--train.working_copy=true"), tmp_path / "plain", log=lambda s: None).run()
    a, b = train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "plain")
    assert list(a) == list(range(1, N + 1)) and a == b
    saved, plain = load_consolidated(tmp_path / "fsdp" / LAST).state_dict(), load_pretrained(tmp_path / "plain" / LAST)
    for k, v in plain.state_dict().items():
        assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    for source in ("fsdp", "plain"):  # a sharded checkpoint, and a one-process one, into bf16 shards
        out = tmp_path / f"from-{source}"
        shutil.copytree(tmp_path / source, out, ignore=shutil.ignore_patterns(LAST))
        (out / "metrics.jsonl").unlink()
        cfg = [*over, "--train.working_copy=true"] if source == "plain" else over  # (its run's own settings)
        assert spawn(train_ranks, str(data_dir), str(out), cfg, True, world=1, timeout=300) == [0]
        c = train_losses(out)
        assert list(c) == list(range(N - EVERY + 1, N + 1)) and all(c[s] == a[s] for s in c), source


@pytest.mark.slow
def test_two_ranks_with_bf16_shards_train_save_masters_and_resume_exactly(data_dir, tmp_path):
    """2 gloo ranks in bf16 (bf16 shards gathered as they are, gradients reduce-scattered in fp32, each rank's fp32
    masters): the loss falls, the checkpoint holds fp32 weights, and a resume on 2 ranks gives the same losses."""
    from anyseek.checkpoint.sharded import load_consolidated

    over = [*STEPS, "--train.dtype=bf16"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "run"), over, False) == [0, 0]
    assert "bf16, their fp32 master" in json.loads((tmp_path / "run" / "graphs.json").read_text())["weights"]
    a = train_losses(tmp_path / "run")
    assert list(a) == list(range(1, N + 1)) and a[N] < a[1] - 1.0
    saved = load_consolidated(tmp_path / "run" / LAST).state_dict()
    assert all(v.dtype == torch.float32 for k, v in saved.items() if "bias" not in k)
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", out, ignore=shutil.ignore_patterns(LAST))
    (out / "metrics.jsonl").unlink()
    assert spawn(train_ranks, str(data_dir), str(out), over, True) == [0, 0]
    c = train_losses(out)
    assert list(c) == list(range(N - EVERY + 1, N + 1)) and all(c[s] == a[s] for s in c)


# ---------------------------------------------------------------------------------------------- on GPUs (cuda)
def val_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "val"}


@pytest.mark.cuda
@pytest.mark.parametrize("graphs,overlap", [("auto", "auto"), ("false", "auto"), ("auto", "false")])
def test_one_gpu_fsdp2_equals_plain_and_resumes_plain(data_dir, tmp_path, graphs, overlap):
    """torchrun with one rank on a GPU (NCCL, FSDP2 with fp32 compute copies) follows the plain one-process run step
    by step, with its step in CUDA graphs (the default: FSDP2's gathers and reductions replay inside)
    and without; so do its evaluations between steps (with graphs no eager backward frees the weights gathered for
    an evaluation, `Parallel.release` does), with the overlap (the default: fused AdamW queued before the loss is
    read, the next step before this one's loss) and without it; its sharded checkpoint resumes in a plain process;
    the bf16 mixed-precision FSDP2 run trains too."""
    over = [*STEPS, "--train.device=cuda", "--train.dtype=fp32", "--parallel.param_dtype=fp32",
            "--train.eval_every=4", f"--train.overlap_steps={overlap}", f"--train.cuda_graphs={graphs}"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "fsdp"), over, False, world=1, timeout=300) == [0]
    used = json.loads((tmp_path / "fsdp" / "graphs.json").read_text())
    assert (used["replays"] > 0) == (graphs == "auto") and used["overlap"] == (overlap == "auto"), used
    plain = tmp_path / "plain"
    Trainer(tiny_cfg(data_dir, *over[:-2]), plain, log=lambda s: None).run()
    a, b = train_losses(tmp_path / "fsdp"), train_losses(plain)
    assert list(a) == list(range(1, N + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step
    va, vb = val_losses(tmp_path / "fsdp"), val_losses(plain)
    assert len(va) >= 4 and list(va) == list(vb)
    for step in va:
        assert va[step] == pytest.approx(vb[step], rel=1e-4), step
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed, ignore=shutil.ignore_patterns(LAST))
    (resumed / "metrics.jsonl").unlink()
    Trainer(tiny_cfg(data_dir, *over), resumed, resume=True, log=lambda s: None).run()
    c = train_losses(resumed)
    assert list(c) == list(range(N - EVERY + 1, N + 1))
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-4), step
    bf16 = [*STEPS, "--train.device=cuda", "--train.dtype=bf16"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "bf16"), bf16, False, world=1, timeout=300) == [0]
    d = train_losses(tmp_path / "bf16")
    for step in d:
        assert d[step] == pytest.approx(a[step], rel=3e-2), step


@pytest.mark.cuda
def test_one_gpu_bf16_shards_follow_the_working_copy_and_resume(data_dir, tmp_path):
    """torchrun with one rank on a GPU in bf16 (the defaults: bf16 shards with fp32 masters, graphed, overlapped)
    follows the plain run's working copy step by step (within bf16's drift: the two optimizer kernels round their
    bias corrections differently, so they are not bit for bit as on the CPU, where both run the reference twin), and
    resumes from its sharded checkpoint on the same losses."""
    over = [*STEPS, "--train.device=cuda", "--train.dtype=bf16", "--train.grad_clip=0"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "fsdp"), over, False, world=1, timeout=300) == [0]
    used = json.loads((tmp_path / "fsdp" / "graphs.json").read_text())
    assert used["replays"] > 0 and used["overlap"] and "bf16, their fp32 master" in used["weights"], used
    Trainer(tiny_cfg(data_dir, *over), tmp_path / "plain", log=lambda s: None).run()
    a, b = train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "plain")
    assert list(a) == list(b) == list(range(1, N + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=3e-2), step
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed, ignore=shutil.ignore_patterns(LAST))
    (resumed / "metrics.jsonl").unlink()
    assert spawn(train_ranks, str(data_dir), str(resumed), over, True, world=1, timeout=300) == [0]
    c = train_losses(resumed)
    assert list(c) == list(range(N - EVERY + 1, N + 1))
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-3), step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs")
def test_two_gpus_graphed_equal_eager_and_exit(data_dir, tmp_path):
    """torchrun with 2 ranks on 2 GPUs (NCCL, fp32): the step in CUDA graphs (the default; the collectives replay
    inside) gives the eager step's losses and evaluations, and both runs exit (the graphs are released before the
    process group is destroyed: with them alive NCCL's teardown hung)."""
    over = [*STEPS, "--train.device=cuda", "--train.dtype=fp32", "--parallel.param_dtype=fp32", "--train.eval_every=4"]
    for graphs in ("auto", "false"):
        codes = spawn(train_ranks, str(data_dir), str(tmp_path / graphs), [*over, f"--train.cuda_graphs={graphs}"],
                      False, world=2, timeout=300)  # fmt: skip
        assert codes == [0, 0], (graphs, codes)
    used = json.loads((tmp_path / "auto" / "graphs.json").read_text())
    assert used["replays"] > 0, used
    a, b = train_losses(tmp_path / "auto"), train_losses(tmp_path / "false")
    assert list(a) == list(b) == list(range(1, N + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4), step
    va, vb = val_losses(tmp_path / "auto"), val_losses(tmp_path / "false")
    assert len(va) >= 4 and list(va) == list(vb)
    for step in va:
        assert va[step] == pytest.approx(vb[step], rel=1e-4), step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs")
def test_two_gpus_bf16_shards_train_and_resume(data_dir, tmp_path):
    """torchrun with 2 ranks on 2 GPUs in bf16, the defaults (bf16 shards gathered over NCCL, gradients
    reduce-scattered in fp32, fp32 masters; graphed, overlapped): the loss falls and a resume on 2 ranks continues
    the same losses."""
    over = [*STEPS, "--train.device=cuda", "--train.dtype=bf16"]
    assert spawn(train_ranks, str(data_dir), str(tmp_path / "run"), over, False, world=2, timeout=300) == [0, 0]
    used = json.loads((tmp_path / "run" / "graphs.json").read_text())
    assert used["replays"] > 0 and "bf16, their fp32 master" in used["weights"], used
    a = train_losses(tmp_path / "run")
    assert list(a) == list(range(1, N + 1)) and a[N] < a[1] - 1.0
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", out, ignore=shutil.ignore_patterns(LAST))
    (out / "metrics.jsonl").unlink()
    assert spawn(train_ranks, str(data_dir), str(out), over, True, world=2, timeout=300) == [0, 0]
    c = train_losses(out)
    assert list(c) == list(range(N - EVERY + 1, N + 1))
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-3), step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs")
def test_two_gpus_expert_parallel_graphed_and_overflow_reruns(data_dir, tmp_path):
    """EP=2 on 2 GPUs (NCCL, fp32): the fixed-shape dispatch replays in CUDA graphs with the overlap on and gives the
    exact dispatch's eager losses; with C at half the fair share, no settling and no growth every step overflows, is
    halted on the device and runs again exactly (the step queued behind it too); with growth C grows after the first
    overflow, the graphs are given back before the re-run and captured again at the new C; the losses are the same."""
    over = [*STEPS, "--train.device=cuda", "--train.dtype=fp32", "--parallel.param_dtype=fp32", "--parallel.ep=2"]
    half = ["--parallel.ep_dispatch=fixed", "--parallel.ep_capacity_factor=0.5", "--parallel.ep_settle_steps=0"]
    runs = {"fixed": ["--parallel.ep_dispatch=fixed"], "exact": ["--parallel.ep_dispatch=exact"],
            "overflow": half, "grown": [*half, "--parallel.ep_capacity_growth=true"]}
    for name, extra in runs.items():
        codes = spawn(train_ranks, str(data_dir), str(tmp_path / name), [*over, *extra], False, world=2, timeout=300)
        assert codes == [0, 0], (name, codes)
    used = {name: json.loads((tmp_path / name / "graphs.json").read_text()) for name in runs}
    assert used["fixed"]["replays"] > 0 and used["fixed"]["overlap"] and used["fixed"]["overflows"] == 0, used
    assert used["exact"]["replays"] == 0 and used["overflow"]["overflows"] == N, used
    assert 1 <= used["grown"]["overflows"] < N and used["grown"]["replays"] > 0, used
    exact = train_losses(tmp_path / "exact")
    for name in ("fixed", "overflow", "grown"):
        got = train_losses(tmp_path / name)
        assert list(got) == list(exact) == list(range(1, N + 1)), name
        for step in got:
            assert got[step] == pytest.approx(exact[step], rel=1e-4), (name, step)
