"""Prompt datasets of the RL loop: the synthetic addition task, or a JSONL / Parquet file of prompts.

A dataset serves `batch(step, n)`: the `n` prompts of RL step `step`, a pure function of (seed, step), so a resumed
run continues at exactly the sample the uninterrupted run would have used. A file dataset maps its fields by the
config (`prompt_key`, `answer_key`, `metadata_keys`; dotted keys reach nested fields, e.g. verl's
`reward_model.ground_truth`), applies the tokenizer's chat template (a prompt may be a string, the user turn, or a
list of `{role, content}` messages), drops prompts longer than `max_prompt_len` tokens (counted), and walks the
prompts epoch by epoch, each epoch in its own seeded permutation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from trace_rl.task import EOS, EQUALS, PLUS, AdditionTask


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids `[P]`, the reference answer for the reward, metadata passed to the reward function,
    and its row in the dataset file (-1 for the synthetic task)."""

    ids: torch.Tensor
    answer: str | None
    metadata: dict = field(default_factory=dict)
    row: int = -1

    @property
    def key(self) -> str:
        """The prompt's id: `<row>:<BLAKE2b-128 of its token ids, answer and metadata>`; a trajectory carries it, so
        it is trained only against the prompt it was generated from."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.ids.to(torch.int64).numpy().tobytes())
        h.update(json.dumps([self.answer, self.metadata], sort_keys=True, default=str).encode())
        return f"{self.row}:{h.hexdigest()}"


class AdditionTokenizer:
    """The addition task's vocabulary as text: digits, `+`, `=`; EOS and unused ids are special."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        chars = {PLUS: "+", EQUALS: "="} | {d: str(d) for d in range(10)}
        return "".join(chars.get(int(i), "" if skip_special_tokens and int(i) == EOS else "?") for i in ids)


class AdditionData:
    """`a+b=` prompts, answered by the sum's digits least significant first (exact-match reward)."""

    def __init__(self, digits: int, seed: int):
        self.task, self.seed = AdditionTask(digits), seed
        self.max_prompt_len = self.task.prompt_len
        self.size: int | None = None  # unbounded
        # What the prompts of every step are a function of (a trajectory carries it; see PromptDataset.digest).
        self.digest = hashlib.blake2b(f"addition digits={digits} seed={seed}".encode(), digest_size=16).hexdigest()

    def batch(self, step: int, n: int) -> list[Prompt]:
        operands = self.task.sample(n, torch.Generator().manual_seed(self.seed * 7919 + step))
        ids = self.task.prompts(operands)
        total = operands.sum(dim=1).tolist()
        width = self.task.digits + 1
        return [Prompt(ids[i], str(s).zfill(width)[::-1]) for i, s in enumerate(total)]

    def head(self, n: int) -> list[Prompt]:
        """`n` prompts (64 with `n = 0`) drawn apart from the training steps: a held-out evaluation set."""
        return self.batch(-1, n or 64)


def dataset(spec: str, cfg, policy) -> AdditionData | PromptDataset:
    """The dataset `spec` (`addition` or a file) of an `RLConfig` for a `trace_rl.policy.Policy`."""
    if spec == "addition":
        if policy.digits is None:
            raise ValueError("data='addition' needs the tiny addition model (model_dir with megatron.pt)")
        return AdditionData(policy.digits, cfg.seed)
    return PromptDataset(
        spec,
        policy.tokenizer,
        prompt_key=cfg.prompt_key,
        answer_key=cfg.answer_key,
        metadata_keys=cfg.metadata_key_list(),
        chat_template=cfg.chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_len=cfg.max_prompt_len or policy.dims.max_seq - cfg.max_new_tokens,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )


class DatasetError(ValueError):
    """A dataset file or one of its rows does not fit the config; the message names the file, the line or row, the
    config key and the fix."""


def field_problem(row: Any, key: str) -> str | None:
    """None when the dotted `key` reaches a value in `row`, else what is missing at which level, with the keys
    that level has (`no field 'answr' under 'solution' (its keys: ['answer'])`)."""
    value, path = row, []
    for part in key.split("."):
        under = f" under {'.'.join(path)!r}" if path else ""
        if not isinstance(value, dict):
            return f"{'.'.join(path)!r} is a {type(value).__name__}, not an object with field {part!r}"
        if part not in value:
            return f"no field {part!r}{under} (its keys: {sorted(value)})"
        value, path = value[part], [*path, part]
    return None


