"""What the policy generates, for a person to read: every `samples_every` steps, `samples_per_step` of the step's
trajectories (spread over its groups) with their prompt, response, reward, mean |train - rollout| log-prob
difference over the response tokens and the policy version that sampled them, appended to `<out_dir>/samples.jsonl`
and logged as a TensorBoard / W&B text table (`Tracker.log_text`). verl's counterpart is `log_val_generations`
(validation only) and `trainer.rollout_data_dir` (a JSONL dump of every rollout)."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLES = "samples.jsonl"


def pick(n: int, k: int) -> list[int]:
    """`k` indices of `n` trajectories spread evenly (one per group when k equals the number of groups)."""
    if k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]


def truncate(path: Path, step: int) -> None:
    """Drop the lines of steps `step` and later (a resumed run writes them again)."""
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < step]
        path.write_text("".join(ln + "\n" for ln in lines))


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard renders text summaries as markdown)."""

    def cell(x) -> str:
        text = f"{x:.4g}" if isinstance(x, float) else str(x)
        return text.replace("|", "\\|").replace("\n", "⏎")

    keys = ["step", "version", "trajectory", "reward", "logprob_abs_diff", "prompt", "response"]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
