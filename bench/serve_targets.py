"""The issue's serving targets over `bench/serve.py`'s results (each met, missed or not-measured, with the
comparisons behind it), and the results plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FINISH_TOKENS = 16384  # the finish-path target's request length


@dataclass(frozen=True)
class Target:
    """One ratio target of the issue for one pair of configurations."""

    name: str
    text: str
    config: str
    baseline: str | None
    metric: str  # output_throughput | decode_step_ms | kv_capacity_tokens | cuda_graphs | starts | finish_path
    bound: float | None = None
    at_least: bool = True  # ratio >= bound (else <=)
    where: str = "equal"  # equal: points of equal (context, batch); batch16: those with batch >= 16; ...

    def check(self, ratio: float) -> bool:
        assert self.bound is not None
        return ratio >= self.bound if self.at_least else ratio <= self.bound


FP4_PAIRS = (("fp4kv", "bf16"), ("emulate+fp4kv", "emulate"), ("emulate+nvfp4kv", "emulate"))


CAPTURE_PAIRS = (
    ("emulate+capture-default", "emulate"),
    ("emulate+capture-paper", "emulate"),
    ("emulate+fp4kv+capture-default", "emulate+fp4kv"),
    ("emulate+fp4kv+capture-paper", "emulate+fp4kv"),
)


TARGETS: tuple[Target, ...] = (
    *(
        Target("capture", "output throughput with capture >= 0.97 x without, at every batch >= 16", c, b,
               "output_throughput", 0.97, True, "batch16")
        for c, b in CAPTURE_PAIRS
    ),
    Target("emulation", "emulate NVFP4 W/A decode step <= 1.3 x BF16 at batch 64 (1K context)", "emulate", "bf16",
           "decode_step_ms", 1.3, False, "batch64"),
    *(
        Target("fp4kv_capacity", "FP4 KV token capacity >= 3.5 x BF16 KV at the same memory fraction", c, b,
               "kv_capacity_tokens", 3.5, True, "server")
        for c, b in FP4_PAIRS
    ),
    *(
        Target("fp4kv_32k", "at 32K context, output throughput >= 1.5 x BF16 KV when BF16 KV is capacity-bound",
               c, b, "output_throughput", 1.5, True, "ctx32768")
        for c, b in FP4_PAIRS
    ),
    *(
        Target("fp4kv_step", "decode step <= 1.15 x BF16 KV at equal batch", c, b, "decode_step_ms", 1.15, False)
        for c, b in FP4_PAIRS
    ),
    *(
        Target("fp4kv_graphs", "no CUDA-graph capture failure at any pool size; decode runs in the graphs", c, None,
               "cuda_graphs")
        for c, _ in FP4_PAIRS
    ),
    *(
        Target("capture_memory", "no OOM with capture at a memory fraction where the server without it runs", c, b,
               "starts")
        for c, b in CAPTURE_PAIRS
    ),
    Target("finish_path", "<= 1 ms scheduler-thread time per finished 16K-token request", "emulate+fp4kv+capture-"
           "default", None, "finish_path", 1.0, False),
)  # fmt: skip


def measured_points(entry: dict | None) -> dict[tuple[int, int], dict]:
    """(context, batch) -> point of a configuration, measured ones only."""
    if not entry or entry.get("status") != "ok":
        return {}
    return {(p["context"], p["batch"]): p for p in entry["points"].values() if "output_throughput" in p}


def evaluate(target: Target, configs: dict) -> dict:
    """A target's comparisons on the results so far and its status: met, missed or not-measured (with why)."""
    out = {"target": target.name, "text": target.text, "config": target.config, "baseline": target.baseline}
    out |= {"metric": target.metric, "bound": target.bound}
    entry, base = configs.get(target.config), configs.get(target.baseline) if target.baseline else None
    settings = ("mem_fraction_static", "output_len", "batch_context")
    if entry and base and any(entry["signature"].get(k) != base["signature"].get(k) for k in settings):
        return out | {"status": "not-measured", "why": f"the two configurations ran under different {settings}"}
    if target.metric == "finish_path":  # scheduler ms per finished request, scaled to 16K tokens
        rows = [
            {"context": c, "batch": b, "tokens_per_request": p["finish_tokens_per_request"],
             "ms_per_request": p["finish_ms_per_request"],
             "ms_per_16k_tokens": p["finish_ms_per_request"] * FINISH_TOKENS / p["finish_tokens_per_request"]}
            for (c, b), p in sorted(measured_points(entry).items())
            if p.get("finish_ms_per_request") is not None and p["finish_tokens_per_request"] >= FINISH_TOKENS
        ]  # fmt: skip
        if not rows:
            return out | {"status": "not-measured", "why": f"no point of {target.config} with requests of "
                          f">= {FINISH_TOKENS} tokens (run --contexts 16384 or longer)"}  # fmt: skip
        return out | {"status": "met" if all(r["ms_per_16k_tokens"] <= target.bound for r in rows) else "missed",
                      "points": rows}  # fmt: skip
    if target.metric == "starts":
        if not base or base.get("status") != "ok":
            return out | {"status": "not-measured", "why": f"{target.baseline} not started"}
        if not entry or entry.get("status") not in ("ok", "failed"):
            return out | {"status": "not-measured", "why": f"{target.config} not run (or cut by --budget-s)"}
        failed = [k for k, p in entry["points"].items() if "error" in p]
        ok = entry["status"] == "ok" and not failed
        return out | {"status": "met" if ok else "missed", "failed": entry.get("error") or failed}
    if target.metric == "cuda_graphs":
        if not entry or entry.get("status") not in ("ok", "failed"):
            return out | {"status": "not-measured", "why": f"{target.config} not run (or cut by --budget-s)"}
        if entry["status"] != "ok":
            return out | {"status": "missed", "why": "server did not start", "error": entry.get("error")}
        max_bs = (entry["server"].get("cuda_graph_decode") or {}).get("max_bs") or 0
        fractions = {
            f"ctx{c}-b{b}": p["cuda_graph_decode_fraction"]
            for (c, b), p in measured_points(entry).items()
            if b <= max_bs and p.get("cuda_graph_decode_fraction") is not None
        }
        if not fractions:
            return out | {"status": "not-measured", "why": "no decode log line at a batch within the graphs"}
        return out | {"status": "met" if min(fractions.values()) == 1 else "missed", "graph_fraction": fractions}
    if target.metric == "kv_capacity_tokens":
        if not (entry and base and entry.get("status") == base.get("status") == "ok"):
            return out | {"status": "not-measured", "why": "both servers must have started"}
        ratio = entry["server"]["kv_capacity_tokens"] / base["server"]["kv_capacity_tokens"]
        return out | {"status": "met" if target.check(ratio) else "missed", "ratio": ratio}
    mine, theirs = measured_points(entry), measured_points(base)
    if target.where == "ctx32768":  # each at its own largest batch
        pairs = [(k, j) for k in mine for j in theirs if k[0] == j[0] == 32768]
        compared = [(k, j) for k, j in pairs if theirs[j].get("capacity_bound")]
        if pairs and not compared:
            return out | {"status": "not-measured", "why": f"{target.baseline} is not capacity-bound at 32K"}
    else:
        keep = {
            "equal": lambda k: True,
            "batch16": lambda k: k[1] >= 16,
            "batch64": lambda k: k[1] == 64 and k[0] == 1024,
        }[target.where]
        compared = [(k, k) for k in mine if k in theirs and keep(k)]
    rows = []
    for k, j in compared:
        value, baseline = mine[k].get(target.metric), theirs[j].get(target.metric)
        if value is None or not baseline:
            continue
        ratio = value / baseline
        row = {"context": k[0], "batch": k[1], "baseline_batch": j[1], "value": value, "baseline_value": baseline}
        rows.append(row | {"ratio": ratio, "met": target.check(ratio)})
    if not rows:
        return out | {"status": "not-measured", "why": "no comparable points of both configurations"}
    return out | {"status": "met" if all(r["met"] for r in rows) else "missed", "comparisons": rows}


