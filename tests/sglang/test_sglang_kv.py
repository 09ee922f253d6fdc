"""K/V records read from SGLang's real FP4 KV pool (`MHATokenToKVPoolFP4`, sglang 0.5.15.post1, on CPU).

The pool is written through its own `set_kv_buffer` (SGLang's `KVFP4QuantizeUtil`, torch.compile'd as in serving);
the records `sglang_trace.kv` reads back by a request's `req_to_token` slots must equal `trace_core`'s `kv_fp4`
quantization of the same K/V bit for bit: low code bits and E8M0 scale bytes.

`set_kv_buffer` imports `cuda_graph_runner` (for `get_is_capture_mode`), whose imports reach the compiled
`sgl_kernel`; where that package is absent, `tests/sglang_cpu.py` installs an import stand-in. Nothing on the tested
path calls into it (its placeholders raise if called).
"""

import pytest
import torch

from tests.sglang_cpu import install_sgl_kernel_stand_in, load_trace_plugin

load_trace_plugin()  # the hybrid pool's FP4 choice is the plugin's hook on HybridLinearKVPool.__init__

import sglang.srt.mem_cache.memory_pool as memory_pool  # noqa: E402

from sglang_trace.kv import (  # noqa: E402
    KV_SITE_GROUP,
    gather_kv_records,
    gather_kv_shard,
    kv_records_from_raw,
    merge_tp_shards,
    request_slots,
)
from trace_core.numerics.e2m1 import unpack_fp4  # noqa: E402
from trace_core.numerics.formats import KV_FP4, NVFP4  # noqa: E402
from trace_core.numerics.quant import quantize  # noqa: E402
from trace_core.numerics.recipe import get_recipe  # noqa: E402
from trace_core.numerics.role_quant import fake_quant, quantize_role  # noqa: E402
from trace_core.records.spec import Record, pack_low_bits  # noqa: E402

HEADS, HEAD_DIM, LAYERS, SLOTS = 4, 32, 3, 64


def fp4_pool(heads: int = HEADS, start_layer: int = 0) -> "memory_pool.MHATokenToKVPoolFP4":
    return memory_pool.MHATokenToKVPoolFP4(
        size=SLOTS,
        page_size=1,
        dtype=torch.float4_e2m1fn_x2,
        head_num=heads,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        start_layer=start_layer,
        enable_alt_stream=False,
    )


def kv_values(tokens: int, seed: int, heads: int = HEADS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, HEAD_DIM, generator=gen) * torch.logspace(-2, 2, tokens).view(-1, 1, 1)
    x[0, 0, :4] = torch.tensor([0.25, -0.0, 2.5, -1.25])  # ties (rounded up) and a negative zero
    return x.to(torch.bfloat16)


