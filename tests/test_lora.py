"""LoRA fine-tuning from a base model: LoRA freezes the base bit for bit, trains only adapters, starts at the base's
output, holds the base in bf16 (norms, router and embedding in fp32); adapters in fused projections and routed
experts match merged weights and a per-expert reference; a LoRA run merges into a folder with the same logits (in
transformers too), exports for PEFT, resumes exactly, refuses another base; the memory estimate and its advice."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import base_model_cfg, first_batch, init_cfg, run, train_rows, vocab_of

from anyseek import hf
from anyseek.model.config import ModelConfig
from anyseek.model.transformer import DeepSeekV3
from anyseek.train.config import load_run_config
from anyseek.train.trainer import Trainer
from anyseek.transforms import lora as lora_lib

# ---------------------------------------------------------------- LoRA: the maths


def _random_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora_lib._is_adapter(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_lora_starts_at_the_base_and_trains_only_adapters(base_data):
    torch.manual_seed(0)
    model = DeepSeekV3(base_model_cfg(vocab_of(base_data))).train()
    b = first_batch(base_data)
    kw = {"cu_seqlens": b.cu_seqlens, "targets": b.targets, "max_seqlen": b.max_seqlen}
    with torch.no_grad():
        base = model(b.input_ids, **kw)
    lora_lib.apply_lora(model, lora_lib.LoRASpec(rank=4, alpha=8))
    out = model(b.input_ids, **kw)
    assert torch.equal(out.logits, base.logits) and torch.equal(out.loss, base.loss)  # B = 0
    out.loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(lora_lib._is_adapter(n) for n in trained)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trained)
    kinds = {n.rsplit(".", 2)[-2] for n in trained}
    assert {"q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj", "experts"} <= kinds
    # the frozen weights the model joins (q_a|kv_a, gate|up) lie row after row: read as views, never copied
    from anyseek.model.concat import rows_adjacent

    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert rows_adjacent([attn.q_a_proj.base.weight, attn.kv_a_proj_with_mqa.base.weight])
    assert rows_adjacent([mlp.gate_proj.base.weight, mlp.up_proj.base.weight])
    from anyseek.train.config import TrainConfig
    from anyseek.train.optim import build_optimizer

    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == lora_lib.count_adapters(model)


def test_base_matrices_held_in_bf16_norms_router_embedding_fp32():
    model = lora_lib.apply_lora(DeepSeekV3(base_model_cfg(300)), lora_lib.LoRASpec(rank=2), torch.bfloat16)
    layer = model.model.layers[1]
    assert layer.self_attn.o_proj.base.weight.dtype == torch.bfloat16
    assert layer.mlp.experts.base.gate_up_proj.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    for p in (model.model.embed_tokens.weight, layer.mlp.gate.weight, layer.input_layernorm.weight,
              layer.self_attn.o_proj.lora_A):
        assert p.dtype == torch.float32
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_lora_linear_called_equals_merged_weight():
    torch.manual_seed(0)
    lin = lora_lib.LoRALinear(torch.nn.Linear(24, 40, bias=False), lora_lib.LoRASpec(rank=3, alpha=6))
    _random_adapters(lin)
    x = torch.randn(7, 24)
    torch.testing.assert_close(lin(x), x @ lin.weight.t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.merged()(x), lin(x), rtol=1e-5, atol=1e-6)


def test_adapters_in_fused_projections_equal_merged_weights(monkeypatch):
    """The fused q_a|kv_a and gate|up matmuls join the base weights and add each adapter into its own columns; the
    logits and every adapter's gradient equal those of the same model whose joined layers read their merged weights
    W + s B A instead (`LoRALinear.weight`, differentiable in the adapters), fp64; the frozen base gets none."""
    torch.manual_seed(0)
    model = lora_lib.apply_lora(DeepSeekV3(base_model_cfg(300)), lora_lib.LoRASpec(rank=3, alpha=6)).double()
    _random_adapters(model)
    ids = torch.randint(0, 300, (40,))
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(ids, cu_seqlens=cu, targets=torch.roll(ids, -1), max_seqlen=23)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lb, gb = run()
    monkeypatch.setattr(lora_lib.LoRALinear, "fused_weight", property(lambda m: m.weight))  # merged, no term beside
    monkeypatch.setattr(lora_lib.LoRALinear, "fused_low_rank", property(lambda m: None))
    la, ga = run()
    torch.testing.assert_close(lb, la, rtol=1e-10, atol=1e-10)
    assert ga.keys() == gb.keys() and all(lora_lib._is_adapter(n) for n in gb)
    assert any("q_a_proj" in n for n in gb) and any("gate_proj" in n for n in gb)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-9, atol=1e-10)


def test_routed_expert_adapters_match_per_expert_reference():
    torch.manual_seed(0)
    E, D, I, K, T, r, s = 5, 16, 8, 2, 23, 3, 1.5
    experts = lora_lib.Experts(base_model_cfg(300, n_routed_experts=E, moe_intermediate_size=I, hidden_size=D,
                                              n_group=1, topk_group=1))
    torch.nn.init.normal_(experts.gate_up_proj, 0, 0.3)
    torch.nn.init.normal_(experts.down_proj, 0, 0.3)
    lo = lora_lib.LoRAExperts(experts, lora_lib.LoRASpec(rank=r, alpha=r * s))
    _random_adapters(lo)
    x = torch.randn(T, D, dtype=torch.float64)
    used = torch.tensor([0, 1, 2, 4])  # expert 3 gets no token: an empty group
    ids = torch.stack([used[torch.randperm(4)[:K]] for _ in range(T)])
    w = torch.rand(T, K, dtype=torch.float64)
    got = lo.double()(x, ids, w)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):  # unmerged, token by token: x W^T + s (x A^T) B^T per projection
        for k in range(K):
            e = ids[t, k]
            h = x[t] @ lo.base.gate_up_proj[e].t() + s * (x[t] @ lo.gate_up_lora_A[e].t()) @ lo.gate_up_lora_B[e].t()
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            y = a @ lo.base.down_proj[e].t() + s * (a @ lo.down_lora_A[e].t()) @ lo.down_lora_B[e].t()
            want[t] += w[t, k] * y
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the seam combines in fp32


# ---------------------------------------------------------------- LoRA: training, checkpoints, export


def lora_cfg(base_data, base_dir, *more):
    return init_cfg(base_data, f"--train.init={json.dumps(str(base_dir))}", "--train.lora_rank=4",
                    "--train.lora_alpha=8",
               "--train.lr=2e-2", *more)


def test_lora_run_trains_adapters_keeps_base_and_exports(base_data, base_dir, tmp_path):
    out = tmp_path / "run"
    run(lora_cfg(base_data, base_dir, "--train.max_steps=12", "--train.save_every=6"), out)
    rows = train_rows(out)
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]) - 0.3
    step = out / "step-12"
    assert {"adapters.safetensors", "lora.json", "tokenizer.json"} <= {p.name for p in step.iterdir()}
    assert not (step / "model.safetensors").exists()
    # the base the adapters sit on is bit for bit the folder's (it was never trained)
    from anyseek.checkpoint.exporter import export_merged, export_peft, load_lora_model

    model = load_lora_model(step)
    folder = hf.load_pretrained(base_dir, dtype=torch.float32)
    wrapped = {n.replace(".base.", "."): p for n, p in model.named_parameters() if not lora_lib._is_adapter(n)}
    for n, p in folder.named_parameters():
        assert torch.equal(wrapped[n], p), n
    # merged export: same logits as base + adapters (fp32), and it loads in transformers
    export_merged(out, tmp_path / "merged", dtype=torch.float32)
    merged = hf.load_pretrained(tmp_path / "merged", dtype=torch.float32)
    x = first_batch(base_data)
    with torch.no_grad():
        a = model(x.input_ids, cu_seqlens=x.cu_seqlens).logits
        m = merged(x.input_ids, cu_seqlens=x.cu_seqlens).logits
        f = folder(x.input_ids, cu_seqlens=x.cu_seqlens).logits
    assert (a - f).abs().max() > 1e-3  # the adapters changed the model
    assert (a - m).abs().max() <= 1e-5 * a.abs().max()
    # the decode paths read the stacked expert weights themselves: they get base + adapters too
    prompt = x.input_ids[:8].tolist()
    assert hf_generate(model, prompt) == hf_generate(merged, prompt) != hf_generate(folder, prompt)
    # `anyseek export RUN --out DIR`: a LoRA run is merged (the same folder as export_merged's), with its tokenizer
    from anyseek.cli import main

    assert main(["export", str(out), "--out", str(tmp_path / "cli"), "--dtype", "fp32"]) == 0
    from_cli = hf.load_pretrained(tmp_path / "cli", dtype=torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(from_cli.parameters(), merged.parameters()))
    assert (tmp_path / "cli" / "tokenizer.json").read_text() == (step / "tokenizer.json").read_text()
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = x.input_ids[: x.cu_seqlens[1]][None]
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits[0], merged(ids[0]).logits, rtol=1e-4, atol=1e-4)
    # PEFT folder: PEFT's key names; loads into transformers with peft when installed
    export_peft(step, tmp_path / "peft")
    cfg_json = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg_json["r"] == 4 and cfg_json["lora_alpha"] == 8
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight" in keys
    assert all(".self_attn." in k for k in keys) and not any(k.startswith("base_model.model.mtp") for k in keys)
    peft = pytest.importorskip("peft")
    base_t = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base_t, tmp_path / "peft").eval()
    lin_only = load_lora_model(step)  # the same adapters, attention only (what the PEFT folder holds)
    with torch.no_grad():
        for n, p in lin_only.named_parameters():
            if lora_lib._is_adapter(n) and "self_attn" not in n:
                p.zero_()
        torch.testing.assert_close(pm(ids).logits[0], lin_only(ids[0]).logits, rtol=1e-4, atol=1e-4)


def test_lora_resume_is_bit_exact(base_data, base_dir, tmp_path):
    from safetensors.torch import load_file

    run(lora_cfg(base_data, base_dir, "--train.max_steps=4", "--train.save_every=2", "--train.lora_dropout=0.1"),
        tmp_path / "straight")
    c = lora_cfg(base_data, base_dir, "--train.max_steps=4", "--train.save_every=2", "--train.lora_dropout=0.1")
    c.train.max_steps = 2
    run(c, tmp_path / "split")
    run(lora_cfg(base_data, base_dir, "--train.max_steps=4", "--train.save_every=2", "--train.lora_dropout=0.1"),
        tmp_path / "split", resume=True)
    a = load_file(str(tmp_path / "straight" / "step-4" / "adapters.safetensors"))
    b = load_file(str(tmp_path / "split" / "step-4" / "adapters.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hf_generate(model, prompt: list[int]) -> list[int]:
    from anyseek.infer.generate import generate

    return generate(model, prompt, 12, temperature=0.0)


def test_resume_compares_init_and_lora_settings(base_data, base_dir, tmp_path):
    from anyseek.train.resume import ResumeMismatch

    out = tmp_path / "run"
    run(lora_cfg(base_data, base_dir, "--train.max_steps=1"), out)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ResumeMismatch, match=r"train\.lora_alpha: checkpoint 8\.0, this run 4\.0"):
        run(lora_cfg(base_data, base_dir, "--train.max_steps=2", "--train.lora_alpha=4"), out, resume=True)
    moved = tmp_path / "moved"
    shutil.copytree(base_dir, moved)
    c = lora_cfg(base_data, moved, "--train.max_steps=2")
    with pytest.raises(ResumeMismatch, match=r"train\.init: checkpoint"):
        run(c, out, resume=True)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing loaded or written
    # the same model in another folder: allowed with --resume-override train.init (the content hash still matches)
    messages: list[str] = []
    Trainer(c, out, resume=True, log=messages.append, resume_overrides=("train.init",)).run()
    assert any("resumed from" in m and "train.init" in m for m in messages)
    # another model there: the adapters refuse it even when the path change is allowed
    hf.save_pretrained(DeepSeekV3(base_model_cfg(vocab_of(base_data), num_nextn_predict_layers=0)), moved)
    from anyseek.storage import CheckpointError

    c = lora_cfg(base_data, moved, "--train.max_steps=3")
    with pytest.raises(ResumeMismatch, match=r"init content \(sha256\)"):
        run(c, out, resume=True)
    with pytest.raises(CheckpointError, match="were trained on the base"):
        Trainer(c, out, resume=True, log=lambda s: None, resume_overrides=("train.init",)).run()


def test_generate_and_eval_name_export_for_a_lora_checkpoint(base_data, base_dir, tmp_path):
    from anyseek.infer.loading import CLIError, resolve

    run(lora_cfg(base_data, base_dir, "--train.max_steps=1"), tmp_path / "r")
    for folder in (tmp_path / "r", tmp_path / "r" / "step-1"):
        with pytest.raises(CLIError, match="anyseek export --merge"):
            resolve(folder)


def test_export_errors_are_one_line(tmp_path, capsys):
    from anyseek.cli import main

    assert main(["export", "--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no complete checkpoint to export" in err
    assert err.count("\n") == 1 and not (tmp_path / "x").exists()
    assert main(["export", "--out", str(tmp_path / "x")]) == 2
    assert "one of RUN_OR_STEP, --merge RUN_OR_STEP or --peft RUN_OR_STEP" in capsys.readouterr().err


def test_lora_checkpoint_refuses_another_base(base_data, base_dir, tmp_path):
    run(lora_cfg(base_data, base_dir, "--train.max_steps=1"), tmp_path / "r")
    other = tmp_path / "other"
    shutil.copytree(base_dir, other)
    hf.save_pretrained(DeepSeekV3(base_model_cfg(vocab_of(base_data), num_nextn_predict_layers=0)), other)
    from anyseek.checkpoint.exporter import load_lora_model
    from anyseek.storage import CheckpointError

    with pytest.raises(CheckpointError, match="were trained on the base"):
        load_lora_model(tmp_path / "r" / "step-1", base=other)


def test_memory_estimate_and_advice(monkeypatch):
    from anyseek.train import memory

    c = load_run_config("small", ["--train.init=x", "--train.lora_rank=16"])
    mc = ModelConfig.from_name("small")
    full = memory.estimate(mc, c, None)
    lo = memory.estimate(mc, c, lora_lib.LoRASpec(16), torch.bfloat16)
    n = DeepSeekV3(mc, device="meta").num_parameters()
    assert full.weights == 4 * n and full.optimizer == 8 * n and lo.optimizer < full.optimizer / 25
    assert lo.weights < full.weights / 1.5 and lo.total < full.total
    # the same activations but the loss's chunk of logits: smaller for LoRA's frozen head (no [V, D] sum to re-read)
    t = c.data.tokens_per_batch
    chunk = {low: memory._head_chunk_bytes(mc, t, low) - memory._head_chunk_bytes(mc, t, low, head_trained=False)
             for low in (2, 4)}
    assert full.activations - lo.activations in chunk.values() and min(chunk.values()) > 0, (full, lo, chunk)
    lines = []
    monkeypatch.setattr(memory, "available", lambda device: 2.0 * memory.GiB)
    memory.report(mc, c, torch.device("cpu"), None, torch.float32, lines.append)
    text = "\n".join(lines)
    assert "expected peak memory" in text and "not fit" in text and "--train.lora_rank" in text
    assert "--parallel.activation_checkpointing=full" in text
    # activation checkpointing (main's parallel.activation_checkpointing): full < selective < none
    acts = {mode: memory.estimate(mc, load_run_config("small", [f"--parallel.activation_checkpointing={mode}"]),
                                  None).activations for mode in ("none", "selective", "full")}
    head = memory._head_chunk_bytes(mc, c.data.tokens_per_batch, 2)  # the loss's logits chunk: no layer's
    assert acts["full"] < acts["selective"] < acts["none"] and acts["full"] - head < (acts["none"] - head) / 3
    assert full.activations_full_checkpointing == acts["full"]
    # the default GPU step (train.working_copy): bf16 copies and gradients, bf16 activations; as the trainer decides
    wc = memory.estimate(mc, c, None, working_copy=True)
    assert (wc.weights, wc.weight_copies, wc.grads, wc.optimizer) == (4 * n, 2 * n, 2 * n, 8 * n)
    assert wc.activations < full.activations
    from anyseek.train import precision  # the decision report() and the trainer share; it needs no GPU

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert precision.wanted(c.train.working_copy, cuda, False, bf16)
    assert not precision.wanted(c.train.working_copy, torch.device("cpu"), False, None)
    assert not precision.wanted(load_run_config("small", ["--train.working_copy=false"]).train.working_copy, cuda,
                                False, bf16)
    accum = memory.estimate(mc, load_run_config("small", ["--train.grad_accum=2"]), None, working_copy=True)
    assert accum.grads == 4 * n  # summed over micro-batches in fp32
