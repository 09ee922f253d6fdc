"""The numerics at each FP4 site of the trainer, all delegated to `trace_core` (docs/design.md, "Numerics contract").

Every site takes its format and scale granularity from the config's precision recipe (`trace_core.numerics.recipe`) and
quantizes through `trace_core.numerics.role_quant`:
- MoE input (`moe_in`) and K / V (`k`, `v`): guided rounding toward the rollout's record at captured sites in
  `trace` mode (rows without a record: the role's RTN), RTN elsewhere (and always RTN for a role the recipe does
  not record, e.g. W4A8's FP8 MoE input).
- Routed-expert weights: RTN under the `weights` role (NVFP4: one global scale per expert matrix, gate and up as
  one FC1 matrix); FC2 input: `trace_core.numerics.fc2`'s convention under the `fc2_in` role. Both straight-through.
Counts (guided elements, RTN fallbacks, redirections, code flips against the record) are kept per site as device
tensors: the forward never waits on the device, and `metrics()` reads all counters in one transfer per step. The
fake-quant runs through `trace_core.kernels` (Triton on CUDA, the `trace_core` reference elsewhere), the kernel twins
of `guided_round` / `rtn_fake_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.source import Site, SiteRows
from trace_core import metrics
from trace_core.kernels import guided_fake_quant
from trace_core.kernels.api import device_counter
from trace_core.modes import Mode
from trace_core.numerics.fc2 import fc2_input_fake_quant
from trace_core.numerics.guided import GuidanceStats, guided_quantize
from trace_core.numerics.recipe import DEFAULT_RECIPE, Role, get_recipe
from trace_core.numerics.role_quant import expert_weights_rtn, fake_quant, quantize_role

Count = int | torch.Tensor


@dataclass
class SiteStats:
    """Per-site counters over a step: guided-rounding counts and code flips against the rollout record."""

    guidance: GuidanceStats = field(default_factory=GuidanceStats)
    flipped: Count = 0
    compared: Count = 0
    distance: torch.Tensor | None = None  # flips by signed-grid distance 0..14 (full-code records only)


DEFAULT_WEIGHTS = get_recipe(DEFAULT_RECIPE).weights


def expert_weight_fake_quant(
    w: torch.Tensor, role: Role = DEFAULT_WEIGHTS, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RTN values of expert matrices `w [E, out, in]` under the recipe's weights role (NVFP4: one global scale per
    matrix, FC1's gate and up as one matrix), all experts in one kernel launch, into `out` if given (may be `w`).
    No autograd."""
    return expert_weights_rtn(role, w, out)


