"""Fault injection, config (docs/reliability.md items 3 and 8): syntax errors name file and line, `.yaml` is YAML,
unknown suffixes and non-finite or literal-secret values (on every backend) are refused, so are values that would
fail later; every key is decided for resume."""

from __future__ import annotations

import dataclasses

import pytest

from trace_rl.config import ConfigError, RLConfig, load_config

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("rl.json", '{\n  "steps": 3,\n  "lr": 1e-4,,\n}\n', r"rl\.json:3:14: JSON syntax error"),
        ("rl.toml", 'steps = 3\nmode = "qat\nlr = 1\n', r"rl\.toml: TOML syntax error: .*line 2"),
        ("rl.yaml", "steps: 3\nmode: [qat\nlr: 1\n", r"rl\.yaml:3:\d+: YAML syntax error"),
    ],
)
def test_syntax_errors_name_file_and_line(tmp_path, name, text, where):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=where):
        load_config(tmp_path / name)


def test_yaml_is_parsed_as_yaml_and_other_suffixes_refused(tmp_path):
    (tmp_path / "rl.yaml").write_text("# a run\nmode: qat\nsteps: 7\nlr: 0.5\nrecord_all_layers: true\n")
    cfg = load_config(tmp_path / "rl.yaml")
    assert (cfg.mode, cfg.steps, cfg.lr, cfg.record_all_layers) == ("qat", 7, 0.5, True)
    (tmp_path / "rl.yml").write_text("- steps\n")
    with pytest.raises(ConfigError, match="must hold a table"):
        load_config(tmp_path / "rl.yml")
    (tmp_path / "rl.ini").write_text("steps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown suffix '\.ini'"):
        load_config(tmp_path / "rl.ini")


@pytest.mark.parametrize("key", ["lr", "temperature", "sglang_timeout_s", "rollout_call_timeout_s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value} must be finite"):
        load_config(None, [f"{key}={value}"])


def test_api_keys_are_references_never_values():
    urls = dict(rollout_backend="sglang", sglang_urls="http://a:1,http://b:2")
    RLConfig(**urls, sglang_api_key="env:TRACE_KEY", sglang_admin_api_key="file:/run/secrets/admin")
    with pytest.raises(ConfigError, match="sglang_api_key must name where the key is"):
        RLConfig(**urls, sglang_api_key="sk-123")
    with pytest.raises(ConfigError, match="rollout_call_timeout_s=10.0 must be > 0 and at most"):
        RLConfig(rollout_call_timeout_s=10.0, rollout_step_timeout_s=5.0)


def test_a_literal_key_is_refused_on_every_backend():
    for backend in ({}, dict(rollout_backend="sglang", sglang_urls="http://a:1")):
        for key in ("sglang_api_key", "sglang_admin_api_key"):
            with pytest.raises(ConfigError, match=f"{key} must name where the key is"):
                RLConfig(**backend, **{key: "sk-live-0123"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("temperature=1e-300", r"temperature=1e-300 must be >= 0.001"),
        ("seed=1180591620717411303424", r"seed=1180591620717411303424 must be in \[0, 2\*\*32\)"),
        ("seed=-1", r"seed=-1 must be in \[0, 2\*\*32\)"),
        ("prompts_per_step=10000000", r"prompts_per_step \* group_size = 80000000 trajectories a step exceed 65536"),
        ("weight_sync_timeout_s=0", r"weight_sync_timeout_s=0.0 must be > 0"),
        ("sglang_start_timeout_s=-1", r"sglang_start_timeout_s=-1.0 must be > 0"),
    ],
)
def test_values_that_would_fail_later_are_refused_by_name(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_every_config_key_is_decided_for_resume():
    from trace_rl.controller import RESUME_FREE, RESUME_KEYS

    keys = {f.name for f in dataclasses.fields(RLConfig)}
    assert RESUME_FREE <= keys, RESUME_FREE - keys  # no stale name
    assert set(RESUME_KEYS) == keys - RESUME_FREE
    # What the issue found accepted on resume: data shaping, pairing, reward, numerics.
    for key in ("shuffle", "system_prompt", "reward", "trainer_experts", "train_micro_batch", "prompt_key", "device"):
        assert key in RESUME_KEYS, key
