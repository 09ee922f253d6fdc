"""Errors that name the problem: `trace-rl config` / `train` check the config before the start-up
(`trace_rl.preflight`) and print one line per problem naming the key, the file and the fix, exit status 2, no
traceback: a malformed JSONL line (its file and line), a reward module that does not import, a chat template the
model's tokenizer lacks (naming the model), lr out of range (not blaming temperature), an unknown key (a suggestion,
not the 70 known keys), a missing path, a missing logger package, a nested dataset field (the level it is missing
from); TOML / YAML lists are accepted for the list keys; `trace-rl report` makes the table and plots of a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.hf_tiny import tokenizer
from trace_rl import run_report
from trace_rl.cli import main
from trace_rl.config import load_config
from trace_rl.controller import METRICS
from trace_rl.data import DatasetError, PromptDataset

DATA = Path(__file__).parents[1] / "data"
MATH = dict(data=str(DATA / "math_tiny.jsonl"), prompt_key="question", answer_key="solution.answer")


def _errors(capsys, *argv: str) -> list[str]:
    """The error lines of `trace-rl ARGV` (it must exit with status 2 and print nothing else to stderr)."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith(f"trace-rl {argv[0]}: error: ") for line in lines), lines
    return [line.split(": error: ", 1)[1] for line in lines]


def _model(tmp_path: Path) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "megatron.pt").write_bytes(b"")  # preflight checks it exists; nothing loads it
    return str(model)


def _kv(**kw) -> list[str]:
    return [f"{k}={v}" for k, v in kw.items()]


def test_a_malformed_jsonl_line_names_its_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "solution": {"answer": "2"}}\n\n{"question": "2+2?", "solution": \n')
    (line,) = _errors(capsys, "config", *_kv(**MATH | dict(data=str(bad)), model_dir=_model(tmp_path)))
    assert line.startswith(f"data: {bad}:3: not valid JSON (Expecting value at column ")
    assert line.endswith("each line of a .jsonl dataset must be one JSON object")


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("nosuchmodule:fn", "reward='nosuchmodule:fn': no module named 'nosuchmodule': install it, add its directory"),
        ("missing/file.py:score", "reward='missing/file.py:score': file missing/file.py does not exist"),
        ("trace_rl.rewards:nofn", "reward='trace_rl.rewards:nofn': trace_rl.rewards has no function nofn"),
    ],
)
def test_a_reward_that_does_not_load_is_one_line(tmp_path, capsys, reward, message):
    (line,) = _errors(capsys, "config", f"reward={reward}", f"model_dir={_model(tmp_path)}")
    assert line.startswith(message)


def test_a_missing_chat_template_names_the_model(tmp_path, capsys):
    tok = tokenizer()
    tok.chat_template = None
    tok.name_or_path = "models/plain"
    with pytest.raises(DatasetError, match=r"^chat_template=true but the tokenizer of model_dir=models/plain has no"):
        PromptDataset(DATA / "math_tiny.jsonl", tok, prompt_key="question", max_prompt_len=64)
    model = tmp_path / "hf"  # an HF checkpoint directory whose tokenizer files carry no template
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer_config.json").write_text("{}")
    (line,) = _errors(capsys, "config", *_kv(**MATH, model_dir=str(model)))
    assert line.startswith(f"chat_template=true but the tokenizer of model_dir='{model}' has no chat template: set")


def test_lr_out_of_range_names_lr_alone(tmp_path, capsys):
    (line,) = _errors(capsys, "config", "lr=-1")
    assert "lr=-1.0 must be > 0" in line and "temperature" not in line


def test_an_unknown_key_is_one_line_with_a_suggestion(tmp_path, capsys):
    config = tmp_path / "rl.toml"
    config.write_text("stepz = 3\n")
    (line,) = _errors(capsys, "train", "--config", str(config), "grup_size=2")
    assert line == (
        f"unknown config key 'grup_size' (an override; did you mean 'group_size'?), 'stepz' (in {config}; did you "
        "mean 'steps'?); `trace-rl train --help` lists every key"
    )


