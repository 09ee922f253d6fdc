"""The `trace-rl` CLI: `[project.scripts]` targets exist, `--help` documents every config key, the example configs
load and validate, `config` and `inspect` print what they say."""

from __future__ import annotations

import dataclasses
import importlib
import json
import tomllib
from pathlib import Path

import pytest

from tests.hf_tiny import make_hf_checkpoint
from trace_rl.cli import FIELD_HELP, main, parser
from trace_rl.config import RLConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_project_scripts_resolve():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"trace-rl", "trace-sglang-patches"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_trace_sglang_patches_runs_the_patch_script(capsys):
    from trace_rl.cli import sglang_patches

    with pytest.raises(SystemExit) as exit_:
        sglang_patches(["--help"])
    assert exit_.value.code == 0
    assert "apply" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "demo", "config"])
def test_help_documents_every_config_key(command, capsys):
    assert set(FIELD_HELP) == {f.name for f in dataclasses.fields(RLConfig)}
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(RLConfig):
        assert f"  {f.name} = {f.default!r}\n      {FIELD_HELP[f.name]}" in text


def test_every_subcommand_option_has_help():
    for name, sub in parser()._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if name not in ("results", "report") and action.dest != "help":
                assert action.help, f"trace-rl {name}: {action.dest} has no help"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_validate(path):
    cfg = load_config(path)
    assert cfg.out_dir


def test_config_prints_the_resolved_values(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the checkout
    model = make_hf_checkpoint(tmp_path / "hf")  # `config` checks the model exists and its tokenizer's chat template
    main(["config", "--config", str(ROOT / "configs" / "byo-math-cpu.toml"), "steps=7", f"model_dir={model}"])
    values = tomllib.loads(capsys.readouterr().out)
    assert values["steps"] == 7 and values["answer_key"] == "solution.answer" and values["model_dir"] == str(model)


def test_inspect_prints_the_imported_dims(tmp_path, capsys):
    main(["inspect", str(make_hf_checkpoint(tmp_path))])
    out = capsys.readouterr().out
    dims = json.loads(out[: out.rindex("}") + 1])
    assert (dims["layers"], dims["experts"], dims["topk"]) == (2, 4, 2)
