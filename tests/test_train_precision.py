"""The bf16 working copy of the fp32 master weights (train/precision.py, `train.working_copy`): gradients equal to
those of a bf16 model, master weights fp32 everywhere outside the step (optimizer, checkpoints, evaluation), the copy
refreshed after every step and after a resume, bit-exact resume, LoRA's frozen fp32 tensors swapped too."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers import final_state, run, tiny_cfg

from anyseek.train import precision
from anyseek.train.config import ConfigError, load_run_config
from anyseek.train.trainer import Trainer

CPU_BF16 = ("--train.device=cpu", "--train.dtype=bf16")


def test_config_accepts_auto_true_false_only():
    assert load_run_config("tiny", []).train.working_copy == "auto"
    assert load_run_config("tiny", ["--train.working_copy=false"]).train.working_copy == "false"
    with pytest.raises(ConfigError, match="train.working_copy must be auto, true or false, got 'bf16'"):
        load_run_config("tiny", ["--train.working_copy=bf16"])


def test_reasons_a_working_copy_is_unavailable():
    assert "fp32" in precision.unavailable(torch.device("cuda"), False, None)
    assert "torchrun" in precision.unavailable(torch.device("cuda"), True, torch.bfloat16)
    assert "cpu" in precision.unavailable(torch.device("cpu"), False, torch.bfloat16)
    assert precision.unavailable(torch.device("cuda"), False, torch.bfloat16) is None


def test_off_by_default_on_cpu_and_true_needs_a_low_precision(data_dir, tmp_path):
    lines = []
    tr = Trainer(tiny_cfg(data_dir, "--train.device=cpu"), tmp_path / "a", log=lines.append)
    assert tr.working is None
    tr._describe()
    assert any(line.startswith("weights: fp32 (no working copy: the run computes in fp32") for line in lines), lines
    with pytest.raises(ConfigError, match="train.working_copy=true but the run computes in fp32"):
        Trainer(tiny_cfg(data_dir, "--train.device=cpu", "--train.working_copy=true"), tmp_path / "b",
                log=lambda s: None)


def _trainer(data, out, *extra):
    cfg = tiny_cfg(data, *CPU_BF16, "--train.working_copy=true", "--train.warmup_steps=1", *extra)
    return Trainer(cfg, out, log=lambda s: None)


@pytest.mark.parametrize("accum", [1, 2])
def test_gradients_are_those_of_the_bf16_model(data_dir, tmp_path, accum):
    """The flat gradients equal, bit for bit, the gradients of a bf16 copy of the model run without autocast on the
    same micro-batches (one micro-batch: kept in bf16; several: summed in fp32); the parameters are fp32 again after
    the step's forward and backward, without `.grad`."""
    tr = _trainer(data_dir, tmp_path / "w", f"--train.grad_accum={accum}")
    w = tr.working
    assert w is not None and w.accumulate == (accum > 1)
    assert w.flat_grad.dtype == (torch.float32 if accum > 1 else torch.bfloat16)
    twin = copy.deepcopy(tr.model).to(torch.bfloat16)
    batches = iter(tr.train_loader)
    micro = [next(batches) for _ in range(accum)]
    tr.engine._accumulate(iter(micro))
    assert all(p.dtype == torch.float32 and p.grad is None for p in tr.model.parameters())
    from anyseek.model.mtp import count_segments, count_targets

    counts = [count_targets(b.targets, b.cu_seqlens, len(twin.mtp)) for b in micro]
    num = torch.tensor([sum(c[i] for c in counts) for i in range(len(counts[0]))], dtype=torch.float32)
    counts = [count_segments(b.targets, b.cu_seqlens, len(twin.mtp)) for b in micro]
    segments = torch.tensor([sum(c[i] for c in counts) for i in range(len(counts[0]))], dtype=torch.float32)
    want = {n: torch.zeros(p.shape) for n, p in twin.named_parameters()}
    for b in micro:
        twin.zero_grad(set_to_none=True)
        out = twin(b.input_ids, cu_seqlens=b.cu_seqlens, targets=b.targets, max_seqlen=b.max_seqlen,
                   return_logits=False, num_targets=num, num_segments=segments)
        loss = out.lm_loss + tr.engine.mtp_loss_weight() * out.mtp_loss
        loss = loss + tr.model_cfg.aux_loss_alpha * out.balance_loss
        loss.backward()
        for n, p in twin.named_parameters():
            if p.grad is not None:
                want[n] += p.grad.float()
    grads = dict(zip((id(p) for p in w.trained), w.grads))
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(grads[id(p)].float(), want[n], rtol=0, atol=0, msg=n)
    expect = torch.cat([want[n].flatten() for n, p in tr.model.named_parameters()]).square().sum().sqrt()
    torch.testing.assert_close(w.grad_norm(), expect, rtol=1e-5, atol=0)