def write(pool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    # set_kv_buffer quantizes in place-ish (optional k_scale division); hand it copies
    pool.set_kv_buffer(None, slots, k.clone(), v.clone(), layer_id_override=layer)


def expected(x: torch.Tensor, bits: int) -> Record:
    q = quantize(x, KV_FP4)  # [L, H, D] codes, [L, H, D/16] scales
    flat = type(q)(
        codes=q.codes.reshape(x.shape[0], -1), scales=q.scales.reshape(x.shape[0], -1), global_scale=None, fmt=KV_FP4
    )
    return Record.from_quantized(flat, bits)


def assert_same(rec: Record, ref: Record) -> None:
    assert rec.fmt is KV_FP4 and rec.bits == ref.bits and rec.n == ref.n
    assert torch.equal(rec.low_bits, ref.low_bits)
    assert torch.equal(rec.scales, ref.scales)


@pytest.fixture(scope="module")
def req_pool():
    return memory_pool.ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("bits", [1, 4])
def test_records_equal_trace_core_kv_fp4_bit_exactly(req_pool, bits):
    pool = fp4_pool()
    slots = torch.tensor([5, 9, 3, 17, 40, 41, 2, 30], dtype=torch.int64)  # scattered, as an allocator hands them out
    k, v = kv_values(8, 1), kv_values(8, 2)
    for layer in range(LAYERS):
        write(pool, layer, slots, k * (layer + 1), v)
    req_pool.req_to_token[1, :8] = slots.to(torch.int32)
    seqlen = 8  # the request's last position has no KV yet (R3 convention: positions [0, seqlen - 1))
    got = gather_kv_records(
        pool, request_slots(req_pool.req_to_token, 1, seqlen), [1, 2], ["k", "v"], bits, num_kv_heads=HEADS
    )
    assert sorted(got) == [(1, "k"), (1, "v"), (2, "k"), (2, "v")]
    assert_same(got[(1, "k")], expected(k[:7] * 2, bits))
    assert_same(got[(2, "k")], expected(k[:7] * 3, bits))
    assert_same(got[(2, "v")], expected(v[:7], bits))


def test_prefix_sharing_and_slot_reuse_after_retraction(req_pool):
    pool = fp4_pool()
    prompt, a_tail, b_tail = kv_values(6, 3), kv_values(3, 4), kv_values(3, 5)
    prefix = torch.arange(10, 16)
    write(pool, 0, prefix, prompt, prompt)
    write(pool, 0, torch.tensor([20, 21, 22]), a_tail, a_tail)
    write(pool, 0, torch.tensor([23, 24, 25]), b_tail, b_tail)
    # two GRPO samples of one prompt: the radix cache hands both the prompt's slots
    req_pool.req_to_token[0, :9] = torch.cat([prefix, torch.tensor([20, 21, 22])]).to(torch.int32)
    req_pool.req_to_token[2, :9] = torch.cat([prefix, torch.tensor([23, 24, 25])]).to(torch.int32)
    rec_a = gather_kv_shard(pool, request_slots(req_pool.req_to_token, 0, 10), [0], ["k"], 1)[(0, "k")]
    rec_b = gather_kv_shard(pool, request_slots(req_pool.req_to_token, 2, 10), [0], ["k"], 1)[(0, "k")]
    assert_same(rec_a, expected(torch.cat([prompt, a_tail]), 1))
    assert_same(rec_b, expected(torch.cat([prompt, b_tail]), 1))
    # request A is retracted: its tail slots are freed and reused by another request before A is recomputed
    other = kv_values(3, 6)
    write(pool, 0, torch.tensor([20, 21, 22]), other, other)
    redo = kv_values(3, 7)
    write(pool, 0, torch.tensor([30, 31, 32]), redo, redo)  # A's recomputed tail lands in new slots
    req_pool.req_to_token[0, 6:9] = torch.tensor([30, 31, 32], dtype=torch.int32)
    rec_a = gather_kv_shard(pool, request_slots(req_pool.req_to_token, 0, 10), [0], ["k"], 1)[(0, "k")]
    assert_same(rec_a, expected(torch.cat([prompt, redo]), 1))


@pytest.fixture(autouse=True)
def pool_outside_a_server():
    """No published server arguments while a test runs (a pool outside a server holds SGLang's kv_fp4); the
    earlier ones again after."""
    from sglang.srt.runtime_context import get_context

    published = get_context()._server_args
    get_context()._server_args = None
    yield
    get_context()._server_args = published


@pytest.fixture
def nvfp4_kv_server():
    """The published server arguments of a scheduler serving the NVFP4-KV recipe (TRACE on)."""
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from tests.sglang_cpu import trace_server_args

    set_global_server_args_for_scheduler(
        trace_server_args("/r", trace_recipe="nvfp4-w4a4-nvfp4kv", kv_cache_dtype="fp4_e2m1", trace_sites="k,v")
    )
    return get_recipe("nvfp4-w4a4-nvfp4kv").k


@pytest.mark.parametrize("chunk", [None, 7])
def test_an_nvfp4_kv_recipe_writes_and_reads_the_pool_in_nvfp4(req_pool, nvfp4_kv_server, chunk, monkeypatch):
    """Under the NVFP4-KV recipe the pool's own `set_kv_buffer` writes TRACE's NVFP4 codes and E4M3 bytes (S_enc = 1)
    through the plugin's quantizer hook; the records read back are the trainer's quantization of the same K/V, and
    SGLang's dequantize path (`get_key_buffer`) returns their values, not an E8M0 reading of the bytes; also when a
    layer is dequantized in row chunks (`chunk`: `DEQUANTIZE_SLOTS`, which bounds the temporaries of a large pool)."""
    from sglang_trace import hooks

    if chunk is not None:
        monkeypatch.setattr(hooks, "DEQUANTIZE_SLOTS", chunk)
    role = nvfp4_kv_server
    pool = fp4_pool()
    slots = torch.tensor([7, 3, 11, 12, 30], dtype=torch.int64)
    k, v = kv_values(5, 11), kv_values(5, 12)
    write(pool, 1, slots, k, v)
    req_pool.req_to_token[3, :5] = slots.to(torch.int32)
    got = gather_kv_records(
        pool, request_slots(req_pool.req_to_token, 3, 6), [1], ["k", "v"], 4, num_kv_heads=HEADS, fmt=role.fmt
    )
    for kind, x in (("k", k), ("v", v)):
        rows = x.reshape(5, -1)
        q = quantize_role(role, rows)
        rec = got[(1, kind)]
        assert rec.fmt is NVFP4 and torch.equal(rec.code_bits(), q.codes) and torch.equal(rec.scales, q.scales)
        assert torch.equal(rec.global_scale, torch.ones(5, 1))
    read = pool.get_key_buffer(1)[slots].reshape(5, -1)
    assert torch.equal(read, fake_quant(role, k.reshape(5, -1)))


@pytest.mark.parametrize(("tp_size", "kv_heads"), [(2, 4), (4, 2)])
def test_tp_shards_merge_into_full_width_records(tp_size, kv_heads):
    """Each attention-TP rank's pool holds its KV heads (replicated when tp_size > heads, as SGLang does)."""
    x = kv_values(5, 8, heads=kv_heads)
    local_heads = max(1, kv_heads // tp_size)
    slots = torch.tensor([1, 2, 3, 4, 5])
    shards = []
    for rank in range(tp_size):
        group = rank // max(1, tp_size // kv_heads)
        part = x[:, group * local_heads : (group + 1) * local_heads]
        pool = fp4_pool(heads=local_heads)
        write(pool, 0, slots, part, part)
        shards.append(gather_kv_shard(pool, slots, [0], ["k", "v"], 2))
    merged = merge_tp_shards(shards, tp_size, kv_heads)
    assert_same(merged[(0, "v")], expected(x, 2))


def test_bad_input_is_named():
    pool = fp4_pool()
    with pytest.raises(ValueError, match="layer 5 is not in this pool"):
        gather_kv_shard(pool, torch.tensor([1]), [5], ["k"], 1)
    with pytest.raises(ValueError, match="record bits"):
        gather_kv_shard(pool, torch.tensor([1]), [0], ["k"], 5)
    bf16 = memory_pool.MHATokenToKVPool(
        size=8,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=32,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    with pytest.raises(ValueError, match="MHATokenToKVPoolFP4"):
        gather_kv_shard(bf16, torch.tensor([1]), [0], ["k"], 1)
    with pytest.raises(ValueError, match="no TP group"):
        gather_kv_records(pool, torch.tensor([1]), [0], ["k"], 1, num_kv_heads=2 * HEADS)
    with pytest.raises(ValueError, match="expected 2 KV record shards"):
        merge_tp_shards([{}], 2, 4)


def test_hybrid_linear_pool_stores_fp4_and_records_full_attention_layers(req_pool):
    """The plugin's hook before `HybridLinearKVPool.__init__` (0.5.10's patch 0010): the hybrid pool (Qwen3-Next)
    builds an FP4 pool for its full-attention layers even where SGLang's KV mixin passes its plain MHA pool class;
    written through the hybrid pool's own `set_kv_buffer`, read back by model layer id. A BF16 hybrid pool keeps
    SGLang's choice."""
    from types import SimpleNamespace

    def hybrid_pool(dtype: torch.dtype):
        return memory_pool.HybridLinearKVPool(
            size=SLOTS,
            dtype=dtype,
            page_size=1,
            head_num=HEADS,
            head_dim=HEAD_DIM,
            full_attention_layer_ids=[3, 7],
            device="cpu",
            mamba_pool=None,
            full_kv_pool_class=memory_pool.MHATokenToKVPool,  # what SGLang's KV mixin passes
        )

    assert type(hybrid_pool(torch.bfloat16).full_kv_pool) is memory_pool.MHATokenToKVPool
    hybrid = hybrid_pool(torch.float4_e2m1fn_x2)
    assert isinstance(hybrid.full_kv_pool, memory_pool.MHATokenToKVPoolFP4)
    k, v = kv_values(5, 9), kv_values(5, 10)
    slots = torch.tensor([3, 1, 4, 15, 9])
    layer = SimpleNamespace(layer_id=7)  # RadixAttention: the hybrid pool reads only its layer_id
    hybrid.set_kv_buffer(layer, slots, k.clone(), v.clone())
    got = gather_kv_shard(hybrid, slots, [7], ["k", "v"], 1)
    assert_same(got[(7, "k")], expected(k, 1))
    assert_same(got[(7, "v")], expected(v, 1))
    with pytest.raises(ValueError, match="not a full-attention layer"):
        gather_kv_shard(hybrid, slots, [5], ["k"], 1)


def moe_inputs(layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What MoE layer `layer` sees in the test forward (the same on every TP rank): routes `[6, 2]`, its dispatched
    input `[6, 64]` and this rank's FC2 input."""
    gen = torch.Generator().manual_seed(40 + layer)
    x = (torch.randn(6, 64, generator=gen) * torch.logspace(-1, 1, 64)).to(torch.bfloat16)
    return torch.arange(12, dtype=torch.int32).view(6, 2) + layer, x, torch.randn(6, 32).to(torch.bfloat16)


def run_rank(rank: int, world: int, group, store: str, return_routes: bool) -> dict:
    """One attention-TP rank of a scheduler (the whole model on one rank when world is 1): a forward writes its KV
    heads and its share of the MoE records and routes; a graph-replayed forward in which MoE layer 1's FusedMoE
    hooks did not run writes two more slots; then three requests finish in one result batch, which moves in one
    transfer with one gather over TRACE's gloo group, and rank 0 merges the shards and writes the store."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_trace.config import ModelLayout
    from tests.sglang_cpu import cpu_capturer, trace_server_args

    server_args = trace_server_args(store, kv_cache_dtype="fp4_e2m1", trace_layers="all", trace_sites="moe_in,k,v")
    layout = ModelLayout("Qwen3MoeForCausalLM", LAYERS, tuple(range(LAYERS)), tuple(range(LAYERS)), 64, HEADS, 32, 2)
    local = HEADS // world
    pool = fp4_pool(heads=local)
    cap = cpu_capturer(
        server_args,
        layout,
        kv_pool=pool,
        num_slots=SLOTS,
        max_request_tokens=32,
        return_routes=return_routes,
        tp_rank=rank,
        tp_size=world,
        trace_group=group,
    )
    extend = SimpleNamespace(forward_mode=ForwardMode.EXTEND, out_cache_loc=torch.tensor([7, 3, 9, 1, 2, 8]))
    experts_ran_on = []
    for layer in range(LAYERS):  # what the model's layers call, in their order
        routes, x, h = moe_inputs(layer)
        cap.capture(layer, routes)
        experts_ran_on.append(cap.moe_input(layer, x))
        cap.fc2_input(layer, h)
        kv = kv_values(6, 20 + layer)[:, rank * local : (rank + 1) * local]
        write(pool, layer, extend.out_cache_loc, kv, -kv)
    cap.on_forward_end(extend, False, None)
    replay = SimpleNamespace(forward_mode=ForwardMode.DECODE, out_cache_loc=torch.tensor([10, 11]))
    for layer in range(LAYERS):
        routes, x, h = moe_inputs(layer)
        cap.capture(layer, routes[:2])
        if layer != 1:
            cap.moe_input(layer, x[:2])
            cap.fc2_input(layer, h[:2])
        kv = kv_values(2, 30 + layer)[:, rank * local : (rank + 1) * local]
        write(pool, layer, replay.out_cache_loc, kv, -kv)
    cap.on_forward_end(replay, True, None)
    req_to_token = memory_pool.ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    req_to_token.req_to_token[0, :4] = torch.tensor([7, 3, 9, 1])
    req_to_token.req_to_token[1, :3] = torch.tensor([7, 2, 8])  # shares the first prompt slot
    req_to_token.req_to_token[2, :3] = torch.tensor([7, 10, 11])  # positions 1, 2: layer 1's hooks did not run
    handles = [
        cap.finish_request(rid, i, n, req_to_token, list(range(n)))
        for i, (rid, n) in enumerate((("a", 5), ("b", 4), ("c", 4)))
    ]
    r3 = cap.get_topk(req_pool_idx=0, seqlen=5, req_to_token_pool=req_to_token) if return_routes and rank == 0 else None
    cap.on_batch_done()
    cap.flush()
    s = cap.stats
    out = dict(
        stats=[s.batches, s.transfers, s.collectives, s.shards_written, s.trajectories_written, s.write_failures],
        record_bytes=cap.records.row.row_bytes,
        experts_ran_on=experts_ran_on,
        handles=handles,
        r3=r3,
    )
    cap.close()
    return out


def _tp_rank(rank: int, world: int, init_file: str, store: str, out: str) -> None:
    import torch.distributed as dist

    install_sgl_kernel_stand_in()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        results = [run_rank(rank, world, group, f"{store}-r3{r3}", r3) for r3 in (False, True)]
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp_ranks_keep_record_shards_and_the_store_equals_one_rank_bit_for_bit(tmp_path):
    """Two scheduler processes on a gloo group, each with half of the KV heads and its share of the MoE layers'
    records, hook markers and routes (about half of one rank's record store; with R3 on, rank 0 keeps every
    route): three requests finishing in one result batch cost one transfer and one gather per rank, and the store
    rank 0 writes from the merged shards equals, bit for bit, the store of one rank holding the whole model (K/V
    and MoE-input records, routes); the records equal the reference quantization. A request with a position whose
    MoE layer owned by rank 1 missed its hooks is refused on rank 0 (the merging rank checks every shard)."""
    import torch.multiprocessing as mp

    from trace_core.records.reader import FailedRecordError, RecordReader
    from trace_core.records.spec import Record

    out = str(tmp_path / "stats")
    mp.spawn(_tp_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "tp2"), out), nprocs=2, join=True)
    tp = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for r3 in (False, True):
        one = run_rank(0, 1, None, str(tmp_path / f"tp1-r3{r3}"), r3)
        ranks = [tp[rank][r3] for rank in range(2)]
        assert one["stats"] == [1, 1, 0, 1, 2, 1]  # batches, transfers, gathers, shards, trajectories, failures
        assert ranks[0]["stats"] == [1, 1, 1, 1, 2, 1]  # a and b in one shard
        assert ranks[1]["stats"] == [1, 1, 1, 0, 0, 0]  # rank 1 sends its shards; rank 0 checks, merges, writes
        # layers 0, 2 on rank 0 and layer 1 on rank 1; R3 keeps every layer's routes on rank 0
        assert ranks[0]["record_bytes"] < one["record_bytes"] and ranks[1]["record_bytes"] < one["record_bytes"] / 2
        unstored = [{k: v for k, v in h.items() if k != "store"} for h in ranks[0]["handles"] + one["handles"]]
        assert unstored[:2] == unstored[3:5] and ranks[1]["handles"] == [None] * 3
        # with R3 on, rank 0 reads its own rows at finish and keeps every layer's routes, which its FusedMoE hooks
        # stage: it sees c's missing hooks there, alone or with two ranks; without R3 the writer thread sees them
        # (rank 1 keeps layer 1's routes); either way c is refused, counted and marked failed
        assert ("error" in one["handles"][2]) == r3 and ("error" in ranks[0]["handles"][2]) == r3
        for rank in range(2):  # every rank's experts ran on the same quantize-dequantized inputs
            assert all(map(torch.equal, ranks[rank]["experts_ran_on"], one["experts_ran_on"]))
        if r3:
            assert torch.equal(ranks[0]["r3"], one["r3"]) and ranks[0]["r3"].shape == (4, LAYERS, 2)
        want = [("a", 0, 4), ("b", 0, 3)]
        got = RecordReader(str(tmp_path / f"tp2-r3{r3}"), 0).load(want)
        ref = RecordReader(str(tmp_path / f"tp1-r3{r3}"), 0).load(want)
        assert got.records.keys() == ref.records.keys() and len(got.records) == 3 * LAYERS
        for site, rec in got.records.items():
            for name in ("low_bits", "scales", "global_scale"):
                a, b = getattr(rec, name), getattr(ref.records[site], name)
                assert (a is None and b is None) or torch.equal(a, b), (site, name)
        assert torch.equal(got.routes, ref.routes)
        for row, idx in enumerate(([0, 1, 2, 3], [0, 4, 5])):
            for layer in range(LAYERS):
                routes, x, _ = moe_inputs(layer)
                assert torch.equal(got.routes[row, : len(idx), layer], routes[idx])
                moe = Record.from_quantized(quantize(x[idx], "nvfp4", per_token=True), 1)
                assert torch.equal(got.records[(layer, "moe_in")].low_bits[row, : len(idx)], moe.low_bits)
                assert torch.equal(got.records[(layer, "moe_in")].scales[row, : len(idx)], moe.scales)
                full = kv_values(6, 20 + layer)[idx]
                for kind, kv in (("k", full), ("v", -full)):
                    rec, ref_kv = got.records[(layer, kind)], expected(kv, 1)
                    assert torch.equal(rec.low_bits[row, : len(idx)], ref_kv.low_bits), (layer, kind)
                    assert torch.equal(rec.scales[row, : len(idx)], ref_kv.scales), (layer, kind)
        with pytest.raises(FailedRecordError, match="hook did not run"):
            RecordReader(str(tmp_path / f"tp2-r3{r3}"), 0).load([("c", 0, 3)])


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_kv_record_rows_keep_each_sites_low_bits_and_scales(bits):
    """`kv_rows_from_raw` (run on the device at finish, sites in groups of KV_SITE_GROUP) then the writer's parse
    give every site exactly `pack_low_bits(unpack_fp4(codes))` and its scale bytes, across group boundaries."""
    sites, width, rows = KV_SITE_GROUP + 5, 64, 7
    gen = torch.Generator().manual_seed(bits)
    raw = torch.randint(0, 256, (rows, sites * (width // 2 + width // 16)), generator=gen, dtype=torch.uint8)
    layers = list(range(0, sites, 2)) if sites % 2 == 0 else list(range(sites))
    kinds = ("k", "v") if sites % 2 == 0 else ("k",)
    records = kv_records_from_raw(raw, layers, kinds, width, bits)
    per_site = raw.view(rows, sites, width // 2 + width // 16)
    for i, site in enumerate((layer, kind) for layer in layers for kind in kinds):
        assert torch.equal(records[site].low_bits, pack_low_bits(unpack_fp4(per_site[:, i, : width // 2]), bits))
        assert torch.equal(records[site].scales, per_site[:, i, width // 2 :])
