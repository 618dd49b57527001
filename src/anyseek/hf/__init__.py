"""Hugging Face interop, all of it: config.json <-> ModelConfig, safetensors folders in and out, FP8 dequant.

    model = anyseek.load_pretrained("path/to/DeepSeek-V3-folder", dtype=torch.bfloat16, device="cuda")
    anyseek.save_pretrained(model, "out/folder", dtype=torch.bfloat16, max_shard_size="5GB")

config.py       config.json <-> ModelConfig (unknown keys are errors; V2 leftovers in V3 configs are ignored;
                softmax-routed models are model_type deepseek_v2, transformers' DeepseekV2)
names.py        our state-dict names <-> the checkpoint's (per-expert tensors, MTP at model.layers.{N+k})
fp8.py          the official block-wise FP8 weights, dequantized on load
safetensors_io  headers, tensor reads, sharded writes (never unpickles)
pretrained.py   load_pretrained / save_pretrained / write_model_files

The model package never imports this one: checkpoints are applied to a model from outside.
"""

from __future__ import annotations

from anyseek.hf.config import config_from_hf, config_to_hf, read_config_json, write_config_json
from anyseek.hf.pretrained import config_dtype, load_into, load_pretrained, save_pretrained, write_model_files
from anyseek.storage import CheckpointError

__all__ = [
    "CheckpointError",
    "config_dtype",
    "config_from_hf",
    "config_to_hf",
    "load_into",
    "load_pretrained",
    "read_config_json",
    "save_pretrained",
    "write_config_json",
    "write_model_files",
]
