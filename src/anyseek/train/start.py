"""How a run begins: random weights or a pretrained folder (`--init`, train/init.py), then the run's model
transforms (`anyseek.transforms`: LoRA). The trainer calls these hooks; with neither --init nor LoRA each one is a no-op.

    start = Start(cfg, device, autocast_dtype, log)
    data_dir = start.prepare_data(cfg.data)            # --init with data.source: tokenized with the folder's tokenizer
    model_cfg = start.model_config(data_dir, manifest)  # the folder's config (None: from the [model] section)
    model = start.build_model() or DeepSeekV3(model_cfg)
    model_cfg = start.adapt(model)                      # the run's transforms (LoRA: freeze the base, ...)
    checkpoint.save(..., adapters=start.adapters)       # LoRA: adapters + lora.json instead of the full model
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from anyseek import transforms
from anyseek.checkpoint.adapters import Adapters
from anyseek.train import init as init_lib
from anyseek.train.config import RunConfig
from anyseek.train.memory import report
from anyseek.transforms.lora import quantized_names


class Start:
    def __init__(self, cfg: RunConfig, device: torch.device, autocast_dtype: torch.dtype | None,
                 log: Callable[[str], None] = print):
        t = cfg.train
        self.cfg, self.device, self.log = cfg, device, log
        self.init = init_lib.InitSource.open(t.init) if t.init else None
        self.ref = self.init.reference(log) if self.init else None  # every byte hashed (cached for large files)
        self.transforms = transforms.for_run(t, autocast_dtype)  # LoRA (anyseek.transforms)
        lora = next((x for x in self.transforms if isinstance(x, transforms.LoRA)), None)
        self.spec = lora.spec if lora is not None else None
        self.base_dtype = lora.base_dtype if lora is not None else torch.float32
        self.model_cfg = None
        # what a LoRA run's checkpoints hold in place of the model (None: the whole model)
        self.adapters = Adapters(self.spec, self.ref) if self.spec else None

    def prepare_data(self, data) -> Path:
        return init_lib.prepare_data(data, self.init)

    def model_config(self, data_dir: Path, manifest: dict):
        """The folder's ModelConfig (knob overrides applied, tokenizer checked); None without --init."""
        if self.init is None:
            return None
        init_lib.check_tokenizer(self.init, data_dir, manifest, self.log)
        self.model_cfg = init_lib.model_config(self.init, self.cfg.model)
        return self.model_cfg

    def report_memory(self, model_cfg) -> None:

        report(model_cfg, self.cfg, self.device, self.spec, self.base_dtype, self.log)

    def build_model(self):
        """The pretrained model on the device (LoRA: its matrices loaded straight into the base dtype); None
        without --init."""
        if self.init is None:
            return None
        packed = None  # a 4-bit base: LoRA's targets quantized as they are read (the full model never in memory)
        if self.spec is not None and self.spec.base_bits == 4:
            packed = functools.partial(quantized_names, spec=self.spec)
        model = init_lib.load_model(self.init, self.model_cfg, self.device, self.base_dtype, packed)
        self.log(f"init: weights from {self.init.path} (sha256 {self.ref['sha256'][:12]}); optimizer, schedule "
                 "and data start fresh")
        return model

    def adapt(self, model):
        """The run's transforms applied to the built model (LoRA: freeze the base, wrap the targets; the routing
        biases belong to the base and stay as loaded); returns its config."""
        for transform in self.transforms:
            transform.apply(model)
            self.log(transform.describe(model))
        if self.spec is not None:
            model.config = dataclasses.replace(model.config, bias_update_speed=0.0)
        return model.config

    def record(self) -> dict[str, Any]:
        """For train_state.json: where the run started from."""
        return {"init": self.ref} if self.ref else {}
