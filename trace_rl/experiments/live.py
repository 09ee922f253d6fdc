"""The RL loop on a live patched SGLang server that the launcher starts itself, bf16 / qat / trace side by side, on
the tiny addition task and on a small math JSONL, beside the embedded engine on the same seed (docs/rl.md, "On a
live server, one GPU"; `scripts/run_live_h200.sh` runs it).

    python -m trace_rl.experiments.live OUT [--work DIR] [--tasks addition,math] [--modes bf16,qat,trace]
        [--steps N] [--budget S] [--no-embedded] [--device cpu] [--server-command CMD] [--record-store DIR]
        [key=value ...]

Each task's config (`TASKS`: configs/h200-colocated.toml, configs/h200-colocated-math.toml) runs once per mode with
`sglang_launch = "local"`: one server of TP = 1 on GPU 0 beside the trainer, `weight_sync = "tensor"` (CUDA IPC
buckets), `colocate` when SGLang's torch_memory_saver is installed (else the server keeps its memory and the run
says so). Then the same config with the embedded engine (`rollout_backend = "embedded"`, same model, seed, batch and
steps) gives the mismatch the live server is set beside. Runs go in this order: addition live, addition embedded,
math live, math embedded, each within `--budget` seconds of wall time in all (a run that would not fit is skipped,
one in progress stops at the step that reaches the budget; both are said in the summary).

Under the work directory (`--work`, default OUT/runs): `<task>/<live|embedded>/<mode>/` run directories (metrics,
samples, checkpoints, records, server logs) and, per task and backend, what `make demo` writes (metrics.csv,
summary.txt / .json, mismatch_reward.png, code_flip_per_layer.png). Under OUT, rewritten after every run so that a
cut-off run still leaves results: summary.txt (the side-by-side tables, the step breakdown, the step-time overhead
of trace over qat, the mismatch beside the embedded engine's), summary.json (the same numbers, the runs' settings
and the notes), metrics.csv (every step of every run), mismatch_reward.png, code_flip_per_layer.png and
step_breakdown.png.

`--device cpu` is the CPU twin of the same path: device cpu, no colocation (the memory saver needs CUDA), the
server command `--server-command` (tests/sglang_cpu_server.py: the real SGLang server on CPU).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trace_rl.config import MODES, RLConfig, load_config
from trace_rl.controller import BREAKDOWN, Controller
from trace_rl.experiments.report import MODE_LABELS, flip_rates, plot, print_table, summary, write_csv
from trace_rl.rollout.sglang_worker import SGLangPool
from trace_rl.servers import ServerGroup, port_in_use
from trace_rl.warmup import MEGATRON_STATE, make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TASKS = {"addition": "configs/h200-colocated.toml", "math": "configs/h200-colocated-math.toml"}
BACKENDS = ("live", "embedded")
MISMATCH = ("|Δ logp| mean", "Δ logp max", "Δ logp min", "k3 KL", "F(τ=2)")
FIRST_START_S = 150.0  # the first server start's estimate (CUDA graphs, JIT kernels); later ones: as measured
FIRST_STEP_S = {"live": 3.0, "embedded": 2.0}
RESERVE_S = 20.0  # kept for the teardown and the last summary


def plugin_registered() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "trace" for ep in entry_points(group="sglang.srt.plugins"))


def ensure_plugin(work: Path) -> str:
    """TRACE's SGLang plugin visible to the servers: installed packages register it (entry point group
    `sglang.srt.plugins`); a checkout that is only unpacked has none, so a one-entry-point distribution is written
    under `work` and put first on the servers' PYTHONPATH with the checkout (what the servers then import)."""
    if plugin_registered():
        return "TRACE's SGLang plugin: registered by the installed package"
    site = work / "plugin-site"
    dist = site / "trace_rl_live_plugin-0.2.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trace-rl-live-plugin\nVersion: 0.2.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\ntrace = sglang_trace.plugin:register\n")
    parts = [str(site.resolve()), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return f"TRACE's SGLang plugin: not installed; registered for the servers through {site}"


def free_port_base(start: int, servers: int = 1) -> int:
    """The first port base from `start` (by 10) whose ports are free (SGLang derives more ports from it)."""
    for base in range(start, start + 2000, 10):
        if not any(port_in_use(p) for p in range(base, base + servers + 2)):
            return base
    raise RuntimeError(f"no free port base in {start}..{start + 2000}")


def steady[T](values: list[T]) -> list[T]:
    """A run's values without its first step (compilation and first-use costs), unless it has no other."""
    return values[1:] if len(values) > 1 else values


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def breakdown(history: list[dict]) -> dict[str, float]:
    """Mean seconds per step of each part (`trace_rl.controller.BREAKDOWN`) and of the whole step, first step
    left out (`steady`)."""
    rows = steady(history)
    out = {part: mean([m[f"time/breakdown/{part}_s"] for m in rows]) for part in BREAKDOWN}
    out["step"] = mean([m["time/step_s"] for m in rows])
    out["step (median)"] = statistics.median([m["time/step_s"] for m in rows]) if rows else float("nan")
    return out


def overhead(runs: dict[str, list[dict]]) -> dict[str, float] | None:
    """Step-time overhead of trace over qat (their mean and median step times, first step left out), and each
    part's difference in seconds."""
    if "qat" not in runs or "trace" not in runs or not runs["qat"] or not runs["trace"]:
        return None
    q, t = breakdown(runs["qat"]), breakdown(runs["trace"])
    out = {
        "qat step s": q["step"],
        "trace step s": t["step"],
        "overhead (mean)": t["step"] / q["step"] - 1,
        "overhead (median)": t["step (median)"] / q["step (median)"] - 1,
    }
    out |= {f"Δ {part} s": t[part] - q[part] for part in BREAKDOWN}
    return out


class Live:
    """The runs of one invocation, their results and the files under OUT (rewritten after every run)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.work = Path(args.work) if args.work else self.out / "runs"
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.deadline = time.monotonic() + args.budget
        self.runs: dict[str, dict[str, dict[str, list[dict]]]] = {}  # task -> backend -> mode -> history
        self.info: dict[str, dict] = {}  # "task/backend/mode" -> what the run was (steps, cut, start, error)
        self.notes: list[str] = []
        self.start_s: list[float] = []
        self.step_s: dict[str, list[float]] = {b: [] for b in BACKENDS}
        self.command = shlex.split(args.server_command) if args.server_command else None
        self.colocate = args.colocate  # auto: as the config says, while the package is there and it works

    # ----------------------------------------------------------------- configs
    def config(self, task: str, backend: str, mode: str) -> RLConfig:
        a = self.args
        cfg = load_config(str(REPO / TASKS[task]), a.overrides)
        keys: dict = dict(mode=mode, steps=a.steps, checkpoint_every=a.steps)
        keys["out_dir"] = str(self.work / task / backend / mode)
        if a.record_store:  # one store per run, as the controller requires
            keys["record_store"] = str(Path(a.record_store) / task / backend / mode)
        if a.device == "cpu":
            keys |= dict(device="cpu", colocate=False, sglang_args="")
        if backend == "embedded":
            keys |= dict(
                rollout_backend="embedded", sglang_launch="off", sglang_gpus="", sglang_args="", colocate=False,
                weight_sync="disk", rollout_workers=1,
            )  # fmt: skip
        cfg = cfg.replace(**keys)
        if backend == "live" and self.colocate == "off":
            cfg = cfg.replace(colocate=False)
        if backend == "live" and cfg.colocate and importlib.util.find_spec("torch_memory_saver") is None:
            note = (
                "colocate=false: SGLang's torch_memory_saver is not installed here, so the server keeps its memory "
                "through the trainer step (it still shares the GPU, and weights still go by CUDA IPC)"
            )
            if note not in self.notes:
                self.notes.append(note)
            cfg = cfg.replace(colocate=False)
        if backend == "live":
            cfg = cfg.replace(sglang_port_base=free_port_base(cfg.sglang_port_base, cfg.rollout_workers))
        return cfg

    def prepare_model(self, cfg: RLConfig) -> None:
        path = Path(cfg.model_dir)
        if (path / MEGATRON_STATE).exists() or (path / "config.json").exists():
            return
        if cfg.data != "addition":
            raise FileNotFoundError(f"{path}: no model (scripts/run_live_h200.sh builds it: python -m tests.hf_tiny)")
        print(f"building the tiny model in {path}", flush=True)
        print(json.dumps(make_tiny_model(path, seed=cfg.seed), indent=1), flush=True)

    # ----------------------------------------------------------------- runs
    def estimate(self, backend: str, start: bool = True) -> float:
        """Seconds a run needs at least: two steps, and a server start (live) when `start`, from what was measured
        so far (the latest start: the first one on a machine also compiles kernels the later ones find cached)."""
        steps = self.step_s[backend]
        step = statistics.median(steps) if steps else FIRST_STEP_S[backend]
        if backend == "embedded" or not start:
            return 2 * step
        return (self.start_s[-1] if self.start_s else FIRST_START_S) + 2 * step

    def left(self) -> float:
        return self.deadline - RESERVE_S - time.monotonic()

    def _fits(self, key: str, backend: str, start: bool) -> bool:
        need = self.estimate(backend, start)
        if self.left() >= need:
            return True
        self.info[key] = {"skipped": f"{self.left():.0f} s of the budget left, about {need:.0f} s needed"}
        print(f"== {key}: skipped ({self.info[key]['skipped']})", flush=True)
        return False

    def _begin(self, key: str, cfg: RLConfig) -> dict:
        self.prepare_model(cfg)
        info: dict = {"config": asdict(cfg)}
        self.info[key] = info
        print(f"== {key}: {cfg.steps} steps, {cfg.prompts_per_step} x {cfg.group_size} trajectories", flush=True)
        return info

    def _failed(self, key: str, info: dict, e: Exception) -> None:
        info["error"] = f"{type(e).__name__}: {e}"
        print(f"== {key} failed: {info['error']}\n{traceback.format_exc()}", file=sys.stderr, flush=True)

    def run_embedded(self, task: str, mode: str) -> None:
        key = f"{task}/embedded/{mode}"
        if not self._fits(key, "embedded", start=False):
            return
        cfg = self.config(task, "embedded", mode)
        info, began = self._begin(key, cfg), time.monotonic()
        try:
            with Controller(cfg, resume=False) as ctrl:
                self._steps(ctrl, key, "embedded")
        except Exception as e:  # the next runs go on; the summary names the failure
            self._failed(key, info, e)
        finally:
            info["wall_s"] = time.monotonic() - began
            self._free_device()

    def run_live(self, task: str, mode: str) -> None:
        """One mode on a server the launcher starts for it (each run's own: TRACE's server hooks take weight
        versions that only go up, so a server is not set back to version 0 for the next run). A failure with
        `colocate` repeats this run without it; if that one runs, the remaining runs go without it too."""
        key = f"{task}/live/{mode}"
        if not self._fits(key, "live", start=True):
            return
        cfg = self.config(task, "live", mode)
        info, began = self._begin(key, cfg), time.monotonic()
        try:
            with ServerGroup(cfg, command=self.command) as group:
                info["server_start_s"] = time.monotonic() - began
                self.start_s.append(info["server_start_s"])
                print(f"   server up in {info['server_start_s']:.1f} s: {', '.join(group.urls)}", flush=True)
                with Controller(cfg.replace(sglang_urls=",".join(group.urls)), resume=False, servers=group) as ctrl:
                    self._steps(ctrl, key, "live")
                    if isinstance(ctrl.pool, SGLangPool):  # the servers' finish path over the run
                        info["server_trace"] = ctrl.pool.trace_counters()
        except Exception as e:  # the next runs go on; the summary names the failure
            self._failed(key, info, e)
        finally:
            info["wall_s"] = time.monotonic() - began
            self._free_device()
        if "error" in info and cfg.colocate and self.colocate == "auto":
            self.colocate = "off"  # this run again without the memory handoff, to tell whether it was the cause
            self.info[f"{key} (colocate=true)"] = self.info.pop(key)
            self.run_live(task, mode)
            if "error" in self.info[key]:  # it fails without colocation too: the rest stay colocated
                self.colocate = "auto"
                cause = "it failed without colocation too, so the other runs stay colocated"
            else:
                cause = "it ran without colocation, so the remaining runs go without it too"
            self.notes.append(f"{key} failed with colocate=true ({info['error'][:300]}); {cause}")

    def _steps(self, ctrl: Controller, key: str, backend: str) -> None:
        history = self.runs.setdefault(key.split("/")[0], {}).setdefault(backend, {}).setdefault(key.split("/")[2], [])
        history.clear()
        while ctrl.step < ctrl.steps:
            m = ctrl.train_step()
            history.append(m)
            self.step_s[backend].append(m["time/step_s"])
            parts = " ".join(f"{p} {m[f'time/breakdown/{p}_s']:.3f}" for p in BREAKDOWN)
            print(
                f"   step {m['step']}: {m['time/step_s']:.3f} s ({parts}) reward {m['reward/mean']:.3f} "
                f"|Δ logp| {m['train_rollout_logprob_abs_diff']:.5f}",
                flush=True,
            )
            if ctrl.step < ctrl.steps and self.left() < m["time/step_s"]:
                self.info[key]["cut"] = f"stopped after {ctrl.step} of {ctrl.steps} steps: the budget ran out"
                print(f"   {self.info[key]['cut']}", flush=True)
                break
        self.info[key]["steps"] = len(history)

    @staticmethod
    def _free_device() -> None:
        import gc

        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass

    # ----------------------------------------------------------------- results
    def write(self) -> None:
        """Every file under OUT and the per-task `make demo` files under the work directory, from what has run."""
        text: list[str] = []
        data: dict[str, Any] = {"runs": {}, "overhead": {}, "mismatch": {}, "breakdown": {}, "notes": self.notes}
        data["environment"] = environment()
        data["command"] = sys.argv
        data["info"] = self.info
        rows = []
        for task, backends in self.runs.items():
            for backend, runs in backends.items():
                runs = {m: h for m, h in runs.items() if h}
                if not runs:
                    continue
                where = self.work / task / backend
                where.mkdir(parents=True, exist_ok=True)
                write_csv(runs, where / "metrics.csv")
                table = summary(runs)
                data["runs"].setdefault(task, {})[backend] = table
                title = f"{task}, {'live SGLang server' if backend == 'live' else 'embedded engine'}"
                plain = print_table(table, title=title)
                (where / "summary.txt").write_text(plain)
                (where / "summary.json").write_text(json.dumps(table, indent=1))
                plot(runs, where)
                text.append(plain)
                data["breakdown"].setdefault(task, {})[backend] = {m: breakdown(h) for m, h in runs.items()}
                o = overhead(runs)
                if o is not None:
                    data["overhead"].setdefault(task, {})[backend] = o
                for hist in runs.values():
                    rows += [{"task": task, "backend": backend} | m for m in hist]
            text += self._breakdown_text(task) + self._mismatch_text(task)
            data["mismatch"][task] = self._mismatch(task)
        text.append(self._info_text())
        if self.notes:
            text.append("notes:\n" + "\n".join(f"- {n}" for n in self.notes) + "\n")
        (self.out / "summary.txt").write_text("\n".join(text))
        (self.out / "summary.json").write_text(json.dumps(data, indent=1, default=str))
        _write_rows(rows, self.out / "metrics.csv")
        _plots(self.runs, self.out)

    def _breakdown_text(self, task: str) -> list[str]:
        lines = []
        for backend, runs in self.runs.get(task, {}).items():
            runs = {m: h for m, h in runs.items() if h}
            if not runs:
                continue
            b = {m: breakdown(h) for m, h in runs.items()}
            head = f"{task}, {backend}: mean seconds per step (first step left out)"
            cols = list(b)
            lines.append(head)
            lines.append(f"{'part':<16}" + "".join(f"{MODE_LABELS.get(c, c):>14}" for c in cols))
            for part in (*BREAKDOWN, "step", "step (median)"):
                lines.append(f"{part:<16}" + "".join(f"{b[c][part]:>14.4f}" for c in cols))
            starts = [self.info.get(f"{task}/{backend}/{c}", {}).get("server_start_s") for c in cols]
            if any(s is not None for s in starts):
                lines.append(f"{'server start':<16}" + "".join(f"{s:>14.1f}" if s else f"{'—':>14}" for s in starts))
            o = overhead(runs)
            if o is not None:
                lines.append(
                    f"E2E step-time overhead of trace over qat: {100 * o['overhead (mean)']:+.1f} % (mean), "
                    f"{100 * o['overhead (median)']:+.1f} % (median); per part (trace - qat, s): "
                    + ", ".join(f"{p} {o[f'Δ {p} s']:+.4f}" for p in BREAKDOWN)
                )
            lines.append("")
        return ["\n".join(lines)] if lines else []

    def _mismatch(self, task: str) -> dict:
        out: dict = {}
        for backend, runs in self.runs.get(task, {}).items():
            runs = {m: h for m, h in runs.items() if h}
            if runs:
                table = summary(runs)
                out[backend] = {m: {k: table[m][k] for k in MISMATCH} for m in runs}
        return out

    def _mismatch_text(self, task: str) -> list[str]:
        m = self._mismatch(task)
        cols = [(b, mode) for b in BACKENDS for mode in MODES if mode in m.get(b, {})]
        if not cols:
            return []
        lines = [f"{task}: train-rollout mismatch, live server beside the embedded engine (same seed, config, steps)"]
        lines.append(f"{'metric':<16}" + "".join(f"{f'{b} {mode}':>16}" for b, mode in cols))
        for k in MISMATCH:
            lines.append(f"{k:<16}" + "".join(f"{m[b][mode][k]:>16.4g}" for b, mode in cols))
        return ["\n".join(lines) + "\n"]

    def _info_text(self) -> str:
        lines = ["runs:"]
        for key, info in self.info.items():
            what = info.get("skipped") or info.get("error") or info.get("cut") or "complete"
            start = f", server start {info['server_start_s']:.1f} s" if "server_start_s" in info else ""
            wall = f", {info['wall_s']:.1f} s wall" if "wall_s" in info else ""
            lines.append(f"- {key}: {info.get('steps', 0)} steps{start}{wall}: {what}")
            for i, c in enumerate(info.get("server_trace") or []):
                if c and c["requests"]:
                    lines.append(
                        f"  server {i} TRACE finish path: {c['requests']} requests, "
                        f"{1e3 * c['finish_s'] / c['requests']:.3f} ms each on the scheduler thread (host-ring "
                        f"waits {c['ring']['stall_s']:.3f} s), writer "
                        f"{c['write_s']:.3f} s for {c['host_bytes'] / 1e6:.1f} MB, {c['shards_written']} shards"
                    )
        return "\n".join(lines) + "\n"


def _write_rows(rows: list[dict], path: Path) -> None:
    keys = ["task", "backend", "mode", "step"]
    keys += sorted({k for r in rows for k in r} - set(keys))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _plots(all_runs: dict, out: Path) -> None:
    """OUT's figures: per task (rows) the panels of `make demo`'s two plots (live solid, embedded dashed), and the
    mean step breakdown of every run as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t, b in all_runs.items() if any(h for runs in b.values() for h in runs.values())]
    if not tasks:
        return
    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for backend, runs in all_runs[task].items():
            style = "-" if backend == "live" else ":"
            for mode, hist in runs.items():
                if not hist:
                    continue
                steps = [m["step"] for m in hist]
                kw = dict(label=f"{backend} {mode}", color=f"C{MODES.index(mode)}")  # a mode's colour on both engines
                hi, lo = ([m[f"train_rollout_logprob_diff_{k}"] for m in hist] for k in ("max", "min"))
                axes[row][0].plot(steps, hi, style, **kw)
                axes[row][0].plot(steps, lo, style, color=kw["color"])
                axes[row][1].plot(steps, [m["reward/mean"] for m in hist], style, **kw)
                axes[row][2].plot(steps, [m["train_rollout_logprob_abs_diff"] for m in hist], style, **kw)
        for ax, title in zip(axes[row], ("log-prob diff max / min", "reward", "|Δ logp| mean"), strict=True):
            ax.set_title(f"{task}: {title}")
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "mismatch_reward.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(len(tasks), 1, figsize=(10, 4 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        ax = axes[row][0]
        series = [(f"{b} {m}", flip_rates(h)) for b, runs in all_runs[task].items() for m, h in runs.items() if h]
        series = [(name, rates) for name, rates in series if rates]
        sites = sorted({s for _, rates in series for s in rates})
        width = 0.8 / max(1, len(series))
        for i, (name, rates) in enumerate(series):
            ax.bar([j + i * width for j in range(len(sites))], [rates.get(s, 0.0) for s in sites], width, label=name)
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(sites))], sites)
        ax.set_ylabel("code-flip rate (recorded bits)")
        ax.set_title(f"{task}: code-flip rate per layer and site")
        if series:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "code_flip_per_layer.png", dpi=90)
    plt.close(fig)

    bars = [
        (f"{task} {backend} {mode}", breakdown(h))
        for task in tasks
        for backend, runs in all_runs[task].items()
        for mode, h in runs.items()
        if h
    ]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 1.5))
    left = [0.0] * len(bars)
    for part in BREAKDOWN:
        widths = [b[part] for _, b in bars]
        ax.barh(range(len(bars)), widths, left=left, label=part)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("mean seconds per step (first step left out)")
    ax.set_title("step breakdown")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "step_breakdown.png", dpi=90)
    plt.close(fig)