def test_flat_adamw_is_torch_adamw(tmp_path):
    """FlatAdamW's step (the reference backend on CPU) is torch.optim.AdamW's, with the clip factor folded in, over
    two parameter groups; its state loads from AdamW-shaped tensors."""
    from anyseek.checkpoint.optimizer import load_optimizer, save_optimizer
    from anyseek.train.config import TrainConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1)
    w = precision.WorkingCopy(model, torch.bfloat16, accumulate=True)  # fp32 gradients: comparable with AdamW's
    opt = precision.build_flat_adamw(w, cfg)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    no_decay = [p for p in ref.parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    for step in range(4):
        scale = 1.0 + step
        refs = dict(ref.named_parameters())
        names = {id(p): n for n, p in model.named_parameters()}
        for q, g in zip(w.trained, w.grads):  # the flat order: matrices first
            p = refs[names[id(q)]]
            grad = torch.randn(p.shape)
            g.copy_(grad)
            p.grad = grad / scale
        opt.grad_scale = torch.tensor(scale)
        opt.step()
        ref_opt.step()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
        torch.testing.assert_close(w.flat_low, w.flat.to(torch.bfloat16), rtol=0, atol=0)
        w.before_step()
    # a step skipped on the device (the trainer's overlap) changes no buffer, even with non-finite gradients
    w.flat_grad.fill_(float("nan"))
    kept = [t.clone() for t in (w.flat, w.flat_low, opt.m, opt.v)]
    opt.skip = torch.tensor(1.0)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(kept, (w.flat, w.flat_low, opt.m, opt.v)))
    assert int(opt.state[w.trained[0]]["step"]) == 5
    opt.uncount()
    opt.skip.zero_()
    assert int(opt.state[w.trained[0]]["step"]) == 4
    save_optimizer(ref_opt, ref, tmp_path)  # a torch AdamW checkpoint, loaded into the flat buffers
    load_optimizer(opt, model, tmp_path)
    opt.step()
    assert int(opt.state[w.trained[0]]["step"]) == 5
    m = dict(zip((id(p) for p in w.trained), (opt.state[p]["exp_avg"] for p in w.trained)))
    assert all(m[id(p)].data_ptr() == opt.m[a:b].data_ptr() for p, (a, b) in w.offsets.items())


def _steps(tr, n: int, each=lambda: None) -> list[float]:
    """n optimizer steps as the loop runs them (each one must step); `each` runs after every step."""
    batches = iter(tr.train_loader)
    losses = []
    for _ in range(n):
        ok, loss, _ = tr.engine._apply(tr.engine._accumulate(batches))  # the step count goes up with it
        assert ok
        losses.append(loss)
        each()
    return losses


