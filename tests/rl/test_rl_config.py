"""RL config: defaults, file and command-line overrides, and clear errors for bad values; a missing model."""

from __future__ import annotations

import json

import pytest

from megatron_trace.config import TraceConfig
from trace_core.numerics.recipe import recipe_names
from trace_rl.config import ConfigError, RLConfig, load_config
from trace_rl.controller import Controller
from trace_rl.launch import main


def test_file_then_overrides(tmp_path):
    (tmp_path / "rl.toml").write_text('mode = "qat"\nsteps = 7\nlr = 1\n')
    cfg = load_config(tmp_path / "rl.toml", ["steps=9", "record_all_layers=true", "temperature=0.5"])
    assert (cfg.mode, cfg.steps, cfg.lr, cfg.record_all_layers, cfg.temperature) == ("qat", 9, 1.0, True, 0.5)
    (tmp_path / "rl.json").write_text(json.dumps({"group_size": 4}))
    assert load_config(tmp_path / "rl.json").group_size == 4
    assert load_config() == RLConfig() and RLConfig().max_version_diff == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mode=fp8"], "mode='fp8' is not one of"),
        (["group_size=1"], "group_size=1 must be >= 2"),
        (["stepz=3"], r"unknown config key .stepz. \(an override; did you mean .steps.\?\)"),
        (["steps=three"], "steps='three' is not a int"),
        (["record_all_layers=maybe"], "is not a boolean"),
        (["record_bits=5"], r"record_bits=5: record bits must be an integer in 1\.\.4"),
        (["async_lag=4"], "async_lag=4 exceeds max_version_diff=3"),
        (["steps"], "must be key=value"),
        (["fp4_attention=on"], r"fp4_attention='on' is not one of \('off', 'decode'\)$"),
        (["fp4_attention=extend"], "there is no cached prefix for an extend kernel to read"),
        (["fp4_attention=decode", "mode=bf16"], "needs an FP4 rollout .mode qat or trace.: mode='bf16' is the BF16"),
        (
            ["fp4_attention=decode", "rollout_backend=sglang", "sglang_urls=http://a:1,http://b:2", "mode=qat"],
            "needs rollout_backend='embedded'; an SGLang server selects .*TRACE_FP4_ATTENTION=decode",
        ),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("mode", ["bf16", "qat", "trace", "fp8", "TRACE"])
def test_the_rl_config_and_the_trainer_accept_the_same_modes(mode):
    """Mode names have one definition (`trace_core.modes`): what the RL config accepts, the trainer accepts."""
    try:
        rl_mode = load_config(None, [f"mode={mode}"]).mode
    except ConfigError as e:
        assert "is not one of ('bf16', 'qat', 'trace')" in str(e)
        with pytest.raises(ValueError, match=f"unknown mode '{mode}'"):
            TraceConfig(mode=mode)
    else:
        assert TraceConfig(mode=rl_mode).mode.value == mode


def test_missing_config_file_and_model(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(FileNotFoundError, match="no tiny model"):
        Controller(RLConfig(model_dir=str(tmp_path), out_dir=str(tmp_path / "out")))


def test_fp4_attention_serves_every_recipe():
    """Every recipe's K/V fit the FP4 pool the decode attention reads: kv_fp4, or NVFP4 under its static unit scale
    (`nvfp4-w4a4-nvfp4kv`; tests/rl/test_fp4_kv_engine.py runs it)."""
    for name in recipe_names():
        cfg = load_config(None, ["fp4_attention=decode", f"recipe={name}"])
        assert (cfg.fp4_attention, cfg.recipe) == ("decode", name)


def test_launcher_refuses_fp4_attention_with_the_bf16_arm(tmp_path):
    with pytest.raises(ConfigError, match=r"--modes 'bf16,trace': fp4_attention='decode' is for the FP4 modes"):
        main(["--modes", "bf16,trace", f"model_dir={tmp_path}", "fp4_attention=decode"])
    assert not any(tmp_path.iterdir())  # refused before building a model
