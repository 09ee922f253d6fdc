"""KV records read out of SGLang's FP4 KV pool (`MHATokenToKVPoolFP4`, `--kv-cache-dtype fp4_e2m1`).

The pool already holds what the rollout attended over: per slot and layer, packed E2M1 codes `[H, D/2]` (element
2i in the low nibble) and one E8M0 byte per 16 elements `[H*D/16]` — exactly `trace_core`'s `kv_fp4` format. A
finished request's K/V records are therefore read, not recomputed: its slots are `req_to_token[req_pool_idx,
:seqlen-1]` (the last token's KV may still be in flight under the overlap scheduler, SGLang's R3 convention), and
the read must happen before the request's KV is released. Under attention TP each rank holds its KV heads; the
rank shards are concatenated along the head axis (`merge_tp_shards`) into full-width rows. Hybrid
linear-attention models keep their full-attention layers' KV in an FP4 pool inside `HybridLinearKVPool` once patch
0010 is applied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trace_core.e2m1 import unpack_fp4
from trace_core.formats import KV_FP4
from trace_core.records import Record, pack_low_bits
from trace_core.store import Site

KV_BLOCK = KV_FP4.block


def check_fp4_pool(pool) -> None:
    """Raise ValueError unless `pool` stores FP4 codes and E8M0 scales per layer (MHATokenToKVPoolFP4's layout)."""
    kind = type(pool).__name__
    scales = getattr(pool, "k_scale_buffer", None)
    if scales is None or getattr(pool, "store_dtype", None) != torch.uint8:
        raise ValueError(
            f"KV records need SGLang's FP4 KV pool (MHATokenToKVPoolFP4, --kv-cache-dtype fp4_e2m1); got {kind}"
        )
    if pool.head_dim % KV_BLOCK:
        raise ValueError(f"{kind}: head dim {pool.head_dim} is not a multiple of the FP4 block {KV_BLOCK}")


def request_slots(req_to_token: torch.Tensor, req_pool_idx: int, seqlen: int) -> torch.Tensor:
    """KV slots of positions [0, seqlen - 1) of one request (the positions every record of it covers)."""
    if seqlen < 1 or seqlen > req_to_token.shape[1] + 1:
        raise ValueError(f"seqlen {seqlen} outside [1, {req_to_token.shape[1] + 1}]")
    return req_to_token[req_pool_idx, : seqlen - 1]


def _layer_index(pool, layer: int) -> tuple[object, int]:
    """(FP4 pool, buffer index) of model layer `layer`; a hybrid pool keeps full-attention layers in `full_kv_pool`."""
    mapping = getattr(pool, "full_attention_layer_id_mapping", None)
    if mapping is not None:
        if layer not in mapping:
            raise ValueError(f"layer {layer} is not a full-attention layer of this pool ({sorted(mapping)})")
        return pool.full_kv_pool, mapping[layer]
    local = layer - pool.start_layer
    if not 0 <= local < pool.layer_num:
        raise ValueError(f"layer {layer} is not in this pool (layers {pool.start_layer}..{pool.end_layer - 1})")
    return pool, local


def gather_kv_shard(
    pool, slots: torch.Tensor, layers: Sequence[int], kinds: Sequence[str], bits: int
) -> dict[Site, Record]:
    """This rank's K/V records of `layers` at KV `slots` `[L]`: rows of `head_num * head_dim` elements.

    Reads the pool's codes and scale bytes (no requantization) and keeps the low `bits` of each code. `pool` is an
    `MHATokenToKVPoolFP4` or a `HybridLinearKVPool` holding one (patch 0010)."""
    check_fp4_pool(getattr(pool, "full_kv_pool", pool))
    out: dict[Site, Record] = {}
    for layer in layers:
        fp4, local = _layer_index(pool, layer)
        slots = slots.to(device=fp4.k_buffer[0].device, dtype=torch.int64)
        for kind in kinds:
            codes_buf = fp4.k_buffer if kind == "k" else fp4.v_buffer
            scale_buf = fp4.k_scale_buffer if kind == "k" else fp4.v_scale_buffer
            packed = codes_buf[local][slots]  # uint8 [L, H, D/2]
            codes = unpack_fp4(packed).reshape(slots.shape[0], -1)  # [L, H*D]
            scales = scale_buf[local][slots]  # uint8 [L, H*D/16]
            out[(layer, kind)] = Record(KV_FP4, bits, codes.shape[1], pack_low_bits(codes, bits), scales, None)
    return out


def merge_tp_shards(shards: Sequence[dict[Site, Record]], tp_size: int, num_kv_heads: int) -> dict[Site, Record]:
    """Full-width records from the attention-TP ranks' shards (rank order). When tp_size exceeds the KV heads,
    SGLang replicates each head group over `tp_size // num_kv_heads` ranks; one replica of each is kept."""
    if len(shards) != tp_size:
        raise ValueError(f"expected {tp_size} KV record shards (one per attention-TP rank), got {len(shards)}")
    replicas = max(1, tp_size // num_kv_heads)
    if tp_size % replicas:
        raise ValueError(f"tp_size {tp_size} does not split {num_kv_heads} KV heads evenly")
    unique = list(shards[::replicas])
    merged: dict[Site, Record] = {}
    for site in unique[0]:
        parts = [s[site] for s in unique]
        # a shard is whole heads, a multiple of 16 elements, so its packed low bits end on a byte boundary
        low = torch.cat([p.low_bits for p in parts], dim=-1)
        scales = torch.cat([p.scales for p in parts], dim=-1)
        merged[site] = Record(KV_FP4, parts[0].bits, sum(p.n for p in parts), low, scales, None)
    return merged


def gather_kv_records(
    pool,
    slots: torch.Tensor,
    layers: Sequence[int],
    kinds: Sequence[str],
    bits: int,
    *,
    num_kv_heads: int,
    tp_group=None,
) -> dict[Site, Record]:
    """K/V records of a request at `slots`, full width across attention TP.

    `num_kv_heads`: the model's KV heads (all ranks). `tp_group`: the attention-TP process group (every rank calls
    this in lockstep, as the scheduler does at request finish); None for a single rank. Records travel over the
    group as uint8 tensors."""
    local = gather_kv_shard(pool, slots, layers, kinds, bits)
    if tp_group is None:
        if pool.head_num != num_kv_heads:
            raise ValueError(f"pool holds {pool.head_num} of {num_kv_heads} KV heads but no TP group was given")
        return local
    import torch.distributed as dist

    size = dist.get_world_size(tp_group)
    shards: list[dict[Site, Record]] = [dict() for _ in range(size)]
    for site, rec in local.items():
        lows = [torch.empty_like(rec.low_bits) for _ in range(size)]
        scales = [torch.empty_like(rec.scales) for _ in range(size)]
        dist.all_gather(lows, rec.low_bits.contiguous(), group=tp_group)
        dist.all_gather(scales, rec.scales.contiguous(), group=tp_group)
        for r in range(size):
            shards[r][site] = Record(KV_FP4, bits, rec.n, lows[r], scales[r], None)
    return merge_tp_shards(shards, size, num_kv_heads)
