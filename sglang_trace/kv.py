"""KV records read out of SGLang's FP4 KV pool (`MHATokenToKVPoolFP4`, `--kv-cache-dtype fp4_e2m1`).

The pool already holds what the rollout attended over: per slot and layer, packed E2M1 codes `[H, D/2]` (element
2i in the low nibble) and one scale byte per 16 elements `[H*D/16]`: E8M0, exactly `trace_core`'s `kv_fp4` format,
or, under a recipe whose K/V are NVFP4, an E4M3 byte written by TRACE's quantizer (`hooks.kv_pool_quantize`; global
scale S_enc = 1, the recipe's `Scale.STATIC`). A
finished request's K/V records are therefore read, not recomputed: its slots are `req_to_token[req_pool_idx,
:seqlen-1]` (the last token's KV may still be in flight under the overlap scheduler, SGLang's R3 convention), and
the read must happen before the request's KV is released. Under attention TP each rank holds its KV heads; the
rank shards are concatenated along the head axis (`merge_tp_shards`) into full-width rows. Hybrid
linear-attention models keep their full-attention layers' KV in an FP4 pool inside `HybridLinearKVPool` once patch
0010 is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from trace_core.numerics.formats import KV_FP4, FP4Format
from trace_core.numerics.recipe import Role
from trace_core.records.spec import Record, check_bits, pack_low_bits_of_fp4, packed_len
from trace_core.sites import Site

KV_BLOCK = KV_FP4.block


def check_fp4_pool(pool) -> None:
    """Raise ValueError unless `pool` stores FP4 codes and one scale byte per 16 elements per layer
    (MHATokenToKVPoolFP4's layout)."""
    kind = type(pool).__name__
    scales = getattr(pool, "k_scale_buffer", None)
    if scales is None or getattr(pool, "store_dtype", None) != torch.uint8:
        raise ValueError(
            f"KV records need SGLang's FP4 KV pool (MHATokenToKVPoolFP4, --kv-cache-dtype fp4_e2m1); got {kind}"
        )
    if pool.head_dim % KV_BLOCK:
        raise ValueError(f"{kind}: head dim {pool.head_dim} is not a multiple of the FP4 block {KV_BLOCK}")


def pool_role() -> Role | None:
    """The K/V role whose rows TRACE writes into this server's FP4 KV pool: None (SGLang's own `kv_fp4`) unless
    TRACE is on under a recipe whose K/V are NVFP4 (`check_server_args` accepts NVFP4 only with its static unit
    global scale)."""
    from sglang.srt.server_args import get_global_server_args

    from trace_core.numerics.recipe import get_recipe

    try:
        args = get_global_server_args()
    except ValueError:  # a pool outside a server (SGLang publishes the arguments before it builds one)
        return None
    if getattr(args, "trace_mode", "off") == "off":
        return None
    role = get_recipe(args.trace_recipe).k
    if not isinstance(role.fmt, FP4Format):  # check_server_args refuses such a recipe with the FP4 pool
        raise ValueError(f"--trace-recipe {args.trace_recipe}: K / V as {role.fmt.name}, not an FP4 KV pool format")
    return None if role.fmt is KV_FP4 else role


def pool_format() -> FP4Format:
    """The format of this server's FP4 KV pool rows (`pool_role`'s, or SGLang's `kv_fp4`)."""
    role = pool_role()
    return KV_FP4 if role is None else role.fmt  # type: ignore[return-value]  # pool_role checked it is FP4


def request_slots(req_to_token: torch.Tensor, req_pool_idx: int, seqlen: int) -> torch.Tensor:
    """KV slots of positions [0, seqlen - 1) of one request (the positions every record of it covers)."""
    if seqlen < 1 or seqlen > req_to_token.shape[1] + 1:
        raise ValueError(f"seqlen {seqlen} outside [1, {req_to_token.shape[1] + 1}]")
    return req_to_token[req_pool_idx, : seqlen - 1]


def _layer_index(pool, layer: int) -> tuple[Any, int]:
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


def gather_kv_raw(pool, slots: torch.Tensor, layers: Sequence[int], kinds: Sequence[str]) -> torch.Tensor:
    """This rank's raw K/V bytes of `layers` x `kinds` at KV `slots` `[L]`: one uint8 tensor `[L, sites * (W/2 +
    W/16)]` (W = head_num * head_dim; per site the packed E2M1 codes then the E8M0 bytes), on the pool's device.

    Two index ops per site and one concatenation, once per result batch for all its finished requests (the
    capturer runs `KVGather`, its one-launch twin, then keeps the low bits on the same device, `kv_rows_from_raw`)."""
    check_fp4_pool(getattr(pool, "full_kv_pool", pool))
    parts = []
    for layer in layers:
        fp4, local = _layer_index(pool, layer)
        slots = slots.to(device=fp4.k_buffer[0].device, dtype=torch.int64)
        for kind in kinds:
            codes_buf = fp4.k_buffer if kind == "k" else fp4.v_buffer
            scale_buf = fp4.k_scale_buffer if kind == "k" else fp4.v_scale_buffer
            parts.append(codes_buf[local][slots].flatten(1))  # uint8 [L, W/2]
            parts.append(scale_buf[local][slots].flatten(1))  # uint8 [L, W/16]
    return torch.cat(parts, dim=1)


def kv_record(fmt: FP4Format, bits: int, width: int, low_bits: torch.Tensor, scales: torch.Tensor) -> Record:
    """A K/V record of pool rows in `fmt`: NVFP4 rows carry the pool's static S_enc = 1 as their global scale."""
    if fmt.block != KV_BLOCK:
        raise ValueError(f"the FP4 KV pool holds one scale byte per {KV_BLOCK} elements; {fmt.name} has {fmt.block}")
    rows = scales.shape[0]
    gs = torch.ones(rows, 1, dtype=torch.float32, device=scales.device) if fmt.has_global_scale else None
    return Record(fmt, bits, width, low_bits, scales, gs)


KV_SITE_GROUP = 16  # sites converted per pass of `kv_rows_from_raw`: bounds its temporaries to 16 sites' codes


def kv_row_bytes(num_sites: int, width: int, bits: int) -> int:
    """Bytes per token of `kv_rows_from_raw`'s K/V record rows: per site, the packed low bits, then the scales."""
    return num_sites * (packed_len(width, bits) + width // KV_BLOCK)


def kv_rows_from_raw(
    raw: torch.Tensor, num_sites: int, width: int, bits: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """K/V record rows `[L, kv_row_bytes]` from raw pool rows (`gather_kv_raw`'s layout: per site the packed
    codes, then the scale bytes; `width` elements per site row): each code's low `bits`, then the scales. Runs on
    the rows' device, so the finish path copies and writes these rows, not the 4-bit codes."""
    codes_len, scales_len = width // 2, width // KV_BLOCK
    low_len = packed_len(width, bits)
    if raw.shape[1] != num_sites * (codes_len + scales_len):
        raise ValueError(f"raw K/V rows of {raw.shape[1]} bytes do not hold {num_sites} sites of {width}")
    rows = raw.shape[0]
    if out is None:
        out = torch.empty(rows, kv_row_bytes(num_sites, width, bits), dtype=torch.uint8, device=raw.device)
    per_site = raw.view(rows, num_sites, codes_len + scales_len)
    dst = out.view(rows, num_sites, low_len + scales_len)
    for g in range(0, num_sites, KV_SITE_GROUP):
        dst[:, g : g + KV_SITE_GROUP, :low_len] = pack_low_bits_of_fp4(
            per_site[:, g : g + KV_SITE_GROUP, :codes_len], bits
        )
    dst[..., low_len:] = per_site[..., codes_len:]
    return out


def kv_records_from_rows(
    rows: torch.Tensor, layers: Sequence[int], kinds: Sequence[str], width: int, bits: int, fmt: FP4Format = KV_FP4
) -> dict[Site, Record]:
    """Records of the sites in K/V record rows (`kv_rows_from_raw`'s layout, `width` elements per site row, this
    shard's), in the pool's format `fmt`."""
    sites = [(layer, kind) for layer in layers for kind in kinds]
    low_len = packed_len(width, bits)
    if rows.shape[1] != kv_row_bytes(len(sites), width, bits):
        raise ValueError(f"K/V record rows of {rows.shape[1]} bytes do not hold {len(layers)}x{len(kinds)} sites")
    per_site = rows.view(rows.shape[0], len(sites), low_len + width // KV_BLOCK).transpose(0, 1)
    # one site-major copy of each field, not two copies per site: a request's sites are views of these
    lows, scales = per_site[..., :low_len].contiguous(), per_site[..., low_len:].contiguous()
    return {site: kv_record(fmt, bits, width, lows[i], scales[i]) for i, site in enumerate(sites)}


def kv_records_from_raw(
    raw: torch.Tensor, layers: Sequence[int], kinds: Sequence[str], width: int, bits: int, fmt: FP4Format = KV_FP4
) -> dict[Site, Record]:
    """Records (low `bits` of each code, scale bytes) of the sites in `raw` (`gather_kv_raw`'s layout; `width`
    elements per site row, this shard's), in the pool's format `fmt`."""
    rows = kv_rows_from_raw(raw, len(layers) * len(kinds), width, bits)
    return kv_records_from_rows(rows, layers, kinds, width, bits, fmt)


def gather_kv_shard(
    pool, slots: torch.Tensor, layers: Sequence[int], kinds: Sequence[str], bits: int, fmt: FP4Format = KV_FP4
) -> dict[Site, Record]:
    """This rank's K/V records of `layers` at KV `slots` `[L]`: rows of `head_num * head_dim` elements.

    Reads the pool's codes and scale bytes (no requantization) and keeps the low `bits` of each code. `pool` is an
    `MHATokenToKVPoolFP4` or a `HybridLinearKVPool` holding one (patch 0010)."""
    check_bits(bits)
    fp4 = getattr(pool, "full_kv_pool", pool)
    raw = gather_kv_raw(pool, slots, layers, kinds)
    return kv_records_from_raw(raw, layers, kinds, fp4.head_num * fp4.head_dim, bits, fmt)


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
        merged[site] = kv_record(parts[0].fmt, parts[0].bits, sum(p.n for p in parts), low, scales)
    return merged


def gather_to_first(shard: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Every rank's host tensor `shard` (same shape on all ranks), in rank order, on the group's first rank (None
    elsewhere): one `gather` over `group` (a gloo group; every rank calls this in the same order)."""
    import torch.distributed as dist

    first = dist.get_global_rank(group, 0)
    if dist.get_rank(group) != 0:
        dist.gather(shard, None, dst=first, group=group)
        return None
    received = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.gather(shard, received, dst=first, group=group)
    return received


def kv_records_from_shards(
    rows: Sequence[torch.Tensor],
    layers: Sequence[int],
    kinds: Sequence[str],
    bits: int,
    *,
    shard_width: int,
    num_kv_heads: int,
    fmt: FP4Format = KV_FP4,
) -> dict[Site, Record]:
    """Full-width K/V records in the pool's format `fmt` from the TP ranks' K/V record rows (`kv_rows_from_raw`;
    rank order; one shard: no merge)."""
    shards = [kv_records_from_rows(r, layers, kinds, shard_width, bits, fmt) for r in rows]
    return shards[0] if len(shards) == 1 else merge_tp_shards(shards, len(shards), num_kv_heads)


def gather_kv_records(
    pool,
    slots: torch.Tensor,
    layers: Sequence[int],
    kinds: Sequence[str],
    bits: int,
    *,
    num_kv_heads: int,
    fmt: FP4Format = KV_FP4,
) -> dict[Site, Record]:
    """K/V records of a request at `slots` on one rank holding all `num_kv_heads` KV heads (under attention TP the
    capturer gathers the ranks' K/V record rows with `gather_to_first`, merged by `kv_records_from_shards`)."""
    check_bits(bits)
    fp4 = getattr(pool, "full_kv_pool", pool)
    if fp4.head_num != num_kv_heads:
        raise ValueError(f"pool holds {fp4.head_num} of {num_kv_heads} KV heads but no TP group was given")
    width = fp4.head_num * fp4.head_dim
    rows = kv_rows_from_raw(gather_kv_raw(pool, slots, layers, kinds), len(layers) * len(kinds), width, bits)
    return kv_records_from_shards([rows], layers, kinds, bits, shard_width=width, num_kv_heads=num_kv_heads, fmt=fmt)
