"""anyseek: DeepSeek-V3-style models (MLA, DeepSeekMoE, MTP) on any machine.

Importing the package pulls in neither Triton nor transformers; kernels load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["DeepSeekV3", "ModelConfig", "__version__", "generate", "load_pretrained", "save_pretrained"]


def __getattr__(name: str):
    # Lazy so that `anyseek --help` and the data tools start fast and never import the model stack.
    if name == "DeepSeekV3":
        from anyseek.model.transformer import DeepSeekV3

        return DeepSeekV3
    if name == "ModelConfig":
        from anyseek.model.config import ModelConfig

        return ModelConfig
    if name in ("load_pretrained", "save_pretrained"):
        from anyseek import hf

        return getattr(hf, name)
    if name == "generate":
        from anyseek.infer.generate import generate

        return generate
    raise AttributeError(f"module 'anyseek' has no attribute {name!r}")
