"""Checkpoint I/O without the model: name mapping, sharding, FP8 blocks, and the errors for bad folders.

A stand-in module with our state_dict names (experts stacked, MTP under `mtp.`) is enough to exercise the whole
save -> folder -> load path; test_hf_roundtrip.py does the same with the real model and transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from anyseek.hf import pretrained as hf
from anyseek.hf import safetensors_io as hf_io
from anyseek.hf.fp8 import dequantize_blockwise, quantize_blockwise, scale_shape
from anyseek.model.config import ModelConfig
from anyseek.storage import CheckpointError

N_LAYERS, E, D, INTER, V = 2, 4, 16, 8, 32

SHAPES = {
    "model.embed_tokens.weight": (V, D),
    "model.layers.0.input_layernorm.weight": (D,),
    "model.layers.0.mlp.gate_proj.weight": (2 * D, D),
    "model.layers.1.mlp.gate.weight": (E, D),
    "model.layers.1.mlp.gate.e_score_correction_bias": (E,),
    "model.layers.1.mlp.experts.gate_up_proj": (E, 2 * INTER, D),
    "model.layers.1.mlp.experts.down_proj": (E, D, INTER),
    "mtp.0.eh_proj.weight": (D, 2 * D),
    "mtp.0.mlp.experts.gate_up_proj": (E, 2 * INTER, D),
    "mtp.0.mlp.experts.down_proj": (E, D, INTER),
    "model.norm.weight": (D,),
    "lm_head.weight": (V, D),
}


def fake_config() -> ModelConfig:
    """A valid config with the fake model's layer counts (its config.json is written, never built)."""
    return ModelConfig.from_name("tiny", num_hidden_layers=N_LAYERS, num_nextn_predict_layers=1,
                                 extra={"bos_token_id": 0, "eos_token_id": 1})


def fake_model(shapes: dict = SHAPES, seed: int = 0) -> nn.Module:
    """A module whose state_dict has exactly `shapes` (buffers for the routing bias, like the real model)."""
    g = torch.Generator().manual_seed(seed)
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        t = torch.randn(shape, generator=g)
        if leaf == "e_score_correction_bias":
            mod.register_buffer(leaf, t)
        else:
            mod.register_parameter(leaf, nn.Parameter(t))
    root.config = fake_config()
    return root


def load(folder: Path, shapes: dict = SHAPES, strict: bool = True, dtype=torch.float32) -> nn.Module:
    with torch.device("meta"):
        model = fake_model(shapes, seed=1)
    ckpt = hf_io.scan_folder(folder)
    hf.load_into(model, ckpt, N_LAYERS, 1, dtype, strict=strict, folder=folder)
    return model


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_save_writes_official_layout(tmp_path):
    model = fake_model()
    hf.save_pretrained(model, tmp_path / "ckpt")
    names = set(hf_io.scan_folder(tmp_path / "ckpt"))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in names
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in names  # MTP module 0 is layer N + 0
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.embed_tokens.weight"} <= names
    assert "model.layers.2.shared_head.head.weight" in names
    assert not any(n.startswith("mtp.") or n.endswith("gate_up_proj") for n in names)
    gen = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1
    assert not list(tmp_path.glob("ckpt.tmp-*"))