def _field(row: dict, key: str) -> Any:
    problem = field_problem(row, key)
    if problem is not None:
        raise KeyError(problem)
    value: Any = row
    for part in key.split("."):
        value = value[part]
    return value


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a `.jsonl` (one JSON object a line) or `.parquet` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(
                        f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
                        "dataset must be one JSON object"
                    ) from None
                if not isinstance(row, dict):
                    raise DatasetError(f"{path}:{number}: a {type(row).__name__}, not a JSON object of fields")
                rows.append(row)
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"dataset {path}: use a .jsonl or .parquet file")


class PromptDataset:
    """Prompts of a JSONL / Parquet file, tokenized (chat template applied), filtered by length."""

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        metadata_keys: tuple[str, ...] = (),
        chat_template: bool = True,
        system_prompt: str = "",
        max_prompt_len: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if chat_template and not getattr(tokenizer, "chat_template", None):
            model = getattr(tokenizer, "name_or_path", "") or "the model"
            raise DatasetError(
                f"chat_template=true but the tokenizer of model_dir={model} has no chat template: set "
                "chat_template=false (prompts are then tokenized as plain text) or use a model whose tokenizer has one"
            )
        self.path, self.seed, self.shuffle = Path(path), seed, shuffle
        rows = read_rows(path)
        self.prompts: list[Prompt] = []
        self.filtered = 0
        for i, row in enumerate(tqdm(rows, desc=f"tokenize {self.path.name}", unit="prompt", disable=len(rows) < 1000)):
            keys = [("prompt_key", prompt_key)] + [("answer_key", answer_key)] * bool(answer_key)
            for name, key in keys + [("metadata_keys", k) for k in metadata_keys]:
                problem = field_problem(row, key)
                if problem is not None:
                    raise DatasetError(
                        f"{name}={key!r}: row {i} of {path} has {problem}; set {name} to one of its fields (dots "
                        "reach nested fields)"
                    )
            prompt = _field(row, prompt_key)
            answer = None if not answer_key else _field(row, answer_key)
            metadata = {k: _field(row, k) for k in metadata_keys}
            ids = self._encode(tokenizer, prompt, chat_template, system_prompt)
            if len(ids) > max_prompt_len:
                self.filtered += 1
                continue
            self.prompts.append(Prompt(torch.tensor(ids), None if answer is None else str(answer), metadata, i))
        if not self.prompts:
            raise ValueError(f"dataset {path}: no prompt of at most {max_prompt_len} tokens ({len(rows)} rows)")
        self.size = len(self.prompts)
        self.max_prompt_len = max(len(p.ids) for p in self.prompts)
        # The dataset as served: its prompts (ids, answers, metadata, in file order) and their order per epoch. A
        # trajectory carries it, so one generated from another dataset or order is never trained as this one's.
        h = hashlib.blake2b(f"shuffle={shuffle} seed={seed}".encode(), digest_size=16)
        for p in self.prompts:
            h.update(p.key.encode())
        self.digest = h.hexdigest()

    @staticmethod
    def _encode(tokenizer, prompt: str | list, chat_template: bool, system_prompt: str) -> list[int]:
        if not chat_template:
            if not isinstance(prompt, str):
                raise ValueError("a list-of-messages prompt needs chat_template=true")
            return tokenizer.encode(prompt, add_special_tokens=False)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def position(self, step: int, n: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of the first sample of step `step` with `n` prompts a step."""
        return divmod(step * n, self.size)

    def batch(self, step: int, n: int) -> list[Prompt]:
        out, orders = [], {}
        for k in range(step * n, step * n + n):
            epoch, i = divmod(k, self.size)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            out.append(self.prompts[int(orders[epoch][i])])
        return out

    def head(self, n: int) -> list[Prompt]:
        """The first `n` prompts in file order (all with `n = 0`): a held-out evaluation set."""
        return self.prompts[: n or self.size]
