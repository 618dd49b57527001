"""LoRA over a 4-bit base (`train.base_bits = 4`) end to end on the CPU (reference backends): the targets' weights
held as packed NF4 rows (the embedding, head, norms and router not), a run from a Hugging Face folder trains and
resumes bit for bit (the base re-quantized the same way), `anyseek export` merges dequant(W) + s B A into a bf16 /
fp32 folder that transformers loads with the 4-bit model's logits, `--peft` writes the adapters; the loader
quantizes tensor by tensor; the config key is validated."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import base_model_cfg, first_batch, init_cfg, run, vocab_of

from anyseek import hf, kernels
from anyseek.train.config import ConfigError
from anyseek.transforms import lora as lora_lib

# the tiny flavor's widths that are not multiples of the 64-input groups, made so: the expert width and the KV latent
WIDE = {"moe_intermediate_size": 64, "kv_lora_rank": 64}


@pytest.fixture(scope="module")
def base4_dir(tmp_path_factory, base_data):
    from anyseek.model.transformer import DeepSeekV3

    folder = tmp_path_factory.mktemp("base4") / "model"
    torch.manual_seed(5)
    model = DeepSeekV3(base_model_cfg(vocab_of(base_data), **WIDE))
    hf.save_pretrained(model, folder)
    for f in (base_data / "tokenizer").iterdir():
        shutil.copy2(f, folder / f.name)
    return folder


def cfg4(base_data, base_dir, *more):
    return init_cfg(base_data, f"--train.init={json.dumps(str(base_dir))}", "--train.lora_rank=4",
                    "--train.lora_alpha=8", "--train.lr=2e-2", "--train.base_bits=4", *more)  # fmt: skip


def test_base_bits_is_validated(base_data, base4_dir):
    with pytest.raises(ConfigError, match="train.base_bits must be 16"):
        cfg4(base_data, base4_dir, "--train.base_bits=8")
    with pytest.raises(ConfigError, match="needs LoRA"):
        init_cfg(base_data, "--train.base_bits=4")


def test_targets_held_in_4_bits_and_the_rest_not(base_data):
    from anyseek.model.transformer import DeepSeekV3

    torch.manual_seed(0)
    model = DeepSeekV3(base_model_cfg(vocab_of(base_data), **WIDE))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_lib.apply_lora(model, lora_lib.LoRASpec(rank=4, base_bits=4), torch.bfloat16)
    packed = {n.replace(".base.", "."): p for n, p in model.named_parameters() if p.dtype == torch.uint8}
    # every projection LoRA targets and both expert stacks; nothing else
    assert packed and all(n.endswith(("proj.weight", "proj_with_mqa.weight", "gate_up_proj", "down_proj"))
                          for n in packed)
    assert sum(".experts." in n for n in packed) == 2 * len(list(model.moe_layers()))
    for n, p in packed.items():
        assert torch.equal(p, kernels.quantize4(ref[n])), n  # quantized from the fp32 weight, not a bf16 copy
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == torch.bfloat16
    assert all(dtypes[n] == torch.float32 for n in dtypes if n.endswith("norm.weight") or ".gate." in n)
    # the joined pairs (q_a|kv_a, gate|up) lie back to back in one packed buffer: fused_linear joins them as a view
    attn = model.model.layers[0].self_attn
    a, b = attn.q_a_proj.base.weight, attn.kv_a_proj_with_mqa.base.weight
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_quantizing_names_the_layer_whose_width_does_not_fit(base_data):
    from anyseek.model.transformer import DeepSeekV3

    model = DeepSeekV3(base_model_cfg(vocab_of(base_data)))  # the tiny flavor: expert width 32
    with pytest.raises(ValueError, match=r"mlp\.experts: 4-bit weight \(8, 128, 32\): the input dim 32 .* size 64"):
        lora_lib.apply_lora(model, lora_lib.LoRASpec(rank=4, targets=("routed_experts",), base_bits=4))


def test_4bit_lora_run_resumes_exactly_and_exports(base_data, base4_dir, tmp_path):
    from safetensors.torch import load_file

    from anyseek.checkpoint.exporter import export_merged, export_peft, load_lora_model

    run(cfg4(base_data, base4_dir, "--train.max_steps=4", "--train.save_every=2"), tmp_path / "straight")
    split = cfg4(base_data, base4_dir, "--train.max_steps=4", "--train.save_every=2")
    split.train.max_steps = 2
    run(split, tmp_path / "split")
    run(cfg4(base_data, base4_dir, "--train.max_steps=4", "--train.save_every=2"), tmp_path / "split", resume=True)
    step = tmp_path / "straight" / "step-4"
    a = load_file(str(step / "adapters.safetensors"))
    b = load_file(str(tmp_path / "split" / "step-4" / "adapters.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((step / "lora.json").read_text())["base_bits"] == 4

    model = load_lora_model(step)  # the base re-quantized from the folder, the adapters loaded
    assert any(p.dtype == torch.uint8 for p in model.parameters())
    x = first_batch(base_data)
    ids = x.input_ids[: x.cu_seqlens[1]]
    with torch.no_grad():
        ours = model(ids).logits
    export_merged(tmp_path / "straight", tmp_path / "merged", dtype=torch.float32)
    merged = hf.load_pretrained(tmp_path / "merged", dtype=torch.float32)
    full = hf.load_pretrained(base4_dir, dtype=torch.float32)
    lora_lib.apply_lora(full, lora_lib.LoRASpec(rank=4, alpha=8), torch.float32)  # the same adapters, 16-bit base
    lora_lib.load_adapter_state(full, a)
    with torch.no_grad():
        m = merged(ids).logits
        f = full.eval()(ids).logits
    assert (ours - m).abs().max() <= 1e-5 * ours.abs().max()  # merged = dequant(W) + s B A: the 4-bit model's
    assert (ours - f).abs().max() > 1e-3  # ... and not the full-precision base's
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids[None]).logits[0], ours, rtol=1e-4, atol=1e-4)
    export_peft(step, tmp_path / "peft")
    keys = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert keys and all(".lora_" in k for k in keys)


def test_loader_quantizes_piece_by_piece_to_the_same_codes(base4_dir, monkeypatch):
    """`load_pretrained(quantize4=)` packs the targets as it reads them: no full-precision target is materialized,
    each quantize call sees one checkpoint tensor (one expert's projection, not a stack), and the codes are those
    `apply_lora` makes from the model loaded in full precision."""
    from anyseek.hf import pretrained

    spec = lora_lib.LoRASpec(rank=4, base_bits=4)
    seen, dense = [], []
    quantize, materialize = pretrained.quantize4, pretrained._materialize
    monkeypatch.setattr(pretrained, "quantize4", lambda t: seen.append(tuple(t.shape)) or quantize(t))
    monkeypatch.setattr(pretrained, "_materialize", lambda pieces, old, *a: dense.append(old.shape) or
                        materialize(pieces, old, *a))  # fmt: skip
    streamed = hf.load_pretrained(base4_dir, dtype=torch.bfloat16,
                                  quantize4=lambda m: lora_lib.quantized_names(m, spec))  # fmt: skip
    names = lora_lib.quantized_names(streamed, spec)
    assert names and all(streamed.get_parameter(n).dtype == torch.uint8 for n in names)
    cfg = streamed.config
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    assert (I, D) in seen and (D, I) in seen and not any(len(s) == 3 for s in seen)  # per expert, never a stack
    assert not any(tuple(s[-2:]) in ((2 * I, D), (D, I)) for s in dense)  # no full-precision expert stack made
    full = hf.load_pretrained(base4_dir, dtype=torch.float32)
    lora_lib.apply_lora(full, spec, torch.bfloat16)
    lora_lib.apply_lora(streamed, spec, torch.bfloat16)
    a = {n: p for n, p in streamed.named_parameters() if p.dtype == torch.uint8}
    b = {n: p for n, p in full.named_parameters() if p.dtype == torch.uint8}
    assert len(a) == len(names) and a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_memory_estimate_counts_packed_bytes_by_hand(base_data):
    """The pre-run estimate of a 4-bit base against a hand count from the config: each targeted weight at 17/32
    byte (4 bits and a bf16 scale per 64) instead of 2, the embedding in bf16 instead of fp32."""
    from anyseek.model.config import ModelConfig
    from anyseek.train.memory import advice, estimate

    c = ModelConfig.from_name("tiny", **WIDE, num_hidden_layers=2, num_nextn_predict_layers=0)
    run_cfg = init_cfg(base_data)
    D, H, Q, L, R = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    nope, v, I, E = c.qk_nope_head_dim, c.v_head_dim, c.moe_intermediate_size, c.n_routed_experts
    attn = Q * D + H * (nope + R) * Q + (L + R) * D + H * (nope + v) * L + D * H * v
    dense = 3 * c.intermediate_size * D  # layer 0 (first_k_dense_replace = 1)
    moe = 3 * I * c.n_shared_experts * D + E * 3 * I * D  # layer 1: shared experts and the routed stacks
    targeted = 2 * attn + dense + moe
    e16 = estimate(c, run_cfg, lora_lib.LoRASpec(rank=4), torch.bfloat16)
    e4 = estimate(c, run_cfg, lora_lib.LoRASpec(rank=4, base_bits=4), torch.bfloat16)
    assert e4.weights == e16.weights - targeted * (2 - 17 / 32) - 2 * c.vocab_size * D
    assert e16.base4_saving == targeted * (2 - 17 / 32) and e4.base4_saving == 0
    assert any("--train.base_bits=4" in tip for tip in advice(e16, run_cfg, e16.weights))  # a device just too small


def test_activation_checkpointing_over_a_4bit_base_recomputes_and_gives_the_same_gradients(base_data):
    """parallel.activation_checkpointing (`apply_activation_checkpointing`, which one-process runs apply too) over
    LoRA with a 4-bit base: the layers run again in backward, and the adapters get the same gradients."""
    from anyseek.distributed.fsdp import apply_activation_checkpointing
    from anyseek.model.transformer import DeepSeekV3

    x = first_batch(base_data)
    n = int(x.cu_seqlens[1])  # one document
    grads, calls = [], []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = DeepSeekV3(base_model_cfg(vocab_of(base_data), **WIDE))
        lora_lib.apply_lora(model, lora_lib.LoRASpec(rank=4, base_bits=4), torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if lora_lib._is_adapter(name):
                    p.normal_(0, 0.1)
        if mode == "full":
            apply_activation_checkpointing(model, "full")
        count = []
        model.model.layers[1].mlp.experts.register_forward_pre_hook(lambda *a, c=count: c.append(1))
        out = model(x.input_ids[:n], cu_seqlens=x.cu_seqlens[:2], targets=x.targets[:n])
        out.loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
        calls.append(len(count))
    assert calls == [1, 2]  # recomputed in backward
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-7) for k in grads[0])


def test_fp8_release_loads_into_a_4bit_base(base4_dir, tmp_path):
    """The official FP8 layout (float8 weights + per-block scales): each targeted piece is dequantized, then packed;
    the result is the packing of the FP8 weights' values (an expert stack: its experts' pieces, gate and up rows)."""
    from safetensors.torch import save_file

    from anyseek.hf import safetensors_io as hf_io
    from anyseek.hf.fp8 import dequantize_blockwise, quantize_blockwise

    block, folder = (32, 32), tmp_path / "fp8"
    shutil.copytree(base4_dir, folder)
    state = {}
    with hf_io.TensorReader() as reader:
        for name, info in hf_io.scan_folder(folder).items():
            t = reader.get(info)
            if t.dim() == 2 and "embed" not in name and "head" not in name and ".gate." not in name:
                state[name], state[name + "_scale_inv"] = quantize_blockwise(t, block)
            else:
                state[name] = t
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    save_file(state, str(folder / hf_io.SINGLE_FILE))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps(cfg))
    spec = lora_lib.LoRASpec(rank=4, base_bits=4)
    model = hf.load_pretrained(folder, dtype=torch.bfloat16, quantize4=lambda m: lora_lib.quantized_names(m, spec))

    def values(key):  # the FP8 weight's values, as the test reads them
        return dequantize_blockwise(state[key], state[key + "_scale_inv"], block, dtype=torch.float32)

    lay = "model.layers.1.mlp"
    E = model.config.n_routed_experts
    gate_up = torch.stack([torch.cat([values(f"{lay}.experts.{e}.gate_proj.weight"),
                                      values(f"{lay}.experts.{e}.up_proj.weight")]) for e in range(E)])  # fmt: skip
    assert torch.equal(model.get_parameter(f"{lay}.experts.gate_up_proj"), kernels.quantize4(gate_up))
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(model.get_parameter(key), kernels.quantize4(values(key)))