def environment() -> dict:
    env: dict = {"python": platform.python_version(), "host": platform.node()}
    for name in ("torch", "sglang", "megatron.core", "transformers", "triton"):
        try:
            env[name] = __import__(name, fromlist=["__version__"]).__version__
        except Exception as e:
            env[name] = f"not importable ({type(e).__name__})"
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:
        env["commit"] = ""
    return env


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="where summary.txt / .json, metrics.csv and the plots go")
    ap.add_argument("--work", help="where the run directories go (default OUT/runs)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--steps", type=int, default=20, help="RL steps of every run (default 20)")
    ap.add_argument("--budget", type=float, default=540.0, help="wall-clock seconds for everything (default 540)")
    ap.add_argument("--no-embedded", action="store_true", help="only the live-server runs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu: the CPU twin")
    ap.add_argument(
        "--colocate",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): the config's colocate while torch_memory_saver is installed; a colocated run that fails "
        "is repeated without, and if that one runs, the remaining runs go without too; off: never",
    )
    ap.add_argument(
        "--server-command", default="", help="the server executable (default: python -m sglang.launch_server)"
    )
    ap.add_argument(
        "--record-store",
        help="put each run's record store under this directory (e.g. a RAM disk) instead of its run directory",
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides for every run")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    os.chdir(REPO)  # the configs name the checkout's paths
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [t for t in tasks if t not in TASKS] + [m for m in modes if m not in MODES]
    if bad or not tasks or not modes or args.steps < 1:
        raise SystemExit(f"live: bad --tasks / --modes / --steps ({bad or args.steps})")
    live = Live(args)
    print(ensure_plugin(live.work), flush=True)
    if "math" in tasks and importlib.util.find_spec("math_verify") is None:
        live.notes.append("math task skipped: math_verify (the math reward's Math-Verify) is not installed")
        tasks.remove("math")
    for task in tasks:
        for mode in modes:
            live.run_live(task, mode)
            live.write()
        for mode in [] if args.no_embedded else modes:
            live.run_embedded(task, mode)
            live.write()
    live.write()
    print((live.out / "summary.txt").read_text())
    print(f"wrote {live.out}/summary.txt, summary.json, metrics.csv and the plots; runs in {live.work}")
    return 1 if any("error" in i for i in live.info.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
