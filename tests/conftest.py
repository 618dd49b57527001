"""Shared fixtures (the plain helpers are in helpers.py), and the `cuda` marker's skip without a GPU.

The corpora are module-scoped, as they were when each test module defined its own: a module that damages its copy
(a truncated shard, a malformed manifest) never reaches another module's tests.
"""

import json
import os
import random
import shutil
from pathlib import Path

import pytest

# CPU CI has 2 cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing is a setup error reported elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# the Triton interpreter's workers, longest first (seconds on the 2-core CI machine, stop 48)
INTERPRETER_WORKERS = ["test_moe_triton.py", "test_attention_triton.py", "test_quant4.py", "test_fp8.py",
                       "test_fused_kernels.py", "test_decode_kernel.py", "test_fused_router_merge.py",
                       "test_fused_adamw.py", "test_decode_launches.py"]  # fmt: skip


def pytest_collection_finish(session):
    """Start the interpreter workers of the modules this session runs in a background thread (`interpreter.prefetch`):
    each is one single-threaded child of ~0.5-2 min that would otherwise leave the second core idle."""
    import interpreter

    wanted = {Path(item.fspath).name: str(item.fspath) for item in session.items
              if "interp_results" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("skip")}
    interpreter.prefetch([wanted[name] for name in INTERPRETER_WORKERS if name in wanted])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A prepared corpus of 400 generated documents with a 512-token BPE (the training tests' `tiny_cfg` data)."""
    from helpers import WORDS

    from anyseek.data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    lines = []
    for i in range(400):
        n = rng.randint(3, 12)
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "."
                     for _ in range(n)]
        lines.append(json.dumps({"text": f"Document {i}. " + " ".join(sentences)}))
    src = root / "docs.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = root / "prepared"
    prepare(source=str(src), out=out, vocab_size=512, val_fraction=0.05, progress=False)
    return out


@pytest.fixture(scope="module")
def base_data(tmp_path_factory) -> Path:
    """A prepared corpus of 200 generated documents with a 400-token BPE: the data of the runs from `base_dir`."""
    from helpers import write_docs

    from anyseek.data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    prepare(source=str(write_docs(root, 200, 0)), out=root / "prepared", vocab_size=400, val_fraction=0.05,
            progress=False)
    return root / "prepared"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, base_data) -> Path:
    """A random tiny model (MTP included, routing biases non-zero) saved with `base_data`'s tokenizer."""
    import torch
    from helpers import base_model_cfg, vocab_of

    from anyseek import hf
    from anyseek.model.transformer import DeepSeekV3

    folder = tmp_path_factory.mktemp("base") / "model"
    torch.manual_seed(3)
    model = DeepSeekV3(base_model_cfg(vocab_of(base_data)))
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.05)
    hf.save_pretrained(model, folder)
    for f in (base_data / "tokenizer").iterdir():
        shutil.copy2(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A finished 4-step `tiny` run with checkpoints at steps 2 and 4 (copy it before changing it: `copy_run`)."""
    from helpers import run, tiny_cfg

    out = tmp_path_factory.mktemp("trained") / "run"
    run(tiny_cfg(data_dir, "--train.max_steps=4", "--train.save_every=2"), out)
    return out
