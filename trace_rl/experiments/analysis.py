"""Same-batch mismatch analyses (docs/results.md): one policy, one rollout batch, the trainer's forward under several
numerics configurations.

The rollout records whole codes (b = 4) at every site, so one FP4 batch serves every configuration: a b-bit capture
at some layers is the low b bits of those records (`SiteNumerics` guides with the spec's bits). Per configuration
and site: the code-flip rate against the rollout's codes, the codebook distance of the flips (paper Fig. 6), and the
train–rollout activation MSE at the site, from an `ActivationTap` on the engine and a `TraceSession` tap on the
trainer matched by (trajectory, position); with a BF16 batch's MSE this gives the relative excess discrepancy per
layer (Fig. 4b). Policy-level: the log-prob mismatch metrics of each configuration on the same tokens (Table 5).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_trace.config import Mode, TraceConfig
from megatron_trace.model import MoEModelConfig
from megatron_trace.rows import TokenRows
from megatron_trace.source import Site
from trace_core.records.spec import Binding, ModelShape, RecordSpec, bytes_per_token, token_digest
from trace_core.records.store import StepWriter, finalize_step
from trace_rl.rollout.engine import EmbeddedEngine
from trace_rl.task import EOS, AdditionTask
from trace_rl.trainer import MegatronTrainer
from trace_rl.warmup import HF_DIR, load_megatron_state

BITS = (1, 2, 4)
LAYER_SETS = ("all", "half", "quarter", "first_half", "every_other", "flips")
"""Captured layers of the ablation: every layer; the latter half (the paper's default); the latter quarter; the
first half; every other layer from layer 0; `flips`: as many layers as the latter half, those with the highest
code-flip rates under FP4 + QAT on a calibration batch (`flip_policy`)."""
MSE = re.compile(r"mse/L(\d+)\.(moe_in|k|v)")
FLIP = re.compile(r"trace/L(\d+)\.(moe_in|k|v)/code_flip_rate")


def captured_layers(layers: int, which: str) -> tuple[int, ...]:
    """The layer ids of the fixed layer set `which` (every entry of `LAYER_SETS` but `flips`) of a `layers`-layer
    model; at least one layer."""
    half, quarter = max(1, layers // 2), max(1, layers // 4)
    sets = {
        "all": range(layers),
        "half": range(layers - half, layers),
        "quarter": range(layers - quarter, layers),
        "first_half": range(half),
        "every_other": range(0, layers, 2),
    }
    if which not in sets:
        raise ValueError(f"unknown fixed layer set {which!r}; use one of {sorted(sets)}")
    return tuple(sets[which])


def flip_policy(flip_rates: dict[str, float], layers: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(MoE layers, attention layers): the `count` layers with the highest code-flip rate of each site kind (K and V
    averaged), given `trace/L{l}.{kind}/code_flip_rate` metrics of an FP4 + QAT forward."""
    rates: dict[str, dict[int, list[float]]] = {"moe": {}, "attn": {}}
    for key, value in flip_rates.items():
        hit = FLIP.fullmatch(key)
        if hit:
            rates["moe" if hit[2] == "moe_in" else "attn"].setdefault(int(hit[1]), []).append(value)
    chosen = []
    for kind in ("moe", "attn"):
        if sorted(rates[kind]) != list(range(layers)):
            raise ValueError(f"flip rates of {kind} sites cover layers {sorted(rates[kind])}, not all {layers}")
        mean = {layer: sum(v) / len(v) for layer, v in rates[kind].items()}
        chosen.append(tuple(sorted(sorted(mean, key=lambda layer: (-mean[layer], layer))[:count])))
    return chosen[0], chosen[1]


def ablation_specs(layers: int, flip_rates: dict[str, float] | None = None) -> dict[str, RecordSpec]:
    """`b{bits}/{layer set}` -> the guidance spec, for every bits x layer set of `LAYER_SETS` (`flips` only with
    the calibration batch's QAT `flip_rates`)."""
    out = {}
    for which in LAYER_SETS:
        if which == "flips":
            if flip_rates is None:
                continue
            moe, attn = flip_policy(flip_rates, layers, len(captured_layers(layers, "half")))
        else:
            moe = attn = captured_layers(layers, which)
        for bits in BITS:
            out[f"b{bits}/{which}"] = RecordSpec(bits=bits, moe_layers=moe, attn_layers=attn)
    return out


def record_bytes(tiny: MoEModelConfig, spec: RecordSpec) -> float:
    """Record bytes per token of `spec` on the model `tiny` (`trace_core.records.spec.bytes_per_token`)."""
    return bytes_per_token(ModelShape(tiny.hidden, tiny.kv_heads, tiny.head_dim), spec).total


class RolloutActivations:
    """Engine tap: each site's rows `x` (input) and `y` (what the engine used), FP32, indexed by KV slot."""

    def __init__(self, slots: int):
        self.slots = slots
        self.x: dict[Site, torch.Tensor] = {}
        self.y: dict[Site, torch.Tensor] = {}
        self._pending: list[tuple[Site, torch.Tensor, torch.Tensor]] = []

    def site(self, site: Site, x: torch.Tensor, y: torch.Tensor) -> None:
        self._pending.append((site, x.detach().float(), y.detach().float()))

    def forward_end(self, slots: torch.Tensor) -> None:
        for site, x, y in self._pending:
            if x.shape[0] != slots.numel():
                raise ValueError(f"site {site}: {x.shape[0]} rows in a forward of {slots.numel()} tokens")
            for table, rows in ((self.x, x), (self.y, y)):
                buf = table.setdefault(site, torch.zeros(self.slots, rows.shape[1], device=rows.device))
                buf[slots] = rows
        self._pending.clear()


class SiteDiscrepancy:
    """Trainer tap: sum of squared train – rollout differences per site over the real rows of a micro-batch.
    Compares inputs (`x`) in BF16 and the fake-quantized values (`y`) in FP4 configurations."""

    def __init__(self, rollout: RolloutActivations, max_len: int, *, values: str):
        if values not in ("x", "y"):
            raise ValueError(f"values={values!r} must be 'x' or 'y'")
        self.table = rollout.x if values == "x" else rollout.y
        self.max_len = max_len
        self.values = values
        self.sse: dict[Site, float] = {}
        self.count: dict[Site, int] = {}

    def __call__(self, site: Site, rows: TokenRows, x2d: torch.Tensor, y2d: torch.Tensor) -> None:
        if site not in self.table:
            raise KeyError(f"site {site}: the rollout tap saw no activations there")
        real = rows.traj >= 0
        slots = (rows.traj * self.max_len + rows.pos)[real].to(x2d.device)
        train = (x2d if self.values == "x" else y2d)[real.to(x2d.device)].float()
        diff = train - self.table[site][slots]
        self.sse[site] = self.sse.get(site, 0.0) + float((diff * diff).sum())
        self.count[site] = self.count.get(site, 0) + diff.numel()

    def mse(self) -> dict[str, float]:
        return {f"mse/L{layer}.{kind}": self.sse[(layer, kind)] / self.count[(layer, kind)] for layer, kind in self.sse}


def analyze(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    batches: int = 2,
    prompts: int = 16,
    group_size: int = 8,
    max_new_tokens: int = 6,
    temperature: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    on_batch: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Run the analyses on the policy in `model_dir`; one result row per (rollout batch, configuration).

    Configurations: `bf16` on a BF16 rollout; `qat` (RTN everywhere) and every `ablation_specs` entry on an FP4
    rollout, each row with its `record_bytes_per_token`. An extra FP4 batch before them (`batch` -1, a `qat` row
    only) calibrates the `flips` layer set; it is not one of the `batches` compared. `out_dir` holds the record
    store of the analysed batches. `on_batch` gets the rows so far after each batch.
    """
    tiny, digits, state = load_megatron_state(model_dir)
    task = AdditionTask(digits)
    ids = tuple(range(tiny.layers))
    full = RecordSpec(bits=4, moe_layers=ids, attn_layers=ids)
    trainer = MegatronTrainer(tiny, state, mode="qat", spec=full, lr=1e-6, max_version_diff=0)
    max_len = task.prompt_len + max_new_tokens
    n = prompts * group_size
    store = Path(out_dir) / "records"
    qat = {"qat": TraceConfig(mode="qat", spec=full)}
    results = []
    for fp4 in (False, True):
        engine = EmbeddedEngine(
            str(Path(model_dir) / HF_DIR), fp4=fp4, spec=full, max_batch=n, max_len=max_len, device=device
        )
        configs = {"bf16": TraceConfig(mode="bf16", spec=full)}
        for k in range(-1 if fp4 else 0, batches):
            if fp4 and k >= 0 and "b1/flips" not in configs:  # after the calibration batch
                flips = {key: v for key, v in results[-1].items() if FLIP.fullmatch(key)}
                configs = qat | {name: TraceConfig(mode="trace", spec=spec) for name, spec in ablation_specs(
                    tiny.layers, flips).items()}  # fmt: skip
            elif fp4 and k < 0:
                configs = qat
            step = 2 * (k + 1) + int(fp4)
            tap = RolloutActivations(n * max_len)
            engine.tap = tap
            operands = task.sample(prompts, torch.Generator().manual_seed(seed * 7919 + k))
            trajs = engine.generate(
                task.prompts(operands).repeat_interleave(group_size, 0),
                max_new_tokens,
                eos=EOS,
                seed=seed * 1_000_003 + k,
                temperature=temperature,
            )
            version = trainer.policy_version()
            bound = {
                str(i): dataclasses.replace(
                    t.records, binding=Binding(step, version, str(i), "analysis", token_digest(t.tokens))
                )
                for i, t in enumerate(trajs)
            }
            StepWriter(store, step, writer_id="analysis").write(bound)
            finalize_step(store, step)
            trajs = [dataclasses.replace(t, records=None, attempt="analysis") for t in trajs]
            batch = trainer.prepare(trajs, str(store), step, version)
            rewards = task.reward(operands.repeat_interleave(group_size, 0), [t.response for t in trajs])
            for name, cfg in configs.items():
                disc = SiteDiscrepancy(tap, max_len, values="y" if fp4 else "x")
                metrics = trainer.evaluate(batch, cfg, tap=disc)
                row = {"config": name, "batch": k, "rollout": "fp4" if fp4 else "bf16"}
                trace = cfg.mode is Mode.TRACE
                row["record_bytes_per_token"] = record_bytes(tiny, cfg.spec) if trace else 0.0
                if trace:
                    row["moe_layers"], row["attn_layers"] = list(cfg.spec.moe_layers), list(cfg.spec.attn_layers)
                results.append(row | {"reward/mean": float(rewards.mean())} | metrics | disc.mse())
            if on_batch is not None:
                on_batch(results)
        del engine
    return results


def relative_excess(results: list[dict]) -> dict[str, dict[str, float]]:
    """Fig. 4b per configuration and site: (D_FP4 - D_BF16) / D_BF16, D the train–rollout activation MSE averaged
    over the analysed batches."""

    def mean_mse(config: str) -> dict[str, float]:
        rows = [r for r in results if r["config"] == config and r["batch"] >= 0]
        keys = sorted({k for r in rows for k in r if MSE.fullmatch(k)})
        return {k: sum(r[k] for r in rows) / len(rows) for k in keys}

    base = mean_mse("bf16")
    out = {}
    for config in sorted({r["config"] for r in results} - {"bf16"}):
        fp4 = mean_mse(config)
        out[config] = {k[4:]: (fp4[k] - base[k]) / base[k] for k in fp4 if base.get(k)}
    return out
