"""Fault injection, config (docs/reliability.md items 3 and 8): syntax errors name file and line, `.yaml` is YAML,
unknown suffixes and non-finite or literal-secret values are refused."""

from __future__ import annotations

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
