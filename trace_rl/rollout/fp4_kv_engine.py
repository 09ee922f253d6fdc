"""The embedded engine with SGLang's FP4-KV decode attention.

`FP4AttentionEngine` is the FP4 `EmbeddedEngine` whose K and V also go, as codes and scale bytes (E8M0 for `kv_fp4`,
E4M3 for NVFP4 KV under its static unit global scale: `trace_core.numerics.role_quant.kv_pool_bytes`), into a paged FP4
pool in SGLang's `MHATokenToKVPoolFP4` layout (per layer: codes `[slots, kv_heads, D/2]`, scales
`[slots, kv_heads * D / 16]`; token (b, position p) in slot `b * max_len + p`, as the engine's records). Decode
steps attend by reading that pool: `trace_core.kernels.fp4_attention.fp4_decode_attention` on CUDA (SGLang's triton
decode math), its pure-torch twin `trace_core.numerics.kv_attention.decode_attention_reference` elsewhere. The prefill
attends over the dequantized values with SDPA, as before (SGLang's extend path also reads dequantized values).
The engine counts its decode reads of the pool (`decode_reads`, one per layer and decode forward). The RL config
selects it with `fp4_attention = "decode"` (`trace_rl.rollout.workers.RolloutWorker`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from trace_core.kernels.fp4_attention import MIN_HEAD_DIM, fp4_decode_attention
from trace_core.numerics.kv_attention import decode_attention_reference
from trace_core.numerics.role_quant import kv_pool_bytes, kv_pool_format
from trace_rl.rollout.engine import EmbeddedEngine

ATTENTION = "trace_fp4_kv"
KV_SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def _attention(module, query, key, value, attention_mask, **kwargs):
    """Transformers attention function: decode (one query position) from the engine's FP4 pool, prefill by SDPA."""
    if query.shape[2] != 1:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    out = module.trace_fp4_kv_engine.decode_attention(module.layer_idx, query[:, :, 0], kwargs["scaling"])
    return out[:, None], None  # [b, 1, heads, D]


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class FP4AttentionEngine(EmbeddedEngine):
    """`EmbeddedEngine(fp4=True)` whose decode attention reads an FP4 paged KV pool (module docstring)."""

    def __init__(self, model_dir: str, *, spec, max_batch: int, max_len: int, device: str = "cpu"):
        super().__init__(model_dir, fp4=True, spec=spec, max_batch=max_batch, max_len=max_len, device=device)
        self.kv_fmt = kv_pool_format(self.recipe.k)  # K and V share it (PrecisionRecipe)
        c = self.model.config
        heads, d = c.num_key_value_heads, c.head_dim
        if self.device.type == "cuda" and d < MIN_HEAD_DIM:
            raise ValueError(f"FP4AttentionEngine on CUDA needs head dim >= {MIN_HEAD_DIM} (the kernel's), got {d}")
        slots = max_batch * max_len
        self.kv_pool = {
            (layer, kind): (
                torch.zeros(slots, heads, d // 2, dtype=torch.uint8, device=self.device),
                torch.zeros(slots, heads * d // self.kv_fmt.block, dtype=torch.uint8, device=self.device),
            )
            for layer in range(c.num_hidden_layers)
            for kind in ("k", "v")
        }
        self._start = 0
        self._slots: torch.Tensor | None = None
        self.decode_reads = 0  # decode attention calls that read the pool (one per layer and decode forward)
        self.model.set_attn_implementation(ATTENTION)
        for layer in self.model.model.layers:
            layer.self_attn.trace_fp4_kv_engine = self

    def _forward(self, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
        b, s = ids.shape
        self._start = start
        self._slots = (torch.arange(b)[:, None] * self.max_len + start + torch.arange(s)).reshape(-1).to(self.device)
        return super()._forward(ids, cache, start)

    def _fp4_activation(self, site: tuple[int, str], x2d: torch.Tensor) -> torch.Tensor:
        out = super()._fp4_activation(site, x2d)
        if site[1] in ("k", "v"):  # the codes and scale bytes into the pool
            codes, scales = self.kv_pool[site]
            low, sc = kv_pool_bytes(self.recipe.role(site[1]), x2d)
            codes[self._slots] = low.view(-1, *codes.shape[1:])
            scales[self._slots] = sc
        return out

    def decode_pages(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SGLang's decode paging of the current step for `b` rows: (kv_indptr int32 `[b + 1]`, kv_indices int64 of
        positions [0, start] of each row's slots, num_kv_splits int32 `[b]`)."""
        n = self._start + 1
        indices = (torch.arange(b)[:, None] * self.max_len + torch.arange(n)).reshape(-1).to(self.device)
        indptr = (torch.arange(b + 1) * n).to(device=self.device, dtype=torch.int32)
        splits = torch.full((b,), KV_SPLITS, dtype=torch.int32, device=self.device)
        return indptr, indices, splits

    def decode_attention(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention `[b, heads, D]` of one new position per row over positions [0, start] of the row's slots."""
        b, heads, d = q.shape
        self.decode_reads += 1
        indptr, indices, splits = self.decode_pages(b)
        (kc, ks), (vc, vs) = self.kv_pool[(layer, "k")], self.kv_pool[(layer, "v")]
        q = q.contiguous()
        if not q.is_cuda:
            return decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, splits, scaling, kv_fmt=self.kv_fmt)
        o = torch.empty_like(q)
        logits = torch.empty(b, heads, KV_SPLITS, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, heads, KV_SPLITS, dtype=torch.float32, device=q.device)
        fp4_decode_attention(q, kc, ks, vc, vs, o, indptr, indices, logits, lse, splits, KV_SPLITS, scaling,
                             kv_fmt=self.kv_fmt)  # fmt: skip
        return o

    def take_decode_reads(self) -> int:
        """`decode_reads` since the last call (then reset to 0)."""
        reads, self.decode_reads = self.decode_reads, 0
        return reads
