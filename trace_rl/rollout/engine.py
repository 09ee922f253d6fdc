"""Embedded reference engine: transformers `Qwen3MoeForCausalLM` in BF16 with the FP4 numerics of the SGLang side.

FP4 mode (docs/design.md, "Numerics contract"), every site under the engine's precision recipe
(`trace_core.numerics.recipe`, default NVFP4 W4A4 + FP4 KV), quantized through `trace_core.numerics.role_quant`:
- routed-expert weights are quantize-dequantized under the `weights` role (NVFP4: one global scale per expert
  matrix, gate and up as one FC1 matrix) at load and at every weight update;
- the MoE input is quantize-dequantized per token row (`moe_in` role) by `trace_core.kernels.quantize_record`,
  which writes the record of captured layers straight into the `RecordCapturer` staging rows; the FC2 input gets
  `trace_core.numerics.fc2`'s convention (`fc2_in` role), the top-k weight multiplies the FC2 output;
- K (after QK-norm and RoPE) and V are quantize-dequantized (`k`, `v` roles: `kv_fp4`, or NVFP4 at the static unit
  global scale) as they enter the KV cache, with records of captured layers; attention reads the quantized cache,
  as from SGLang's FP4 pool.
Both modes stage every MoE layer's top-k routes for R3; an `ActivationTap` sees every site's rows (analyses).
Generation is batched with a KV cache; prompts share one length, so token (b, position p) lives in KV slot
`b * max_len + p` of the capturer's record store.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3MoeForCausalLM

from trace_core.numerics.fc2 import fc2_input_fake_quant
from trace_core.numerics.recipe import PrecisionRecipe
from trace_core.numerics.role_quant import rollout_rtn, weight_rtn
from trace_core.records.capture import RecordCapturer
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import ModelShape, RecordSpec

EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class WorkerDied(RuntimeError):
    """The rollout worker was killed while generating."""


@dataclass(frozen=True)
class Trajectory:
    """One sampled response: `tokens` = prompt + response `[L]`, rollout log-probs of the response tokens `[R]`.

    `recorded`: positions [0, recorded) have records in the store; None = all L (the embedded engine feeds every
    sampled token back; an SGLang server never feeds back the last one, so it records L - 1). `attempt`: the
    rollout attempt whose records count (their `Binding` names it; the trainer checks). `prompt` / `dataset`: the
    id of the prompt it was generated from (`trace_rl.data.Prompt.key`) and the digest of its dataset, set by the
    controller and checked before the trajectory is trained (a resume cannot pair it with another prompt).
    """

    tokens: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    records: TrajectoryRecords | None  # None once the records live only in the store
    recorded: int | None = None
    attempt: str | None = None
    prompt: str | None = None
    dataset: str | None = None

    @property
    def response(self) -> torch.Tensor:
        return self.tokens[self.prompt_len :]


class ActivationTap(Protocol):
    """Sees every site's activation rows in a forward (`x` in, `y` = what the engine uses: FP4 values, or `x` in
    BF16), then the KV slots of that forward's rows (`[b * s]`, batch-major)."""

    def site(self, site: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> None: ...

    def forward_end(self, slots: torch.Tensor) -> None: ...


class _SiteCache(DynamicCache):
    """A DynamicCache whose `update` passes K and V through the engine's KV site first."""

    def __init__(self, site: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], config):
        super().__init__(config=config)
        self._site = site

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        key_states, value_states = self._site(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, cache_kwargs)