def test_master_weights_stay_fp32_and_the_copy_follows_them(data_dir, tmp_path):
    tr = _trainer(data_dir, tmp_path / "w")
    w = tr.working
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}

    def copy_follows():
        for p, low in zip(w.trained, w.low):
            assert p.dtype == torch.float32 and p.grad is None
            assert torch.equal(low, p.detach().to(torch.bfloat16))  # written by the optimizer step

    losses = _steps(tr, 8, copy_follows)
    moved = [n for n, p in tr.model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(moved) == len(before)  # every master weight was updated in fp32
    assert all(s["exp_avg"].dtype == torch.float32 for s in tr.optimizer.state.values())
    assert all(p.data_ptr() == w.flat[a:b].data_ptr() for p, (a, b) in w.offsets.items())  # views of the flat
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
def test_checkpoints_hold_the_fp32_masters_and_resume_is_bit_identical(data_dir, tmp_path):
    cfg = tiny_cfg(data_dir, *CPU_BF16, "--train.working_copy=true", "--train.max_steps=6", "--train.save_every=3",
                   "--train.keep_last=5")
    straight = tmp_path / "straight"
    run(cfg, straight)
    state = final_state(straight, 6)
    assert all(t.dtype == torch.float32 for t in state.values())
    resumed = tmp_path / "resumed"
    run(tiny_cfg(data_dir, *CPU_BF16, "--train.working_copy=true", "--train.max_steps=3", "--train.save_every=3"),
        resumed)
    run(cfg, resumed, resume=True)  # continues from step-3: the loaded masters must reach the working copy
    other = final_state(resumed, 6)
    for k in state:
        assert torch.equal(state[k], other[k]), k


def test_lora_frozen_fp32_tensors_held_in_low_precision_and_unchanged(data_dir, tmp_path):
    """LoRA: the base matrices are bf16 already; the frozen fp32 embedding and norms are converted too (no autocast
    would make their products mixed; nothing writes them, so no fp32 copy is kept), get no gradient, and are
    unchanged; only the adapters train."""
    run(tiny_cfg(data_dir, "--train.max_steps=1"), tmp_path / "base")
    init = f"--train.init={json.dumps(str(tmp_path / 'base' / 'step-1'))}"
    tr = _trainer(data_dir, tmp_path / "lora", init, "--train.lora_rank=4")
    w = tr.working
    trained = {id(p) for p in w.trained}
    assert trained == {id(p) for p in tr.model.parameters() if p.requires_grad}
    assert w.frozen and not any(p.requires_grad for p in w.frozen)  # frozen fp32 tensors, converted
    assert all(p.dtype == w.dtype for p in w.frozen)
    ptrs = [p.data_ptr() for p in w.frozen]
    with w.active():  # held in the low precision alone: not swapped
        assert [p.data_ptr() for p in w.frozen] == ptrs
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    losses = _steps(tr, 4)
    for n, p in tr.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach(), frozen[n]), n
        else:
            assert p.dtype == torch.float32 and not torch.equal(p.detach(), adapters[n]), n
    assert all(math.isfinite(x) for x in losses), losses


def test_lora_experts_adapters_lie_back_to_back_in_the_gradient_buffer():
    """The working copy lays each LoRA routed-experts module's four adapters out back to back, in the kernels'
    order, so that the Triton LoRA experts write their gradients into the buffer (`kernels.grad_destinations`)
    instead of a tensor of their own beside it."""
    from anyseek import kernels
    from anyseek.model.config import ModelConfig
    from anyseek.model.transformer import DeepSeekV3
    from anyseek.transforms import lora as lora_lib

    torch.manual_seed(0)
    model = DeepSeekV3(ModelConfig.from_name("tiny", num_hidden_layers=3, vocab_size=64))
    lora_lib.apply_lora(model, lora_lib.LoRASpec(rank=4, alpha=8), torch.bfloat16)
    w = precision.WorkingCopy(model, torch.bfloat16, accumulate=False)
    experts = [m for m in model.modules() if isinstance(m, lora_lib.LoRAExperts)]
    assert experts
    with w.active():
        for m in experts:
            four = (m.gate_up_lora_A, m.gate_up_lora_B, m.down_lora_A, m.down_lora_B)
            dest = kernels.grad_destinations(four)
            assert dest is not None and dest.dtype == torch.bfloat16 and dest.numel() == sum(p.numel() for p in four)
            first = next(i for i, p in enumerate(w.trained) if p is m.gate_up_lora_A)
            assert dest.data_ptr() == w.grads[first].data_ptr()
    assert kernels.grad_destinations((experts[0].gate_up_lora_B, experts[0].gate_up_lora_A)) is None  # order counts


