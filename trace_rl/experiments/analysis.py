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
from pathlib import Path

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rows import TokenRows
from megatron_trace.source import Site
from trace_core.records import Binding, RecordSpec, token_digest
from trace_core.store import StepWriter, finalize_step
from trace_rl.engine import EmbeddedEngine
from trace_rl.task import EOS, AdditionTask
from trace_rl.trainer import MegatronTrainer
from trace_rl.warmup import HF_DIR, load_megatron_state

BITS = (1, 2, 4)
LAYERS = {"all": 1, "half": 2, "quarter": 4}  # captured: the latter 1/k of the layers
MSE = re.compile(r"mse/L(\d+)\.(moe_in|k|v)")


def captured_layers(layers: int, which: str) -> tuple[int, ...]:
    """The latter 1/k of `layers` layer ids (at least one) for `which` in `LAYERS`."""
    keep = max(1, layers // LAYERS[which])
    return tuple(range(layers - keep, layers))


def ablation_specs(layers: int) -> dict[str, RecordSpec]:
    """`b{bits}/{layers}` -> the guidance spec, for every bits x captured-layers combination."""
    out = {}
    for which in LAYERS:
        ids = captured_layers(layers, which)
        for bits in BITS:
            out[f"b{bits}/{which}"] = RecordSpec(bits=bits, moe_layers=ids, attn_layers=ids)
    return out


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
) -> list[dict]:
    """Run the analyses on the policy in `model_dir`; one result row per (rollout batch, configuration).

    Configurations: `bf16` on a BF16 rollout; `qat` (RTN everywhere) and every `ablation_specs` entry on an FP4
    rollout. `out_dir` holds the record store of the analysed batches.
    """
    tiny, digits, state = load_megatron_state(model_dir)
    task = AdditionTask(digits)
    ids = tuple(range(tiny.layers))
    full = RecordSpec(bits=4, moe_layers=ids, attn_layers=ids)
    trainer = MegatronTrainer(tiny, state, mode="qat", spec=full, lr=1e-6, max_version_diff=0)
    max_len = task.prompt_len + max_new_tokens
    n = prompts * group_size
    store = Path(out_dir) / "records"
    fp4_configs = {"qat": TraceConfig(mode="qat", spec=full)}
    fp4_configs |= {name: TraceConfig(mode="trace", spec=spec) for name, spec in ablation_specs(tiny.layers).items()}
    results = []
    for fp4 in (False, True):
        engine = EmbeddedEngine(
            str(Path(model_dir) / HF_DIR), fp4=fp4, spec=full, max_batch=n, max_len=max_len, device=device
        )
        configs = fp4_configs if fp4 else {"bf16": TraceConfig(mode="bf16", spec=full)}
        for k in range(batches):
            step = 2 * k + int(fp4)
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
                results.append(row | {"reward/mean": float(rewards.mean())} | metrics | disc.mse())
        del engine
    return results


def relative_excess(results: list[dict]) -> dict[str, dict[str, float]]:
    """Fig. 4b per configuration and site: (D_FP4 - D_BF16) / D_BF16, D the train–rollout activation MSE averaged
    over the analysed batches."""

    def mean_mse(config: str) -> dict[str, float]:
        rows = [r for r in results if r["config"] == config]
        keys = sorted({k for r in rows for k in r if MSE.fullmatch(k)})
        return {k: sum(r[k] for r in rows) / len(rows) for k in keys}

    base = mean_mse("bf16")
    out = {}
    for config in sorted({r["config"] for r in results} - {"bf16"}):
        fp4 = mean_mse(config)
        out[config] = {k[4:]: (fp4[k] - base[k]) / base[k] for k in fp4 if base.get(k)}
    return out