def filter_probs(probs: torch.Tensor, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities `[B, V]` with the tokens outside the `top_k` most likely (ties at the k-th kept) and outside
    the smallest set whose mass reaches `top_p` zeroed (unnormalized: `torch.multinomial` normalizes)."""
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(-1) - ranked  # mass of the more likely tokens
        ranked = ranked.masked_fill(before >= top_p * ranked.sum(-1, keepdim=True), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
    return probs


class EmbeddedEngine:
    """Batched sampling with records and routes. `fp4=False` is the BF16 rollout (routes only). `recipe`: the
    precision recipe of the FP4 sites (None: the spec's, else the default), checked against the spec."""

    def __init__(
        self,
        model_dir: str,
        *,
        fp4: bool,
        spec: RecordSpec,
        max_batch: int,
        max_len: int,
        device: str = "cpu",
        recipe: PrecisionRecipe | str | None = None,
    ):
        self.recipe = spec.resolve_recipe(recipe)
        self.model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
        c = self.model.config
        self.fp4, self.device, self.max_len, self.max_batch = fp4, torch.device(device), max_len, max_batch
        self.spec = spec if fp4 else RecordSpec(bits=spec.bits, recipe=spec.recipe)
        shape = ModelShape(hidden=c.hidden_size, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
        self.capturer = RecordCapturer(
            self.spec,
            shape,
            max_tokens=max_batch * max_len,
            num_slots=max_batch * max_len,
            routes=(c.num_hidden_layers, c.num_experts_per_tok),
            device=device,
        )
        self.captured = set(self.spec.sites())
        self.version = 0
        self.alive = True
        self.tap: ActivationTap | None = None
        for i, layer in enumerate(self.model.model.layers):
            layer.mlp.experts.forward = self._experts_forward(i, layer.mlp.experts)
        if fp4:
            self._quantize_experts()

    # ----------------------------------------------------------------- weights
    @torch.no_grad()
    def _quantize_experts(self) -> None:
        for layer in self.model.model.layers:
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                for e in range(w.shape[0]):
                    w[e] = weight_rtn(self.recipe.weights, w[e])

    @torch.no_grad()
    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Load HF Qwen3-MoE checkpoint tensors (`megatron_trace.export.export_hf`, BF16) as policy `version`."""
        if version <= self.version:
            raise ValueError(f"weight update to version {version} is not newer than the engine's {self.version}")
        params = self.model.state_dict()
        updates: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
        for name, t in tensors.items():
            m = EXPERT.fullmatch(name)
            if m:
                experts.setdefault(m[1], {}).setdefault(m[3], []).append((int(m[2]), t))
            elif name in params:
                updates[name] = t
            else:
                raise KeyError(f"weight {name} has no parameter in the engine")
        for prefix, parts in experts.items():
            stack = {k: torch.stack([t for _, t in sorted(v, key=lambda x: x[0])]) for k, v in parts.items()}
            if set(stack) != {"gate_proj", "up_proj", "down_proj"}:
                raise KeyError(f"{prefix}: expert weights {sorted(stack)}, need gate_proj, up_proj and down_proj")
            updates[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
            updates[f"{prefix}.down_proj"] = stack["down_proj"]
        missing = set(params) - set(updates)
        if missing:
            raise KeyError(f"weight update misses {sorted(missing)[:4]} ({len(missing)} tensors)")
        for name, t in updates.items():
            if params[name].shape != t.shape:
                raise ValueError(f"{name}: update of shape {tuple(t.shape)}, engine has {tuple(params[name].shape)}")
        for name, t in updates.items():  # checked in full first: a bad update leaves the engine as it was
            params[name].copy_(t)
        if self.fp4:
            self._quantize_experts()
        self.version = version

    # ----------------------------------------------------------------- FP4 sites
    @property
    def _sites_run(self) -> bool:
        """The activation sites run in FP4 mode, and in BF16 when a tap watches them."""
        return self.fp4 or self.tap is not None

    def _activation(self, site: tuple[int, str], x2d: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize rows `[T, width]` (FP4 mode; BF16 passes them through); the record goes to staging
        when the site is captured."""
        out = self._fp4_activation(site, x2d) if self.fp4 else x2d
        if self.tap is not None:
            self.tap.site(site, x2d, out)
        return out

    def _fp4_activation(self, site: tuple[int, str], x2d: torch.Tensor) -> torch.Tensor:
        record = self.capturer.staging_rows(site, x2d.shape[0]) if site in self.captured else None
        return rollout_rtn(self.recipe.role(site[1]), x2d, self.spec.bits, record)

    def _kv_site(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for kind, t in (("k", k), ("v", v)):
            b, h, s, d = t.shape
            rows = t.transpose(1, 2).reshape(b * s, h * d).contiguous()
            out.append(self._activation((layer, kind), rows).view(b, s, h, d).transpose(1, 2))
        return out[0], out[1]

    def _experts_forward(self, layer: int, experts: torch.nn.Module) -> Callable:
        def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            self.capturer.stage_routes(layer, top_k_index)
            if self._sites_run:
                hidden = self._activation((layer, "moe_in"), hidden.contiguous())
            out = torch.zeros_like(hidden)
            for e in top_k_index.unique().tolist():
                token, slot = torch.where(top_k_index == e)
                gate, up = F.linear(hidden[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = experts.act_fn(gate) * up
                if self.fp4:
                    h = fc2_input_fake_quant(h.contiguous(), self.recipe.fc2_in)
                y = F.linear(h, experts.down_proj[e]) * top_k_weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
            return out

        return forward

    # ----------------------------------------------------------------- generation
    def _forward(self, ids: torch.Tensor, cache: DynamicCache, start: int) -> torch.Tensor:
        if not self.alive:
            raise WorkerDied("rollout engine was killed")
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        b, s = ids.shape
        slots = (torch.arange(b)[:, None] * self.max_len + start + torch.arange(s)).reshape(-1)
        slots = slots.to(self.device)
        self.capturer.on_forward_end(slots)
        if self.tap is not None:
            self.tap.forward_end(slots)
        if not self.alive:
            raise WorkerDied("rollout engine was killed")
        return logits[:, -1].float()

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        max_new: int,
        *,
        eos: int | Sequence[int],
        seed: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
    ) -> list[Trajectory]:
        """Sample one response per prompt row (`[B, P]`, one length) until an EOS id or `max_new` tokens, from the
        temperature-scaled distribution truncated by `top_k` / `top_p` (`filter_probs`; off at -1 / 1.0). The kept
        log-prob of a token is the untruncated one, as SGLang and vLLM report it by default, so the train / rollout
        mismatch metrics measure the numerics, not the truncation."""
        b, p = prompts.shape
        if b > self.max_batch or p + max_new > self.max_len:
            raise ValueError(f"batch {b} x {p}+{max_new} tokens exceeds the engine ({self.max_batch} x {self.max_len})")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos_ids = torch.tensor([eos] if isinstance(eos, int) else list(eos), device=self.device)
        cache = (
            _SiteCache(self._kv_site, self.model.config) if self._sites_run else DynamicCache(config=self.model.config)
        )
        logits = self._forward(prompts.to(self.device), cache, 0)
        tokens, logps = [], []
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        for t in range(max_new):
            logp = torch.log_softmax(logits / temperature, dim=-1)
            probs = logp.exp() if top_k == -1 and top_p == 1.0 else filter_probs(logp.exp(), top_k, top_p)
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            tokens.append(tok)
            logps.append(logp.gather(1, tok[:, None]).squeeze(1))
            done |= torch.isin(tok, eos_ids)
            # Every sampled token is fed back once, so each trajectory has records (and routes) at all positions.
            logits = self._forward(tok[:, None], cache, p + t)
            if bool(done.all()):
                break
        tokens_bt, logps_bt = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu()
        rows = self._gather_batch(b, p + tokens_bt.shape[1])
        out = []
        for i in range(b):
            ends = torch.isin(tokens_bt[i], eos_ids.cpu()).nonzero()
            r = int(ends[0]) + 1 if ends.numel() else tokens_bt.shape[1]
            full = torch.cat([prompts[i].cpu(), tokens_bt[i, :r]])
            out.append(Trajectory(full, p, logps_bt[i, :r], self.capturer.read(rows[i, : len(full)])))
        return out

    def _gather_batch(self, b: int, length: int) -> torch.Tensor:
        """Store rows of positions [0, length) of every batch row (all were fed forward), copied to the host in one
        transfer, `[b, length, row_bytes]`; then the batch's slots are released. One copy for the batch: gathering
        each trajectory on the device and copying its record fields one by one costs a host sync per field (57 per
        trajectory on the 8-layer `small` preset with every site recorded), which made rollouts on a shared GPU
        slow (bench/rollout_finish.py)."""
        slots = (torch.arange(b)[:, None] * self.max_len + torch.arange(length)).reshape(-1)
        rows = self.capturer.gather_rows(slots).cpu().view(b, length, -1)
        self.capturer.release(torch.arange(b * self.max_len))
        return rows
