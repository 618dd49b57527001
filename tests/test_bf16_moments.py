"""AdamW's moments in bf16 (`train.moments_dtype=bf16`, DeepSeek-V3's low-precision optimizer states): stochastic
rounding that is unbiased and leaves representable values alone, moments that track fp32 ones where round-to-nearest
would freeze them, the config's checks, and a trainer run that checkpoints bf16 state and resumes bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import final_state, run, tiny_cfg

from anyseek.kernels.reference import adamw as ref
from anyseek.train.config import ConfigError, load_run_config
from anyseek.train.trainer import Trainer

CPU_BF16 = ("--train.device=cpu", "--train.dtype=bf16", "--train.working_copy=true")


def test_stochastic_rounding_is_unbiased_and_exact_where_it_can_be():
    n = 1 << 20
    r, r2 = ref.random16(n, seed=5, device="cpu")
    assert 0 <= int(r.min()) and int(r.max()) < 1 << 16 and 0 <= int(r2.min()) and int(r2.max()) < 1 << 16
    assert abs(r.float().mean().item() / 65536 - 0.5) < 2e-3 and not torch.equal(r, r2)
    assert not torch.equal(r, ref.random16(n, seed=6, device="cpu")[0])  # another seed, other numbers
    for x0 in (1.0 + 2.0**-10, -3.0e-7 * (1 + 2.0**-9), 0.1):  # a quarter, a half ulp; and an arbitrary value
        x = torch.full((n,), x0, dtype=torch.float32)
        y = ref.round_bf16_stochastic(x, r).float()
        assert set(y.unique().tolist()) <= set(_neighbours(x0))
        assert abs(y.double().mean().item() - x0) < 3e-4 * abs(x0), (x0, y.double().mean().item())
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**127, float("inf"), float("-inf")], dtype=torch.float32)
    for seed in range(4):
        rr = ref.random16(exact.numel(), seed, "cpu")[0]
        assert torch.equal(ref.round_bf16_stochastic(exact, rr).float(), exact)
    assert torch.isnan(ref.round_bf16_stochastic(torch.tensor([float("nan")]), torch.tensor([65535]))).all()


def _neighbours(x0: float) -> tuple[float, float]:
    """The two bf16 values around x0 (the fp32 bits with the low half dropped, and one bf16 ulp further out)."""
    bits = torch.tensor(x0, dtype=torch.float32).view(torch.int32).item() & ~0xFFFF
    return tuple(torch.tensor(b, dtype=torch.int32).view(torch.float32).item() for b in (bits, bits + 0x10000))


@pytest.mark.parametrize("beta2", [0.95, 0.999])
def test_bf16_moments_follow_fp32_ones(beta2):
    """300 steps of a slowly moving gradient: the bf16 moments' mean over many weights stays within a fraction of
    a percent of the fp32 moments (round-to-nearest loses v's steps below half an ulp, which at beta2 = 0.999 is
    most of them, and drifts by percents), and the weights move alike."""
    n = 8192
    torch.manual_seed(0)
    runs = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        p, m, v = torch.ones(n), torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        for step in range(1, 301):
            grad = torch.full((n,), 1.0 + 0.5 * step / 300)
            ref.adamw_flat(p, grad, m, v, None, torch.tensor(1.0), step, 1e-3, 0.9, beta2, 1e-8, 0.0, seed=step)
        runs[name] = (p, m.float(), v.float())
    for a, b, what in zip(runs["bf16"], runs["fp32"], ("p", "m", "v")):
        assert abs(a.double().mean().item() / b.double().mean().item() - 1) < 2e-3, what
    # round-to-nearest, for contrast: v's steps below half an ulp are lost or rounded up whole, and it drifts
    p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
    for step in range(1, 301):
        grad = torch.full((n,), 1.0 + 0.5 * step / 300)
        ref.adamw_flat(p, grad, m, v, None, torch.tensor(1.0), step, 1e-3, 0.9, beta2, 1e-8, 0.0)
        m.copy_(m.to(torch.bfloat16))
        v.copy_(v.to(torch.bfloat16))
    if beta2 == 0.999:
        assert abs(v.mean().item() / runs["fp32"][2].mean().item() - 1) > 0.01


def test_config_checks():
    assert load_run_config("tiny", []).train.moments_dtype == "fp32"
    assert load_run_config("tiny", ["--train.moments_dtype=bf16"]).train.moments_dtype == "bf16"
    with pytest.raises(ConfigError, match="train.moments_dtype must be fp32 or bf16, got 'fp16'"):
        load_run_config("tiny", ["--train.moments_dtype=fp16"])


def test_bf16_moments_need_the_working_copy(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.moments_dtype=bf16 needs the working copy's optimizer"):
        Trainer(tiny_cfg(data_dir, "--train.device=cpu", "--train.moments_dtype=bf16"), tmp_path / "a",
                log=lambda s: None)


@pytest.mark.slow
def test_trainer_with_bf16_moments_learns_checkpoints_and_resumes_bit_identical(data_dir, tmp_path):
    common = (*CPU_BF16, "--train.moments_dtype=bf16")  # (the default warmup: steps 1-3 on the same schedule)
    cfg = tiny_cfg(data_dir, *common, "--train.max_steps=6", "--train.save_every=3", "--train.keep_last=5")
    straight = tmp_path / "straight"
    lines = []
    tr = Trainer(cfg, straight, log=lines.append)
    assert tr.optimizer.m.dtype == tr.optimizer.v.dtype == torch.bfloat16
    tr.run()
    assert any("AdamW moments bf16 with stochastic rounding" in line for line in lines)
    from safetensors.torch import load_file

    opt_state = load_file(str(straight / "step-6" / "optimizer.safetensors"))
    moments = [t for k, t in opt_state.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and all(t.dtype == torch.bfloat16 for t in moments)
    state = final_state(straight, 6)
    resumed = tmp_path / "resumed"
    run(tiny_cfg(data_dir, *common, "--train.max_steps=3", "--train.save_every=3"), resumed)
    run(cfg, resumed, resume=True)
    other = final_state(resumed, 6)
    for k in state:
        assert torch.equal(state[k], other[k]), k
    # the memory estimate counts 4 bytes of moments per trained weight, not 8
    from anyseek.train.memory import estimate

    run32, run16 = (load_run_config("tiny", [f"--train.moments_dtype={d}"]) for d in ("fp32", "bf16"))
    mc = run32.model_config(vocab_size=512)
    e32, e16 = (estimate(mc, r, working_copy=True) for r in (run32, run16))
    assert e16.optimizer * 2 == e32.optimizer > 0
