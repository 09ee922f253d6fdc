"""The live server's current table (docs/performance.md): over the committed runs of `bench/serve.py`, each
configuration's latest measured output throughput at every point and its latest KV capacity, one table per GPU,
and each target's latest judgement on each GPU. A ratio target is judged within one run (`serve_targets.evaluate`,
stored with the run), never across runs or GPUs; a cell names the run it comes from.

    python bench/serve_table.py docs/measurements/serve_h200/run{1,2,3,4,5}.json \
        docs/measurements/serve_h100/run{1,2}.json                                    # each GPU's runs oldest first
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.* of this checkout

from bench.serve_targets import TARGETS

Run = tuple[str, dict]  # (name, the results JSON of bench/serve.py)


def gpu(result: dict) -> str:
    """The GPU a run ran on, as `bench/serve.py` recorded it, without its memory ("NVIDIA H200")."""
    return result["gpu"].split(",")[0]


def _point_order(key: str) -> tuple[int, int]:
    """Batch-axis points (1K context) by batch, then the long contexts by context."""
    context, batch = re.fullmatch(r"ctx(\d+)-b(\d+|fit)", key).groups()  # type: ignore[union-attr]
    return (1, int(context)) if batch == "fit" else (0, int(batch))


def latest(runs: list[Run]) -> dict:
    """Per configuration: the latest run's start (KV tokens, or that it did not start) and, per point, the latest
    measured point with its run."""
    out: dict[str, dict] = {}
    for run, result in runs:
        for name, entry in result["configs"].items():
            row = out.setdefault(name, {"start": None, "points": {}})
            if entry.get("status") == "ok":
                row["start"] = (run, entry["server"]["kv_capacity_tokens"])
            elif entry.get("status") == "failed":
                row["start"] = (run, None)
            if entry.get("status") != "ok":
                continue
            for key, point in entry["points"].items():
                if "output_throughput" in point:
                    row["points"][key] = (run, point)
    return out


def latest_targets(runs: list[Run]) -> dict[tuple[str, str, str | None], dict[str, tuple[str, dict]]]:
    """Per (target, configuration, baseline), per GPU: the latest run that judged it (met or missed), with that
    judgement."""
    out: dict[tuple[str, str, str | None], dict[str, tuple[str, dict]]] = {}
    for run, result in runs:
        for judged in result.get("targets", []):
            if judged["status"] in ("met", "missed"):
                key = (judged["target"], judged["config"], judged["baseline"])
                out.setdefault(key, {})[gpu(result)] = (run, judged)
    return out


def _judgement(judged: dict) -> str:
    """The figures behind a judgement: the ratios compared (lowest and highest), or what the server reported."""
    if "comparisons" in judged:
        ratios = [r["ratio"] for r in judged["comparisons"]]
        where = ", ".join(
            f"b{r['batch']}" + ("" if r["context"] == 1024 else f" at {r['context'] // 1024}K")
            for r in judged["comparisons"]
        )
        return f"{min(ratios):.3f}" + (f" – {max(ratios):.3f}" if len(ratios) > 1 else "") + f" ({where})"
    if "ratio" in judged:
        return f"{judged['ratio']:.3f}"
    if "graph_fraction" in judged:
        return f"decode in graphs: {min(judged['graph_fraction'].values()):.0%} of the lines at the least"
    if "points" in judged:
        return ", ".join(f"{p['ms_per_16k_tokens']:.3f} ms per 16K tokens" for p in judged["points"])
    if judged.get("failed"):
        return f"failed: {str(judged['failed'])[:80]}"
    return "started, every point ran"


def _throughput(card: str, runs: list[Run]) -> list[str]:
    """One GPU's table: output tok/s per configuration and point, and each configuration's KV tokens."""
    rows = latest(runs)
    keys = sorted({k for row in rows.values() for k in row["points"]}, key=_point_order)
    heads = [f"{int(k[3:].split('-')[0]) // 1024}K context" if k.endswith("-bfit") else f"b = {k.split('-b')[1]}"
             for k in keys]  # fmt: skip
    lines = [f"{card}, output tok/s:", ""]
    lines += ["| configuration | KV tokens | " + " | ".join(heads) + " |", "|---" * (2 + len(keys)) + "|"]
    for name, row in rows.items():
        run, tokens = row["start"] or ("", None)
        start = f"{tokens:,} ({run})" if tokens else f"did not start ({run})" if run else "–"
        cells = []
        for k in keys:
            if k not in row["points"]:
                cells.append("–")
                continue
            run, p = row["points"][k]
            batch = f", b{p['batch']}" if k.endswith("-bfit") else ""
            cells.append(f"{p['output_throughput']:,.1f} ({run}{batch})")
        lines.append(f"| {name} | {start} | " + " | ".join(cells) + " |")
    return lines + [""]


def markdown(runs: list[Run]) -> str:
    """One throughput table per GPU (in the order the runs first name it), then the targets, one row per GPU that
    judged a target."""
    lines: list[str] = []
    for card in dict.fromkeys(gpu(result) for _, result in runs):
        lines += _throughput(card, [run for run in runs if gpu(run[1]) == card])
    lines += ["| target | configuration vs baseline | status | figures | run |", "|---|---|---|---|---|"]
    judged_at = latest_targets(runs)
    for t in TARGETS:
        pair = t.config + (f" vs {t.baseline}" if t.baseline else "")
        per_gpu = judged_at.get((t.name, t.config, t.baseline), {})
        for run, judged in per_gpu.values():
            lines.append(f"| {t.text} | {pair} | {judged['status']} | {_judgement(judged)} | {run} |")
        if not per_gpu:
            lines.append(f"| {t.text} | {pair} | not measured | | |")
    return "\n".join(lines) + "\n"


def load_runs(paths: list[Path]) -> list[Run]:
    """The runs in the order given (oldest first), each named after its file: `serve_h100/run2.json` is `h100 r2`
    (its folder's card, then `r<N>`), else the file's stem."""
    runs = []
    for path in paths:
        m = re.fullmatch(r"run(\d+)", path.stem)
        card = re.fullmatch(r"serve_(\w+)", path.parent.name)
        name = (f"{card.group(1)} " if card else "") + (f"r{m.group(1)}" if m else path.stem)
        runs.append((name, json.loads(path.read_text())))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="results JSONs of bench/serve.py, oldest first")
    print(markdown(load_runs(p.parse_args().runs)), end="")


if __name__ == "__main__":
    main()
