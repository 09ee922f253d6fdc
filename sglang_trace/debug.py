"""Debug tap (`--trace-debug-layer L`, off by default): keep what the server's kernels consumed at one layer, so a
test can check the records against it.

At MoE layer L the tap keeps the quantize-dequantized MoE input the expert GEMMs ran on (`[tokens, hidden]`) and
the FC2 input the second GEMM ran on (`[tokens, topk, intermediate]`, the fused path's (token, top-k) rows); both
are staged inside the forward (a `copy_` into fixed rows, CUDA-graph safe) and stored by KV slot after it, like
the records. At attention layer L it keeps the FP4 pool's K and V bytes (codes and scale bytes) of the request's
slots: what the FP4-KV attention reads. A finished request's tensors are written to
`<store>/debug/<trajectory>#<attempt>.pt` before its KV is released. Memory: one BF16 row per KV slot and site,
so only for small test models.
"""

from __future__ import annotations

from pathlib import Path

import torch


class DebugTap:
    """Slot-keyed copies of MoE layer `layer`'s consumed MoE input and FC2 input, and the K/V pool bytes of
    attention layer `layer` at finish."""

    def __init__(
        self,
        layer: int,
        *,
        hidden: int,
        topk: int,
        intermediate: int,
        max_tokens: int,
        num_slots: int,
        device: torch.device | str,
        kv_pool=None,
    ) -> None:
        self.layer, self.topk, self.kv_pool = layer, topk, kv_pool
        self.staging = {
            "moe_in": torch.zeros(max_tokens, hidden, dtype=torch.bfloat16, device=device),
            "fc2_in": torch.zeros(max_tokens, topk, intermediate, dtype=torch.bfloat16, device=device),
        }
        self.store = {
            k: torch.zeros(num_slots, *v.shape[1:], dtype=v.dtype, device=device) for k, v in self.staging.items()
        }

    def moe_input(self, layer_id: int, x: torch.Tensor) -> None:
        """The experts of `layer_id` run on `x` `[T, hidden]`."""
        if layer_id == self.layer:
            self.staging["moe_in"][: x.shape[0]].copy_(x)

    def fc2_input(self, layer_id: int, h: torch.Tensor) -> None:
        """FC2 of `layer_id` runs on `h` `[T * topk, intermediate]` ((token, top-k) order)."""
        if layer_id == self.layer:
            rows = h.shape[0] // self.topk
            self.staging["fc2_in"][:rows].copy_(h.view(rows, self.topk, -1))

    def on_forward_end(self, out_cache_loc: torch.Tensor) -> None:
        """Store the forward's staged rows at its KV slots."""
        slots, n = out_cache_loc.long(), out_cache_loc.shape[0]
        for name, staged in self.staging.items():
            self.store[name].index_copy_(0, slots, staged[:n])

    def save(self, path: Path, slots: torch.Tensor) -> None:
        """Write a finished request's tensors (positions of `slots`) to `path` (synchronous: debug only)."""
        slots = slots.long()
        out = {name: store[slots].cpu() for name, store in self.store.items()}
        if self.kv_pool is not None:
            from sglang_trace.fp4_attention import _layer_fp4

            kc, ks, vc, vs = _layer_fp4(self.kv_pool, self.layer)
            out |= {
                "k_codes": kc[slots].cpu(),
                "k_scales": ks[slots].cpu(),
                "v_codes": vc[slots].cpu(),
                "v_scales": vs[slots].cpu(),
            }
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