class SiteNumerics:
    """Fake-quantization of the trainer's FP4 sites under one `TraceConfig`."""

    def __init__(self, cfg: TraceConfig):
        self.cfg = cfg
        self.stats: dict[Site, SiteStats] = {}
        self.captured = set(cfg.spec.sites()) if cfg.mode is Mode.TRACE else set()
        self._weights: dict[torch.Tensor, tuple[int, torch.Tensor]] = {}

    def activation(self, site: Site, x: torch.Tensor, rows: SiteRows | None) -> torch.Tensor:
        """Fake-quantized rows `x [N, width]` of an activation site; `rows` is the rollout record for them."""
        if self.cfg.mode is Mode.BF16:
            return x
        role = self.cfg.role(site[1])
        stats = self.stats.get(site)
        if stats is None:
            stats = self.stats[site] = SiteStats()
        if site in self.captured:
            if rows is None:
                raise ValueError(f"trace mode: no rollout record supplied for captured site {site}")
            if tuple(rows.record.shape) != tuple(x.shape):
                raise ValueError(
                    f"site {site}: record rows {tuple(rows.record.shape)} do not match the activation "
                    f"{tuple(x.shape)} (micro-batch rows or head slicing disagree)"
                )
            # the guided kernel counts the flips of a partial-code record in its own pass (`_count_flips`)
            flipped = None
            if self.cfg.measure and rows.record.bits < 4:
                flipped = stats.flipped = device_counter(stats.flipped, x.device)
            # guided_fake_quant refuses a record narrower than the spec's bits
            y = guided_fake_quant(
                x,
                rows.record,
                self.cfg.spec.bits,
                has_record=rows.has_record,
                stats=stats.guidance,
                role=role,
                flipped=flipped,
            )
        else:
            y = fake_quant(role, x)
        if self.cfg.measure and rows is not None:
            self._count_flips(stats, site, x, rows, role)
        return y

    def _count_flips(self, stats: SiteStats, site: Site, x: torch.Tensor, rows: SiteRows, role: Role) -> None:
        """Code flips of the trainer's codes against the record, on rows that have one: the record's low b bits, or
        whole codes when the rollout kept all 4 (it may keep more bits, at more sites, than the trainer guides with).
        At a captured site with a partial-code record the guided kernel has counted them already; elsewhere every
        row is quantized and rows without a record are masked out, so nothing waits on the device."""
        rec = rows.record
        stats.compared = stats.compared + rows.has_record.sum() * x.shape[-1]
        if site in self.captured and rec.bits < 4:
            return
        has = rows.has_record.unsqueeze(-1)
        xd = x.detach()
        if site in self.captured:
            codes = guided_quantize(xd, rec, self.cfg.spec.bits, check_finite=False)[0].codes
        else:
            codes = quantize_role(role, xd, check_finite=False).codes
        recorded = rec.code_bits()
        if rec.bits == 4:
            flips = metrics.code_flips(codes, recorded) & has
            hist = metrics.codebook_distance_histogram(codes, recorded, mask=has.expand_as(codes))
            stats.distance = hist if stats.distance is None else stats.distance + hist
        else:
            flips = metrics.low_bit_flips(codes, recorded, rec.bits) & has
        stats.flipped = stats.flipped + flips.sum()

    def track(self, sites) -> None:
        """Create the counters of `sites` up front, so that a compiled forward only updates them."""
        for site in sites:
            self.stats.setdefault(site, SiteStats())

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """RTN of one expert matrix under the recipe's weights role (its own global scale), straight-through."""
        return fake_quant(self.cfg.role("weights"), w)

    def expert_weights(self, w: torch.Tensor) -> torch.Tensor:
        """Fake-quantized values of all local experts' weights `w [E, out, in]` (`expert_weight_fake_quant`),
        computed once per step and reused by every micro-batch and recompute: `reset()` (each step) drops them, and
        an in-place update of `w` (its version counter) recomputes them. The caller applies the straight-through."""
        cached = self._weights.get(w)
        if cached is None or cached[0] != w._version:
            cached = (w._version, expert_weight_fake_quant(w, self.cfg.role("weights")))
            self._weights[w] = cached
        return cached[1]

    def fc2_input(self, x: torch.Tensor, full_row_amax: torch.Tensor | None = None) -> torch.Tensor:
        """The unweighted expert FC2 input under the shared convention (`trace_core.numerics.fc2`, the recipe's `fc2_in`
        role), straight-through. Under expert TP pass the TP-max `full_row_amax` (per-token roles only)."""
        return fc2_input_fake_quant(x, self.cfg.role("fc2_in"), full_row_amax)

    def metrics(self) -> dict[str, float]:
        """`trace/L{layer}.{kind}/...` counters of the step; `code_flip_rate` only where records were compared;
        `trace/flip_distance/{d}`: flips at distance d on the signed E2M1 grid (paper Fig. 6), over the sites whose
        records hold whole codes. Device counters are read in one transfer."""
        names: list[str] = []
        values: list[Count] = []
        for (layer, kind), s in sorted(self.stats.items()):
            key = f"trace/L{layer}.{kind}"
            if (layer, kind) in self.captured:
                g = s.guidance
                names += [f"{key}/rtn_fallback", f"{key}/guided", f"{key}/redirected"]
                values += [g.rtn_fallback, g.guided, g.redirected]
            names += [f"{key}/flipped", f"{key}/compared"]
            values += [s.flipped, s.compared]
        hists = [s.distance for s in self.stats.values() if s.distance is not None]
        if hists:
            total = torch.stack(hists).sum(0)
            names += [f"trace/flip_distance/{d}" for d in range(1, len(total))]
            values += list(total[1:])
        read = dict(zip(names, _read_counts(values), strict=True))
        out: dict[str, float] = {}
        for layer, kind in sorted(self.stats):
            key = f"trace/L{layer}.{kind}"
            if (layer, kind) in self.captured:
                for name in ("rtn_fallback", "guided", "redirected"):
                    out[f"{key}/{name}"] = read[f"{key}/{name}"]
            if read[f"{key}/compared"]:
                out[f"{key}/code_flip_rate"] = read[f"{key}/flipped"] / read[f"{key}/compared"]
        out |= {n: v for n, v in read.items() if n.startswith("trace/flip_distance/")}
        if self.captured:
            out["trace/rtn_fallback"] = sum(v for n, v in read.items() if n.endswith("/rtn_fallback"))
        return out

    def reset(self) -> None:
        """Start a new step: clear the counters and drop the cached expert-weight fake-quant (weights changed)."""
        self.stats = {site: SiteStats() for site in self.stats}
        self._weights.clear()


def _read_counts(values: list[Count]) -> list[float]:
    """Host values of counters that are ints or 0-d device tensors, with one device-to-host transfer."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    host = iter(torch.stack([t.double() for t in tensors]).tolist()) if tensors else iter(())
    return [float(next(host)) if isinstance(v, torch.Tensor) else float(v) for v in values]