def _losses(data, tmp_path, working: str, graphs: str, steps: int):
    cfg = tiny_cfg(data, "--train.device=cuda", f"--train.working_copy={working}", f"--train.cuda_graphs={graphs}",
                   "--train.max_steps=100", "--train.warmup_steps=1", "--train.lr=1e-3")
    tr = Trainer(cfg, tmp_path / f"{working}{graphs}", log=lambda s: None)
    return _steps(tr, steps), tr


@pytest.mark.cuda
def test_working_copy_on_cuda_follows_autocast_and_graphs_replay_it(data_dir, tmp_path):
    """On a GPU the working copy is on by default; its losses follow autocast's within bf16 noise, and its graphed
    step matches its eager step."""
    auto, _ = _losses(data_dir, tmp_path, "false", "false", 12)
    eager, tr = _losses(data_dir, tmp_path, "auto", "false", 12)
    graphed, tg = _losses(data_dir, tmp_path, "auto", "true", 12)
    assert tr.working is not None and tg.working is not None and tg.graphs.replays >= 10
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=2e-3, atol=0)
    torch.testing.assert_close(torch.tensor(eager), torch.tensor(auto), rtol=2e-2, atol=0)
    assert graphed[-1] < graphed[0] - 0.3


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", ["false", "true"])
def test_gpu_flat_gradients_are_those_of_the_bf16_model(data_dir, tmp_path, graphs):
    """On a GPU (Triton kernels; the routed experts write their weight gradients straight into the flat buffer, the
    other weights are copied there): the flat gradients match a bf16 copy of the model run on the same batch, eager
    or graphed (not bit for bit: the attention backward sums with atomics)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from anyseek.model.moe import Experts
    from anyseek.model.mtp import count_targets

    cfg = tiny_cfg(data_dir, "--train.device=cuda", "--train.working_copy=true", f"--train.cuda_graphs={graphs}",
                   "--train.warmup_steps=1")
    tr = Trainer(cfg, tmp_path / "w", log=lambda s: None)
    w = tr.working
    experts = [m for m in tr.model.modules() if isinstance(m, Experts)]
    assert w is not None and experts
    twin = copy.deepcopy(tr.model).to(torch.bfloat16)
    for p in twin.parameters():  # the twin computes its gradients the plain way
        p.__dict__.pop("_anyseek_grad_dest", None)
    batches = iter(tr.train_loader)
    for _ in range(3):  # graphed: warm-up, capture, then a replay
        b = next(batches)
        tr.engine._accumulate(iter([b]))
    num = torch.tensor(count_targets(b.targets, b.cu_seqlens, len(twin.mtp)), dtype=torch.float32).cuda()
    d = b.to("cuda")
    out = twin(d.input_ids, cu_seqlens=d.cu_seqlens, targets=d.targets, max_seqlen=d.max_seqlen, return_logits=False,
               num_targets=num)
    (out.lm_loss + tr.engine.mtp_loss_weight() * out.mtp_loss + tr.model_cfg.aux_loss_alpha * out.balance_loss).backward()
    grads = dict(zip((id(p) for p in w.trained), w.grads))
    for (n, p), (_, q) in zip(tr.model.named_parameters(), twin.named_parameters()):
        got, want = grads[id(p)].float(), q.grad.float()
        err = (got - want).norm() / want.norm().clamp(min=1e-12)
        assert err < 2e-2, (n, err.item())
    if graphs == "true":
        assert tr.graphs.replays >= 1
