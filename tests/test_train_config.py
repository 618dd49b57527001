"""Run config: presets, TOML files, dotted overrides, and errors that name the key."""

import json

import pytest

from anyseek.train.config import ConfigError, from_dict, load_run_config
from anyseek.train.optim import lr_at


def test_preset_and_overrides():
    cfg = load_run_config("tiny", ["--train.max_steps=200", "--train.lr=3e-4", "--data.tokens_per_batch=2048",
                                   "--train.schedule=wsd", "--train.compile=true", "--data.path=/x y"])
    assert cfg.train.max_steps == 200 and cfg.train.lr == 3e-4 and cfg.data.tokens_per_batch == 2048
    assert cfg.train.schedule == "wsd" and cfg.train.compile is True and cfg.data.path == "/x y"
    assert cfg.model.flavor == "tiny"
    assert json.loads(json.dumps(cfg.to_dict()))["train"]["max_steps"] == 200  # JSON-able


def test_int_field_accepts_integral_float_and_float_accepts_int():
    cfg = load_run_config("tiny", ["--train.max_steps=1e3", "--train.lr=1"])
    assert cfg.train.max_steps == 1000 and isinstance(cfg.train.lr, float)


def test_toml_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\nflavor = "tiny"\nnum_hidden_layers = 2\n[train]\nmax_steps = 7\n[data]\nmax_seqlen = 128\n')
    cfg = load_run_config(str(f), ["--train.max_steps=9"])
    assert cfg.train.max_steps == 9 and cfg.data.max_seqlen == 128 and cfg.model.overrides["num_hidden_layers"] == 2


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.max_stpes=5", "unknown key train.max_stpes; valid keys: max_steps"),
        ("--train.max_steps=abc", "train.max_steps must be int, got 'abc'"),
        ("--train.lr=true", "train.lr must be float"),
        ("--train.max_steps=-1", "train.max_steps must be positive"),
        ("--optim.lr=1", "unknown section(s) ['optim']"),
        ("--train.schedule=linear", "train.schedule must be 'cosine' or 'wsd'"),
        ("train_steps=5", "must look like --section.key=value"),
        ("--data.max_seqlen=99999", "data.max_seqlen (99999) must not exceed data.tokens_per_batch"),
    ],
)
def test_errors_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_run_config("tiny", [override])
    assert needle in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 1\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_run_config(str(bad))


def test_schedules():
    cfg = load_run_config("tiny", ["--train.max_steps=100", "--train.warmup_steps=10", "--train.lr=1.0",
                                   "--train.min_lr_ratio=0.1"]).train
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # cosine decays monotonically
    cfg.schedule, cfg.decay_fraction = "wsd", 0.2
    assert lr_at(50, cfg) == 1.0 and lr_at(81, cfg) == 1.0 and lr_at(90, cfg) < 1.0 and lr_at(100, cfg) == pytest.approx(0.1)


def test_tune_cpu_allocator_is_idempotent_and_says_what_it_did():
    import sys

    from anyseek.runtime import tune_cpu_allocator

    first = tune_cpu_allocator()
    assert tune_cpu_allocator() == first
    if sys.platform.startswith("linux"):
        assert "glibc malloc" in first or "left as is" in first


def test_named_config_and_its_toml_are_one_definition():
    from anyseek.train.config import named_configs

    names = named_configs()
    assert {"tiny", "small"} <= set(names)
    for name, path in names.items():
        assert load_run_config(name).to_dict() == load_run_config(str(path)).to_dict()
    small = load_run_config("small")
    assert small.data.vocab_size == 32000 and small.train.schedule == "wsd"  # the TOML's, not a second copy's
    assert load_run_config("tiny").to_dict() == from_dict({"model": {"flavor": "tiny"}}).to_dict()


def test_model_section_is_checked_when_loaded():
    with pytest.raises(ConfigError, match="unknown key model.hiden_size"):
        load_run_config("tiny", ["--model.hiden_size=64"])
    with pytest.raises(ConfigError, match="model.num_hidden_layers must be int"):
        load_run_config("tiny", ["--model.num_hidden_layers=two"])
    with pytest.raises(ConfigError, match=r"invalid \[model\] section"):
        load_run_config("tiny", ["--model.num_experts_per_tok=99"])
    with pytest.raises(ConfigError, match="model.flavor 'huge' is unknown"):
        from_dict({"model": {"flavor": "huge"}})


def test_print_config_shows_the_resolved_config():
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "anyseek", "train", "--config", "small", "--print-config",
                        "--train.lr=5e-4"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["model"]["flavor"] == "small" and shown["data"]["vocab_size"] == 32000
    assert shown["train"]["lr"] == 5e-4 and shown["train"]["schedule"] == "wsd"
