"""The parts distributed training rests on, on gloo ranks on the CPU: expert parallelism equals the local experts
(outputs and gradients, a rank that receives nothing included), NaN verdicts and failures agree across ranks, a dead
rank makes the other fail instead of hanging; FSDP2's gathered root is released, one rank reduces without a copy;
the process group's teardown cannot hang a run; activation checkpointing, the EP benchmark, the parallel plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import spawn


# ---------------------------------------------------------------------------------------------- workers (per rank)
def _expert_parallel_equals_local() -> None:
    import torch.distributed as dist

    from anyseek import kernels
    from anyseek.distributed.expert_parallel import capacity_rows, dispatch_combine, dispatch_combine_fixed

    rank = dist.get_rank()
    E, D, I, K = 6, 16, 8, 2
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(E, 2 * I, D, generator=gen) * 0.2
    down = torch.randn(E, D, I, generator=gen) * 0.2
    shared = torch.randn(D, D, generator=gen) * 0.2  # the shared experts' stand-in: their output is added
    gen.manual_seed(1 + rank)
    for T, only_rank0_experts in ((13 + 4 * rank, False), (5, True)):
        x = torch.randn(T, D, generator=gen)
        scores = torch.rand(T, E, generator=gen)
        if only_rank0_experts:  # rank 1 receives no rows at all
            scores[:, E // 2:] = -1
        ids = scores.topk(K, dim=-1)[1]
        w = torch.rand(T, K, generator=gen)
        x_ref, w_ref, gu_ref, d_ref, s_ref = (t.clone().requires_grad_() for t in (x, w, gate_up, down, shared))
        y_ref = kernels.routed_experts(x_ref, ids, w_ref, gu_ref, d_ref) + x_ref @ s_ref
        g = torch.randn(T, D, generator=gen)
        (y_ref * g).sum().backward()
        for gu_r in (gu_ref.grad, d_ref.grad):
            dist.all_reduce(gu_r)  # the expert's gradient sums every rank's tokens
        # exact splits; fixed shapes at the worst case, and at a capacity of exactly the largest pair's rows (the
        # same on both ranks: each rank's own T differs); every result equal to the local experts'
        counts = torch.zeros(2, 2, dtype=torch.int64)
        counts[rank] = torch.bincount(ids.reshape(-1) // 3, minlength=2)
        dist.all_reduce(counts)
        tight = int(counts.max())
        worst = capacity_rows(17, K, 2, 3, factor=0)  # T at most 17 (rank 1)
        # the shared experts' output computed while the rows travel (overlap) or where the exchange is waited for
        for capacity, overlap in ((None, False), (worst, True), (worst, False), (tight, True)):
            x_ep, w_ep, s_ep = (t.clone().requires_grad_() for t in (x, w, shared))
            gu_ep = gate_up[rank * 3:(rank + 1) * 3].clone().requires_grad_()
            d_ep = down[rank * 3:(rank + 1) * 3].clone().requires_grad_()
            overflow = torch.zeros((), dtype=torch.bool)
            y_ep = (dispatch_combine(x_ep, ids, w_ep, gu_ep, d_ep, dist.group.WORLD) + x_ep @ s_ep
                    if capacity is None else
                    dispatch_combine_fixed(x_ep, ids, w_ep, gu_ep, d_ep, dist.group.WORLD, capacity, overflow,
                                           lambda: x_ep @ s_ep, overlap))
            (y_ep * g).sum().backward()
            assert not overflow
            torch.testing.assert_close(y_ep, y_ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(x_ep.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w_ep.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s_ep.grad, s_ref.grad, rtol=1e-5, atol=1e-6)
            for full_grad, mine in ((gu_ref.grad, gu_ep.grad), (d_ref.grad, d_ep.grad)):
                torch.testing.assert_close(mine, full_grad[rank * 3:(rank + 1) * 3], rtol=1e-5, atol=1e-6)
        # one row short of the largest pair: every rank sees the overflow after the step's all-reduce, and the rows
        # the fullest pair needed (what C must be)
        overflow, peak = torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.int64)
        dispatch_combine_fixed(x, ids, w, gate_up[rank * 3:(rank + 1) * 3], down[rank * 3:(rank + 1) * 3],
                               dist.group.WORLD, tight - 1, overflow, peak=peak)
        flag = torch.stack([overflow.float(), peak.float()])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        assert flag.tolist() == [1.0, float(tight)]


def _fp8_expert_parallel_equals_local() -> None:
    """FP8 training's experts under expert parallelism (rows sent as E4M3 with power-of-two scales, the FP8 experts
    on arrival) against `kernels.fp8_routed_experts` of all experts on the rank's own tokens: the same output (the
    rows arrive as the values the local experts quantize them to), the same input and routing-weight gradients;
    the weight gradients differ only by their Wgrad tiles along the rows (both ranks' rows share them under EP)."""
    import torch.distributed as dist

    from anyseek import kernels
    from anyseek.distributed import expert_parallel
    from anyseek.distributed.expert_parallel import capacity_rows, dispatch_combine, dispatch_combine_fixed

    rank = dist.get_rank()
    E, D, I, K, T = 4, 160, 136, 2, 11 + 6 * rank  # D, I past one 128-tile: a short last tile in every row
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, D, generator=gen) * 0.1, torch.randn(E, D, I, generator=gen) * 0.1
    gen.manual_seed(7 + rank)
    x = torch.randn(T, D, generator=gen) * torch.logspace(-2, 2, T)[:, None]  # rows of very different ranges
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1)[1]
    w, g = torch.rand(T, K, generator=gen), torch.randn(T, D, generator=gen)
    x_ref, w_ref, gu_ref, d_ref = (t.clone().requires_grad_() for t in (x, w, gate_up, down))
    y_ref = kernels.fp8_routed_experts(x_ref, ids, w_ref, gu_ref, d_ref)
    (y_ref * g).sum().backward()
    for r in (gu_ref.grad, d_ref.grad):
        dist.all_reduce(r)
    plain = kernels.routed_experts(x, ids, w, gate_up, down)
    assert (y_ref - plain).norm() > 1e-3 * plain.norm(), "the FP8 experts computed in full precision"
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    for capacity, overlap in ((None, False), (capacity_rows(17, K, 2, 2, factor=0), True),
                              (capacity_rows(17, K, 2, 2, factor=0), False)):  # fmt: skip
        x_ep, w_ep = x.clone().requires_grad_(), w.clone().requires_grad_()
        gu_ep, d_ep = gate_up[mine].clone().requires_grad_(), down[mine].clone().requires_grad_()
        sends, exchange_fp8 = [], expert_parallel._exchange_fp8
        expert_parallel._exchange_fp8 = lambda t, *a: sends.append(t.shape) or exchange_fp8(t, *a)
        try:
            y_ep = (dispatch_combine(x_ep, ids, w_ep, gu_ep, d_ep, dist.group.WORLD, fp8=True) if capacity is None
                    else dispatch_combine_fixed(x_ep, ids, w_ep, gu_ep, d_ep, dist.group.WORLD, capacity,
                                                torch.zeros((), dtype=torch.bool), None, overlap, fp8=True))  # fmt: skip
            (y_ep * g).sum().backward()
        finally:
            expert_parallel._exchange_fp8 = exchange_fp8
        # in FP8: the rows on their way to the experts (here, unless `_Start` packed them), then the outputs' gradients
        assert len(sends) == (1 if overlap else 2) and all(shape[1] == D for shape in sends), sends
        torch.testing.assert_close(y_ep, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_ep.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w_ep.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
        for full, got in ((gu_ref.grad[mine], gu_ep.grad), (d_ref.grad[mine], d_ep.grad)):
            assert (got - full).norm() < 0.05 * full.norm(), (got - full).norm() / full.norm()


def _fp8_output_gradients_travel_as_fp8() -> None:
    """The combine's exchange with fp8_grad: its output as it is (bf16 combine), its gradient on the way to the
    experts as `fp8_pack_rows` sends rows, i.e. the quantized values (power-of-two 1x128 scales), not the exact ones."""
    import torch.distributed as dist

    from anyseek import kernels
    from anyseek.distributed.expert_parallel import _AllToAll

    rank = dist.get_rank()

    def rows(r: int, seed: int) -> torch.Tensor:  # rank r's [4, 200]: rows of very different ranges, a short tile
        return torch.randn(4, 200, generator=torch.Generator().manual_seed(seed + r)) * torch.logspace(-3, 3, 4)[:, None]

    x = rows(rank, 0).requires_grad_()
    (y,) = _AllToAll.apply([2, 2], [2, 2], dist.group.WORLD, False, True, x)
    torch.testing.assert_close(y, torch.cat([rows(p, 0)[2 * rank:2 * rank + 2] for p in (0, 1)]), rtol=0, atol=0)
    y.backward(rows(rank, 100))
    sent = torch.cat([rows(p, 100)[2 * rank:2 * rank + 2] for p in (0, 1)])  # what the two ranks send back here
    want = kernels.fp8_unpack_rows(*kernels.fp8_pack_rows(sent), torch.float32)
    assert (want - sent).abs().max() > 0, "the gradient is exactly representable: the test would not see a rounding"
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


def _collectives(result: str) -> None:
    """EP dispatch vs local experts, NaN and stop agreement, a failure on one rank raised on both, then rank 1 dies
    and rank 0 must fail, not hang."""
    import errno

    from anyseek.distributed.env import agree
    from anyseek.train.config import ParallelConfig
    from anyseek.train.parallel import Parallel
    from anyseek.train.step import StepStats

    par = Parallel.from_torchrun(ParallelConfig(timeout_s=5), "cpu")
    _expert_parallel_equals_local()
    _fp8_expert_parallel_equals_local()
    _fp8_output_gradients_travel_as_fp8()
    rank = par.env.rank
    stats = StepStats(loss=torch.tensor(float("nan") if rank == 1 else 2.0), tokens=10,
                      expert_load=torch.tensor([[1.0, 2.0]]) * (rank + 1), stop_requested=rank == 0)
    par.sum_step(stats)
    assert torch.isnan(stats.loss) and stats.global_counts.tolist() == [20.0, 1.0]  # rank 0 skips too; rank 1
    assert stats.expert_load.tolist() == [[3.0, 6.0]]                                  # stops with rank 0
    # the overlap's way: the counts summed on the host at once, the rest on the device as before
    stats = StepStats(loss=torch.tensor(1.0), tokens=7 + rank, expert_load=torch.tensor([[1.0, 2.0]]),
                      stop_requested=rank == 1)
    par.sum_step(stats, counts_on_host=True)
    assert (stats.tokens, stats.stop_requested, stats.global_counts) == (15, True, None)
    assert stats.loss.item() == 2.0 and stats.expert_load.tolist() == [[2.0, 4.0]]
    agree(None, par.env)  # nobody failed: nothing raised
    try:  # a full disk on rank 1 only: both see the same OSError
        agree(OSError(errno.ENOSPC, "No space left on device") if rank == 1 else None, par.env)
        raise AssertionError("agree did not raise")
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    if rank == 1:
        os._exit(0)  # dies without a word
    t0 = time.monotonic()
    try:
        par.sum_(torch.ones(1))
        outcome = "no error"
    except Exception as e:  # gloo: connection closed or timed out
        outcome = f"{type(e).__name__} after {time.monotonic() - t0:.1f}s"
    Path(result).write_text(outcome)


def _release_after_forward(result: str) -> None:
    """A forward outside the training step leaves FSDP2's root unit gathered (it reshards only in backward);
    `Parallel.release` frees it: the parameters are DTensor shards again, and the next forward gathers afresh."""
    from torch.distributed.tensor import DTensor

    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.config import ParallelConfig
    from anyseek.train.parallel import Parallel

    par = Parallel.from_torchrun(ParallelConfig(timeout_s=30), "cpu")
    torch.manual_seed(0)
    model = par.parallelize(DeepSeekV3(ModelConfig.from_name("tiny", num_hidden_layers=2, vocab_size=64)), None)
    ids = torch.arange(16) % 64
    cu = torch.tensor([0, 16], dtype=torch.int32)
    model.eval()
    with torch.no_grad():
        first = model(ids, cu_seqlens=cu, max_seqlen=16).logits
    gathered = not isinstance(model.lm_head.weight, DTensor)
    par.release(model)
    released = isinstance(model.lm_head.weight, DTensor)
    with torch.no_grad():
        again = model(ids, cu_seqlens=cu, max_seqlen=16).logits
    if par.env.is_main:
        Path(result).write_text(json.dumps({"gathered": gathered, "released": released,
                                            "same": bool(torch.equal(first, again))}))


def _one_rank_reduce(result: str) -> None:
    """One rank with bf16 compute copies: the reduction runs in the shards' dtype (fp32 or bf16) whatever
    parallel.reduce_dtype says, several ranks keep the configured one; the one-rank reduction's output is its input
    (`OneRankReduce`), and the gradients are those of a reduction that copies (fp32 shards: a bf16 reduction cast
    after it, as before), bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    from anyseek.distributed.fsdp import OneRankReduce, apply_fsdp, mixed_precision
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.train.config import ParallelConfig
    from anyseek.train.parallel import Parallel

    class Copies(OneRankReduce):  # FSDP2's own behaviour: an output buffer of its own, copied into
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

    Parallel.from_torchrun(ParallelConfig(timeout_s=30), "cpu")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    ids, cu = torch.arange(64) % 64, torch.tensor([0, 40, 64], dtype=torch.int32)
    picked = [str(mixed_precision("bf16", "bf16", None, w, s).reduce_dtype) for w, s in
              ((1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16))]
    grads, aliased = [], []
    for policy, comm in ((mixed_precision("bf16", "bf16", None, 1), None), (mixed_precision("bf16", "bf16", None, 2),
                                                                             Copies())):
        torch.manual_seed(0)
        model = apply_fsdp(DeepSeekV3(ModelConfig.from_name("tiny", num_hidden_layers=2, vocab_size=64)), mesh, policy)
        if comm is not None:
            model.set_custom_reduce_scatter(comm)
        model(ids, cu_seqlens=cu, max_seqlen=40).logits.float().square().mean().backward()
        grads.append({n: p.grad.to_local() for n, p in model.named_parameters() if p.grad is not None})
        aliased.append(model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm.aliased)
    same = grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k].float())
                                                      for k in grads[0])  # fmt: skip
    fp32 = all(g.dtype == torch.float32 for g in grads[0].values())
    Path(result).write_text(json.dumps({"picked": picked, "same": same, "fp32": fp32, "n": len(grads[0]),
                                        "aliased": aliased}))


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_expert_dispatch_equals_local_experts_nan_verdicts_agree_dead_rank_fails(tmp_path):
    result = tmp_path / "result.txt"
    codes = spawn(_collectives, str(result), timeout=60)
    assert codes == [0, 0], codes
    assert result.read_text() != "no error"


@pytest.mark.slow
def test_release_frees_what_a_forward_outside_the_step_gathered(tmp_path):
    result = tmp_path / "release.json"
    assert spawn(_release_after_forward, str(result), timeout=120) == [0, 0]
    assert json.loads(result.read_text()) == {"gathered": True, "released": True, "same": True}


@pytest.mark.slow
def test_one_rank_reduces_in_the_shard_dtype_without_a_copy(tmp_path):
    result = tmp_path / "reduce.json"
    assert spawn(_one_rank_reduce, str(result), world=1, timeout=120) == [0]
    r = json.loads(result.read_text())
    assert r["picked"] == ["torch.float32", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16"], r
    assert r["same"] and r["fp32"] and r["n"] > 20 and r["aliased"] == [1, 0], r


@pytest.mark.slow
def test_ep_benchmark_runs_on_two_cpu_ranks():
    """benchmarks/ep.py (issue 12's dispatch benchmark, for multi-GPU machines) runs end to end on 2 gloo ranks: the
    dispatch with passthrough experts returns every token's weighted sum, and the table is printed."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "ep.py"
    out = subprocess.run([sys.executable, str(script), "--cpu-ranks", "2", "--tokens", "48", "--shapes", "16B",
                          "--reps", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| 16B (E 64, K 6, D 2048) | 48 | skewed |" in out.stdout


def test_a_step_whose_gradients_never_reached_the_parameters_is_an_error():
    """The FSDP2 root-unit bug (gradients dropped, AdamW skipping every parameter) must not pass silently again."""
    from anyseek.train.config import ParallelConfig
    from anyseek.train.parallel import Parallel

    par = Parallel.from_torchrun(ParallelConfig(), "cpu")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(RuntimeError, match="no trainable parameter received a gradient"):
        par.clip_grad_norm_(model, 1.0)
    model(torch.ones(1, 3)).sum().backward()
    assert float(par.clip_grad_norm_(model, 1.0)) > 0


def test_plan_counts_parameters_and_suggests_a_degree_that_fits():
    from anyseek.model.config import ModelConfig
    from anyseek.train.plan import candidates, parameter_counts, plan

    config = ModelConfig.from_name("16B")
    dense, experts = parameter_counts(config)
    assert 15e9 < dense + experts < 17e9 and experts > 8 * dense
    one, eight = plan(config, 8, 1, 4096), plan(config, 8, 8, 4096)
    assert eight.weights_gb < one.weights_gb / 4 and eight.all_to_all_gb > 0 == one.all_to_all_gb
    assert candidates(config, 8) == [1, 2, 4, 8]


def test_shutdown_gives_up_on_a_teardown_that_hangs(monkeypatch):
    """NCCL's teardown can hang (CUDA graphs holding its communicators: pytorch/pytorch#115388): the shutdown gives up
    after its timeout instead of waiting forever; a teardown that returns gives True, one that fails raises its
    error in the caller."""
    import threading

    import torch.distributed as dist

    from anyseek.distributed.env import shutdown_process_group

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    assert shutdown_process_group(timeout_s=0.2) is False
    assert time.monotonic() - t0 < 5
    release.set()
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    assert shutdown_process_group(timeout_s=5) is True

    def fails():
        raise RuntimeError("teardown failed")

    monkeypatch.setattr(dist, "destroy_process_group", fails)
    with pytest.raises(RuntimeError, match="teardown failed"):
        shutdown_process_group(timeout_s=5)


def test_train_leaves_with_its_code_when_the_teardown_hangs(data_dir, tmp_path, monkeypatch, capsys):
    """`anyseek train` whose process-group teardown does not return: the run's outputs are written, a warning says
    why, and the process ends with the run's own exit code (os._exit: a normal exit would wait on the teardown)."""
    from anyseek.cli import main
    from anyseek.distributed import env as env_mod

    class Left(Exception):
        pass

    def leave(code):
        raise Left(code)

    monkeypatch.setattr(env_mod, "shutdown_process_group", lambda: False)
    monkeypatch.setattr(os, "_exit", leave)
    extra = [f"--data.path={data_dir}", "--data.tokens_per_batch=256", "--data.max_seqlen=64",
             "--model.num_hidden_layers=2", "--train.max_steps=2", "--train.eval_tokens=256", "--train.sample_tokens=2",
             "--train.threads=1", "--train.tensorboard=false"]
    with pytest.raises(Left) as left:
        main(["train", "--config", "tiny", "--out", str(tmp_path / "run"), *extra])
    assert left.value.args == (0,)
    err = capsys.readouterr().err
    assert "did not shut down" in err and "outputs are complete" in err
    assert (tmp_path / "run" / "step-2").is_dir()


# ------------------------------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_same_loss_and_gradients(mode):
    """Applied from outside to a built model: the same loss and gradients as without, fewer saved activations;
    selective recomputes every other decoder layer, full every layer and MTP module."""
    from anyseek.distributed.fsdp import apply_activation_checkpointing
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny", num_hidden_layers=4, vocab_size=64)
    plain = DeepSeekV3(cfg)
    ckpt = DeepSeekV3(cfg)
    ckpt.load_state_dict(plain.state_dict())
    chosen = apply_activation_checkpointing(ckpt, mode)
    units = len(ckpt.model.layers) + len(ckpt.mtp)
    assert chosen == ([0, 2] if mode == "selective" else list(range(units)))
    ids = torch.randint(0, 64, (40,))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    tgt = torch.randint(0, 64, (40,))
    results = []
    for model in (plain, ckpt):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = model(ids, cu_seqlens=cu, targets=tgt, return_logits=False)
            loss = out.lm_loss + (out.mtp_loss if out.mtp_loss is not None else 0)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                        sum(saved)))
    (l0, g0, s0), (l1, g1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-6, atol=1e-7, msg=name)
    assert s1 < s0, (s1, s0)


def test_plan_and_the_pre_run_report_count_activations_alike():
    """One activation model: `anyseek plan` (per GPU) and the report printed before a run count the same bytes for
    the same micro-batch (a bf16 GPU step with a bf16 residual stream: the working copy, or bf16 shards at EP 1)."""
    from anyseek.train.config import load_run_config
    from anyseek.train.memory import estimate
    from anyseek.train.plan import GB, plan

    cfg = load_run_config("small", ["--data.tokens_per_batch=8192"])
    config = cfg.model_config()
    report = estimate(config, cfg, autocast=True, working_copy=True, triton_experts=True)
    for mode, field in (("none", "activations_gb"), ("full", "activations_ckpt_gb")):
        cfg.parallel.activation_checkpointing = mode
        want = estimate(config, cfg, autocast=True, working_copy=True, triton_experts=True).activations
        assert getattr(plan(config, 1, 1, 8192), field) * GB == pytest.approx(want, rel=1e-12), mode
    assert report.activations > 3 * plan(config, 1, 1, 8192).activations_ckpt_gb * GB  # recomputation saves


def test_expert_dispatch_settles_before_fixed_shapes_and_again_after_an_overflow():
    """parallel.ep_settle_steps: the exact dispatch until N steps in a row fit C / 1.25 (a miss starts the count
    again); then the fixed shapes; an overflow goes back to settling. C at the worst case, or N = 0: never settles."""
    import types

    from anyseek.distributed.expert_parallel import Dispatch
    from anyseek.train.parallel import Parallel

    class Fake(Parallel):
        def __init__(self, capacity: int, worst: int, steps: int):
            self.dispatch = Dispatch(torch.device("cpu"), capacity, worst=worst)
            self.dispatch.settling = True  # (as if C were below the worst case: ep_settle's own check is tested)
            self.cfg = types.SimpleNamespace(ep_settle_steps=steps)
            self._settled = 0

    def fixed(p):
        with p.dispatch.fixed_shapes():
            return p.dispatch.fixed

    p = Fake(100, 400, 3)
    assert not fixed(p)
    assert [p.ep_settle(n) for n in (80, 81, 50, 50)] == [False] * 4  # 81 * 1.25 > 100: the count starts again
    assert p.ep_settle(80) and not p.ep_settling and fixed(p)
    assert not p.ep_settle(10)  # not settling: nothing to count
    assert p.ep_unsettle() and p.ep_settling and not fixed(p)
    assert [p.ep_settle(n) for n in (10, 10, 10)] == [False, False, True]
    assert not Fake(400, 400, 3).ep_unsettle() and not Fake(100, 400, 0).ep_unsettle()
    assert Fake(400, 400, 1).ep_settle(400)  # at the worst case everything fits


def test_activation_checkpointing_keeps_one_input_a_layer(monkeypatch):
    """A recomputed decoder layer gets h + pending (the previous FFN output) as its one input: checkpoint is called
    with pending=None and the sum, so it keeps one [T, D] tensor a layer, not two (and the memory estimate counts
    one). MTP modules are checkpointed as they are."""
    from anyseek.distributed import fsdp
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3

    calls = []
    real = fsdp.checkpoint

    def recording(fn, *args, **kwargs):
        calls.append((getattr(fn, "__self__", None), args, kwargs))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(fsdp, "checkpoint", recording)
    torch.manual_seed(0)
    model = DeepSeekV3(ModelConfig.from_name("tiny", num_hidden_layers=3, vocab_size=64))
    fsdp.apply_activation_checkpointing(model, "full")
    seen = {}
    for layer in model.model.layers:  # the inputs the model's loop passes, recorded before the wrapper
        layer.register_forward_pre_hook(lambda m, a, k: seen.setdefault(id(m), (a[0], k.get("pending"))) and None,
                                        with_kwargs=True)  # fmt: skip
    model(torch.randint(0, 64, (30,)), cu_seqlens=torch.tensor([0, 30], dtype=torch.int32),
          targets=torch.randint(0, 64, (30,)), return_logits=False).lm_loss.backward()
    forward_calls = [c for c in calls if c[0] is not None and c[0] in list(model.model.layers)]
    assert len(forward_calls) == 3
    for layer, args, kwargs in forward_calls:
        h, pending = seen[id(layer)]
        assert kwargs.get("pending") is None
        want = h if pending is None else h + pending
        assert torch.equal(args[0], want)
    assert sum(1 for layer, _, _ in forward_calls if seen[id(layer)][1] is not None) == 2  # layers 1 and 2 folded
