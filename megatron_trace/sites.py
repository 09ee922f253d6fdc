"""The numerics at each FP4 site of the trainer, all delegated to `trace_core` (DESIGN §2, §5).

- MoE input (`moe_in`) and K / V (`k`, `v`): guided rounding toward the rollout's record at captured sites in
  `trace` mode, RTN elsewhere; per-token NVFP4 scale for the MoE input, KV_FP4 per 16 elements of a head vector.
- Routed-expert weights: NVFP4 RTN with one global scale per expert matrix (gate and up share it: they are one
  FC1 matrix); FC2 input: `trace_core.fc2`'s convention (NVFP4 RTN, per-row scale). Both straight-through.
Counts (guided elements, RTN fallbacks, redirections, code flips against the record) are kept per site. The
fake-quant runs through `trace_core.kernels` (Triton on CUDA, the `trace_core` reference elsewhere), the kernel twins
of `guided_round` / `rtn_fake_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_trace.config import Mode, TraceConfig
from megatron_trace.source import Site, SiteRows, take_rows
from trace_core import metrics
from trace_core.fc2 import fc2_input_fake_quant
from trace_core.guided import GuidanceStats, guided_quantize
from trace_core.kernels import guided_fake_quant, rtn_fake_quant
from trace_core.quant import quantize
from trace_core.records import low_bits_mask


@dataclass
class SiteStats:
    """Per-site counters over a step: guided-rounding counts and code flips against the rollout record."""

    guidance: GuidanceStats = field(default_factory=GuidanceStats)
    flipped: int = 0
    compared: int = 0
    distance: torch.Tensor | None = None  # flips by signed-grid distance 0..14 (full-code records only)


class SiteNumerics:
    """Fake-quantization of the trainer's FP4 sites under one `TraceConfig`."""

    def __init__(self, cfg: TraceConfig):
        self.cfg = cfg
        self.stats: dict[Site, SiteStats] = {}
        self.captured = set(cfg.spec.sites()) if cfg.mode is Mode.TRACE else set()

    def _format(self, kind: str):
        return self.cfg.moe_format if kind == "moe_in" else self.cfg.kv_format

    def _per_token(self, kind: str) -> bool:
        return kind == "moe_in" and self.cfg.spec.per_token_scale and self.cfg.moe_format.has_global_scale

    def activation(self, site: Site, x: torch.Tensor, rows: SiteRows | None) -> torch.Tensor:
        """Fake-quantized rows `x [N, width]` of an activation site; `rows` is the rollout record for them."""
        if self.cfg.mode is Mode.BF16:
            return x
        layer, kind = site
        fmt, per_token = self._format(kind), self._per_token(kind)
        stats = self.stats.setdefault(site, SiteStats())
        if site in self.captured:
            if rows is None:
                raise ValueError(f"trace mode: no rollout record supplied for captured site {site}")
            if tuple(rows.record.shape) != tuple(x.shape):
                raise ValueError(
                    f"site {site}: record rows {tuple(rows.record.shape)} do not match the activation "
                    f"{tuple(x.shape)} (micro-batch rows or head slicing disagree)"
                )
            # guided_fake_quant refuses a record narrower than the spec's bits
            y = guided_fake_quant(x, rows.record, self.cfg.spec.bits, has_record=rows.has_record, stats=stats.guidance)
        else:
            y = rtn_fake_quant(x, fmt, per_token=per_token)
        if self.cfg.measure and rows is not None:
            self._count_flips(stats, site, x, rows, fmt, per_token)
        return y

    def _count_flips(self, stats: SiteStats, site: Site, x: torch.Tensor, rows: SiteRows, fmt, per_token) -> None:
        """Code flips of the trainer's codes against the record, on rows that have one: the record's low b bits, or
        whole codes when the rollout kept all 4 (it may keep more bits, at more sites, than the trainer guides with)."""
        has = rows.has_record
        if not bool(has.any()):
            return
        xd = x.detach()[has]
        rec = rows.record
        if site in self.captured:
            codes = guided_quantize(xd, take_rows(rec, has.nonzero().flatten()), self.cfg.spec.bits)[0].codes
        else:
            codes = quantize(xd, fmt, per_token=per_token).codes
        recorded = rec.code_bits()[has]
        if rec.bits == 4:
            flips = metrics.code_flips(codes, recorded)
            hist = metrics.codebook_distance_histogram(codes, recorded).cpu()
            stats.distance = hist if stats.distance is None else stats.distance + hist
        else:
            flips = (codes & low_bits_mask(rec.bits)) != recorded
        stats.flipped += int(flips.sum())
        stats.compared += flips.numel()

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """NVFP4 RTN of one expert matrix with its own global scale, straight-through."""
        return rtn_fake_quant(w, self.cfg.weight_format)

    def fc2_input(self, x: torch.Tensor, full_row_amax: torch.Tensor | None = None) -> torch.Tensor:
        """The unweighted expert FC2 input under the shared convention (`trace_core.fc2`: NVFP4 RTN, per-row scale
        over the full intermediate width), straight-through. Under expert TP pass the TP-max `full_row_amax`."""
        return fc2_input_fake_quant(x, full_row_amax)

    def metrics(self) -> dict[str, float]:
        """`trace/L{layer}.{kind}/...` counters of the step; `code_flip_rate` only where records were compared;
        `trace/flip_distance/{d}`: flips at distance d on the signed E2M1 grid (paper Fig. 6), over the sites whose
        records hold whole codes."""
        out: dict[str, float] = {}
        for (layer, kind), s in sorted(self.stats.items()):
            key = f"trace/L{layer}.{kind}"
            if (layer, kind) in self.captured:
                out[f"{key}/rtn_fallback"] = float(s.guidance.rtn_fallback)
                out[f"{key}/guided"] = float(s.guidance.guided)
                out[f"{key}/redirected"] = float(s.guidance.redirected)
            if s.compared:
                out[f"{key}/code_flip_rate"] = s.flipped / s.compared
        hists = [s.distance for s in self.stats.values() if s.distance is not None]
        if hists:
            total = torch.stack(hists).sum(0)
            out |= {f"trace/flip_distance/{d}": float(total[d]) for d in range(1, len(total))}
        if self.captured:
            out["trace/rtn_fallback"] = float(sum(s.guidance.rtn_fallback for s in self.stats.values()))
        return out

    def reset(self) -> None:
        self.stats.clear()