def plot(result: dict, path: Path, batch_context: int) -> None:
    """Output throughput against batch (at `batch_context`) and against context (each context's largest batch),
    one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_c) = plt.subplots(1, 2, figsize=(13, 5))
    for name, entry in result["configs"].items():
        pts = measured_points(entry)
        if not pts:
            continue
        batch_axis = sorted((b, p["output_throughput"]) for (c, b), p in pts.items() if c == batch_context)
        if batch_axis:
            ax_b.plot(*zip(*batch_axis, strict=True), marker="o", label=name)
        largest: dict[int, tuple[int, float]] = {}
        for (c, b), p in pts.items():
            if c not in largest or b > largest[c][0]:
                largest[c] = (b, p["output_throughput"])
        contexts = sorted(largest)
        (line,) = ax_c.plot(contexts, [largest[c][1] for c in contexts], marker="o", label=name)
        for c in contexts:
            ax_c.annotate(f"b{largest[c][0]}", (c, largest[c][1]), fontsize=7, color=line.get_color())
    ax_b.set(xlabel=f"batch (context {batch_context})", ylabel="output tok/s (decode phase)")
    ax_c.set(xlabel="context (input tokens), at the largest batch measured (bN)", ylabel="output tok/s (decode)")
    for ax in (ax_b, ax_c):
        ticks = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(int(t)) for t in ticks])
        ax.grid(True, alpha=0.3)
        if ticks:
            ax.legend(fontsize=7)
    fig.suptitle("Live SGLang server, Qwen3-30B-A3B shape, one GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
