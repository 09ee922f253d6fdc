"""What `trace-rl config` and `trace-rl train` check before the start-up (model load, engines, trainer), so that a
mistake in the config is one line naming the key, the file and the fix instead of a traceback after it: the paths
exist, the reward spec imports, the configured loggers are installed (else which extra to install), every row of a
file dataset parses and has the mapped fields (a nested key names the level it is missing from), and the model's
tokenizer has a chat template when `chat_template` asks for one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from trace_rl.data import DatasetError, field_problem, read_rows
from trace_rl.rewards import load_reward

LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install -e '.[wandb]'"),
}


def preflight(cfg: Any) -> list[str]:
    """Every problem found in the `RLConfig` `cfg`, one message each (empty when the run can start)."""
    errors = _model_errors(cfg)
    for key in ("data", "eval_data"):
        errors += _dataset_errors(cfg, key)
    try:
        load_reward(cfg.reward)
    except ValueError as e:
        errors.append(str(e))
    for name in cfg.logger_list():
        module, install = LOGGER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            errors.append(f"loggers={cfg.loggers!r}: {module} is not installed: {install}, or drop {name} from loggers")
    return errors


def _model_errors(cfg: Any) -> list[str]:
    model = Path(cfg.model_dir)
    if not model.is_dir():
        return [
            f"model_dir={cfg.model_dir!r} does not exist: build the tiny model (`trace-rl make-model --out "
            f"{cfg.model_dir}`) or point it at an HF Qwen3-MoE checkpoint directory"
        ]
    if not (model / "megatron.pt").exists() and not (model / "config.json").exists():
        return [f"model_dir={cfg.model_dir!r} holds neither megatron.pt (the tiny model) nor config.json (HF)"]
    if (model / "config.json").exists() and cfg.chat_template and cfg.data != "addition" and not _has_template(model):
        return [
            f"chat_template=true but the tokenizer of model_dir={cfg.model_dir!r} has no chat template: set "
            "chat_template=false (prompts are then tokenized as plain text) or use a model whose tokenizer has one"
        ]
    return []


def _has_template(model: Path) -> bool:
    """Whether an HF checkpoint's tokenizer files carry a chat template (`tokenizer_config.json` or a .jinja)."""
    if (model / "chat_template.jinja").exists() or (model / "chat_template.json").exists():
        return True
    config = model / "tokenizer_config.json"
    return config.exists() and bool(json.loads(config.read_text()).get("chat_template"))


def _dataset_errors(cfg: Any, key: str) -> list[str]:
    spec = getattr(cfg, key)
    if not spec or spec == "addition":
        return []
    if not Path(spec).exists():
        return [f"{key}={spec!r} does not exist (paths are relative to the working directory)"]
    try:
        rows = read_rows(spec)
    except DatasetError as e:
        return [f"{key}: {e}"]
    if not rows:
        return [f"{key}={spec!r} holds no rows"]
    fields = [("prompt_key", cfg.prompt_key)] + [("answer_key", cfg.answer_key)] * bool(cfg.answer_key)
    fields += [("metadata_keys", k) for k in cfg.metadata_key_list()]
    for i, row in enumerate(rows):
        for name, field in fields:
            problem = field_problem(row, field)
            if problem is not None:
                return [
                    f"{name}={field!r}: row {i} of {key}={spec!r} has {problem}; set {name} to one of its fields "
                    "(dots reach nested fields)"
                ]
    return []