def test_missing_paths_loggers_and_nested_fields_are_named(tmp_path, capsys):
    lines = _errors(capsys, "train", "model_dir=nowhere", "data=nowhere.jsonl", "loggers=wandb")
    assert lines[0].startswith("model_dir='nowhere' does not exist: build the tiny model (`trace-rl make-model")
    assert lines[1] == "data='nowhere.jsonl' does not exist (paths are relative to the working directory)"
    assert lines[2] == "loggers='wandb': wandb is not installed: pip install -e '.[wandb]', or drop wandb from loggers"
    (line,) = _errors(capsys, "config", *_kv(**MATH | dict(answer_key="solution.answr"), model_dir=_model(tmp_path)))
    assert line == (
        f"answer_key='solution.answr': row 0 of data='{MATH['data']}' has no field 'answr' under 'solution' (its keys: "
        "['answer']); set answer_key to one of its fields (dots reach nested fields)"
    )


def test_list_keys_take_toml_and_yaml_lists(tmp_path):
    (tmp_path / "rl.toml").write_text('loggers = ["tensorboard"]\nmetadata_keys = ["id", "source"]\n')
    (tmp_path / "rl.yaml").write_text("sglang_urls: [http://a:1, http://b:2]\nrollout_backend: sglang\nmode: qat\n")
    cfg = load_config(tmp_path / "rl.toml")
    assert cfg.logger_list() == ("tensorboard",) and cfg.metadata_key_list() == ("id", "source")
    assert load_config(tmp_path / "rl.yaml").sglang_url_list() == ["http://a:1", "http://b:2"]
    (tmp_path / "bad.toml").write_text("loggers = [1]\n")
    with pytest.raises(ValueError, match=r"loggers=\[1\] must be a list of strings"):
        load_config(tmp_path / "bad.toml")


def test_report_makes_the_table_and_plots_of_a_train_and_a_demo_dir(tmp_path, capsys):
    assert run_report.METRICS == METRICS
    steps = [
        {"step": s, "mode": "trace", "reward/mean": 0.5 + s, "train_rollout_logprob_abs_diff": 0.01,
         "train_rollout_logprob_diff_max": 0.1, "train_rollout_logprob_diff_min": -0.1, "time/step_s": 1.0}
        for s in range(2)
    ]  # fmt: skip
    run = tmp_path / "demo" / "trace"
    run.mkdir(parents=True)
    (run / METRICS).write_text("".join(json.dumps(m) + "\n" for m in steps))
    shutil.copytree(run, tmp_path / "demo" / "bf16")
    main(["report", str(run)])
    table = json.loads((run / "summary.json").read_text())
    assert list(table) == ["trace"] and table["trace"]["reward (first step)"] == 0.5
    assert table["trace"]["reward (last half)"] == 1.5
    assert (run / "mismatch_reward.png").stat().st_size > 0 and (run / "metrics.csv").exists()
    main(["report", str(tmp_path / "demo"), str(tmp_path / "out")])
    assert list(json.loads((tmp_path / "out" / "summary.json").read_text())) == ["bf16", "trace"]
    capsys.readouterr()
    (line,) = _errors(capsys, "report", str(tmp_path))
    assert line.startswith(f"{tmp_path} holds no metrics.jsonl (nor <mode>/metrics.jsonl, nor warmup.json)")


def test_report_help_works(capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trace-rl report [-h] run_dir [out]") and "a `trace-rl demo` directory" in out


def test_report_of_a_results_raw_dir_writes_its_tables(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    warmup = dict(preset="tiny", parameters=2.5e6, digits=1, steps=60, teacher_forced_accuracy=0.61)
    (raw / "warmup.json").write_text(json.dumps(warmup))
    main(["report", str(raw)])
    tables = (tmp_path / "docs" / "tables.md").read_text()
    assert tables.startswith("Model: preset `tiny`, 2.5 M parameters, 1-digit addition, 60 warm-up steps")