def test_round_trip_single_file_and_shards(tmp_path):
    model = fake_model()
    hf.save_pretrained(model, tmp_path / "one")
    assert_same_state(model, load(tmp_path / "one"))
    hf.save_pretrained(model, tmp_path / "many", max_shard_size=2000)
    index = json.loads((tmp_path / "many" / hf_io.INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and all((tmp_path / "many" / s).is_file() for s in shards)
    assert not (tmp_path / "many" / hf_io.SINGLE_FILE).exists()
    assert_same_state(model, load(tmp_path / "many"))


def test_save_replaces_existing_folder_atomically_and_keeps_tokenizer(tmp_path):
    out = tmp_path / "ckpt"
    hf.save_pretrained(fake_model(seed=0), out, max_shard_size=2000)
    (out / "tokenizer.json").write_text("{}")
    model = fake_model(seed=5)
    hf.save_pretrained(model, out)  # single file now: the old shards must be gone
    assert not (out / hf_io.INDEX_FILE).exists() and (out / "tokenizer.json").is_file()
    assert_same_state(model, load(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_fused_expert_layout_loads(tmp_path):
    """transformers v5 with save_original_format=False writes mlp.experts.gate_up_proj / down_proj as they are."""
    from safetensors.torch import save_file

    model = fake_model()
    state = {hf.to_hf(k, N_LAYERS): v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "f").mkdir()
    save_file(state, str(tmp_path / "f" / hf_io.SINGLE_FILE))
    assert_same_state(model, load(tmp_path / "f"))


def test_mismatches_are_listed_by_name(tmp_path):
    from safetensors.torch import save_file

    hf.save_pretrained(fake_model(), tmp_path / "c")
    file = tmp_path / "c" / hf_io.SINGLE_FILE
    ckpt = hf_io.TensorReader()
    infos = hf_io.scan_folder(tmp_path / "c")
    state = {n: ckpt.get(i) for n, i in infos.items()}
    ckpt.close()
    del state["model.norm.weight"], state["model.layers.1.mlp.experts.2.up_proj.weight"]
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(2 * D, D + 1)
    state["model.layers.1.mlp.experts.1.down_proj.weight"] = torch.zeros(D, INTER - 1)
    state["model.layers.0.self_attn.bogus.weight"] = torch.zeros(3)
    state["model.layers.5.mlp.gate.weight"] = torch.zeros(3)
    save_file(state, str(file))
    with pytest.raises(CheckpointError) as err:
        load(tmp_path / "c")
    msg = str(err.value)
    assert str(tmp_path / "c") in msg and "model.safetensors" in msg
    assert "missing (2)" in msg and "model.norm.weight" in msg and "model.layers.1.mlp.experts.2.up_proj.weight" in msg
    assert "unexpected (2)" in msg and "model.layers.0.self_attn.bogus.weight" in msg
    assert "model.layers.5.mlp.gate.weight" in msg
    assert "mis-shaped (2)" in msg
    assert (
        f"model.layers.0.mlp.gate_proj.weight (model.safetensors): expected [{2 * D}, {D}], found [{2 * D}, {D + 1}]"
        in msg
    )
    assert "model.layers.1.mlp.experts.1.down_proj.weight" in msg
    # strict=False: missing/unexpected are tolerated (with a warning), a wrong shape never is
    del state["model.layers.0.mlp.gate_proj.weight"], state["model.layers.1.mlp.experts.1.down_proj.weight"]
    save_file(state, str(file))
    with pytest.warns(UserWarning, match="model.norm.weight"):
        hf.load_into(fake_model(), hf_io.scan_folder(tmp_path / "c"), N_LAYERS, 1, torch.float32, strict=False)


def test_fp8_blockwise_ragged_round_trip():
    w = torch.randn(300, 200) * torch.linspace(0.01, 3, 200)
    q, s = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) == scale_shape((300, 200))
    back = dequantize_blockwise(q, s, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each block's values, plus denormals near zero
    assert (
        (back - w).abs() <= w.abs() / 16 + s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200] * 2**-9
    ).all()
    with pytest.raises(ValueError, match=r"expected \(3, 2\)"):
        dequantize_blockwise(q, s[:, :1])


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    """Official release layout: *.weight in float8_e4m3fn + *.weight_scale_inv, 2-D weights only, small blocks
    here so that the tiny shapes have ragged edges."""
    from safetensors.torch import save_file

    block = (8, 6)
    model = fake_model()
    hf.save_pretrained(model, tmp_path / "q")
    infos = hf_io.scan_folder(tmp_path / "q")
    reader = hf_io.TensorReader()
    state, quantized = {}, []
    for name, info in infos.items():
        t = reader.get(info)
        if t.dim() == 2 and "embed" not in name and "head" not in name and ".gate." not in name:
            state[name], state[name + "_scale_inv"] = quantize_blockwise(t, block)
            quantized.append(name)
        else:
            state[name] = t
    reader.close()
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in quantized  # [8, 16]: 1 x 3 blocks
    assert "mtp.0.eh_proj.weight" not in quantized and "model.layers.2.eh_proj.weight" in quantized  # [16, 32]
    save_file(state, str(tmp_path / "q" / hf_io.SINGLE_FILE))
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block), "fmt": "e4m3"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    assert hf._fp8_block(dict(cfg), Path("config.json")) == block
    with torch.device("meta"):
        loaded = fake_model(seed=1)
    hf.load_into(loaded, hf_io.scan_folder(tmp_path / "q"), N_LAYERS, 1, torch.bfloat16, block=block)
    ref, got = model.state_dict(), loaded.state_dict()
    for name in ref:
        want_dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert got[name].dtype == want_dtype, name
        err = (got[name].float() - ref[name]).abs().max().item()
        assert err <= 0.07 * ref[name].abs().max().item() + 1e-6, (name, err)
    # a scale grid of the wrong shape is named
    state["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, str(tmp_path / "q" / hf_io.SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_scale_inv \(model\.safetensors\): expected \(4, 3\)"):
        hf.load_into(fake_model(), hf_io.scan_folder(tmp_path / "q"), N_LAYERS, 1, torch.float32, block=block)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickles.*safetensors"):
        hf_io.scan_folder(tmp_path)
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        hf.load_pretrained(tmp_path)


def test_truncated_and_corrupt_files_are_named(tmp_path):
    hf.save_pretrained(fake_model(), tmp_path / "t")
    file = tmp_path / "t" / hf_io.SINGLE_FILE
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{file}: truncated safetensors file"):
        hf_io.scan_folder(tmp_path / "t")
    file.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=rf"{file}: corrupt safetensors header"):
        hf_io.scan_folder(tmp_path / "t")
    file.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(CheckpointError, match=rf"{file}: corrupt safetensors header \(invalid JSON"):
        hf_io.scan_folder(tmp_path / "t")


def test_index_pointing_to_missing_shard(tmp_path):
    hf.save_pretrained(fake_model(), tmp_path / "s", max_shard_size=2000)
    index = json.loads((tmp_path / "s" / hf_io.INDEX_FILE).read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "s" / gone).unlink()
    with pytest.raises(CheckpointError, match=rf"{hf_io.INDEX_FILE}: lists shard '{gone}'.*does not exist"):
        hf_io.scan_folder(tmp_path / "s")


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        hf.load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 8,\n  oops\n}')
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON at line 3"):
        hf.load_pretrained(tmp_path)


def test_parse_size():
    assert hf_io.parse_size("5GB") == 5 * 10**9
    assert hf_io.parse_size("500MiB") == 500 * 2**20
    assert hf_io.parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        hf_io.parse_size("lots")
    assert math.isclose(hf_io.parse_size("1.5kb"), 1500)
