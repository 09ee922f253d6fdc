"""Record capture on the CPU: staging -> record store keyed by KV slot -> gather per request; the bounded host ring.

A small driver plays the rollout engine: every token row's activations derive from a content seed, so a row's
expected record is the reference quantizer's output on that row alone (all formats here quantize row-independently:
block scales, and nvfp4 with a per-token scale).
"""

import threading
import time

import pytest
import torch

from trace_core.kernels import quantize_record
from trace_core.numerics.formats import get_format
from trace_core.numerics.quant import quantize
from trace_core.numerics.recipe import recipe_names
from trace_core.records.capture import RecordCapturer, route_dtype
from trace_core.records.host_ring import HostRing
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import ModelShape, Record, RecordSpec, pack_low_bits
from trace_core.sites import SITE_KINDS

SHAPE = ModelShape(hidden=64, num_kv_heads=2, head_dim=32)
ROUTES = (3, 2)


def row_input(seed: int, width: int, site_salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + site_salt)
    return torch.randn(width, generator=gen) * (1 + seed % 5)


def quantize_rows(fmt_name: str, x: torch.Tensor):
    fmt = get_format(fmt_name)
    return quantize(x, fmt, **({"per_token": True} if fmt.has_global_scale else {}))


def site_rows(site, seeds, width):
    return torch.stack([row_input(s, width, site[0] * 3 + SITE_KINDS.index(site[1])) for s in seeds])


class Driver:
    """Runs forwards of token rows (KV slot, content seed) through a capturer, as an engine would."""

    def __init__(self, cap: RecordCapturer) -> None:
        self.cap = cap

    def forward(self, rows: list[tuple[int, int]]) -> int:
        slots = torch.tensor([s for s, _ in rows], dtype=torch.int64)
        seeds = [seed for _, seed in rows]
        for site, (fmt_name, _, n) in self.cap.layouts.items():
            self.cap.stage_quantized(site, quantize_rows(fmt_name, site_rows(site, seeds, n)))
        if self.cap.routes_shape:
            for layer in range(ROUTES[0]):
                self.cap.stage_routes(layer, expected_routes(seeds)[:, layer])
        return self.cap.on_forward_end(slots)

    def expected(self, seeds: list[int]) -> TrajectoryRecords:
        records = {}
        for site, (fmt_name, bits, n) in self.cap.layouts.items():
            q = quantize_rows(fmt_name, site_rows(site, seeds, n))
            records[site] = Record.from_quantized(q, bits)
        routes = expected_routes(seeds) if self.cap.routes_shape else None
        return TrajectoryRecords(len(seeds), records, routes)


def expected_routes(seeds: list[int]) -> torch.Tensor:
    return torch.stack([(seed * 7 + 3 * torch.arange(6)).to(torch.int32).view(*ROUTES) for seed in seeds])


def assert_same(got: TrajectoryRecords, want: TrajectoryRecords) -> None:
    assert got.num_tokens == want.num_tokens and set(got.records) == set(want.records)
    for site, rec in want.records.items():
        g = got.records[site]
        assert (g.fmt, g.bits, g.n) == (rec.fmt, rec.bits, rec.n)
        assert torch.equal(g.low_bits.cpu(), rec.low_bits.cpu()), site
        assert torch.equal(g.scales.cpu(), rec.scales.cpu()), site
        if rec.global_scale is None:
            assert g.global_scale is None
        else:
            assert torch.equal(g.global_scale.cpu(), rec.global_scale.reshape(-1, 1).cpu()), site
    if want.routes is None:
        assert got.routes is None
    else:
        assert torch.equal(got.routes.cpu(), want.routes.cpu())


def make(recipe: str | None = None, bits=1, *, routes=ROUTES, max_tokens=16, num_slots=64, **kw) -> RecordCapturer:
    spec = RecordSpec.of_recipe(recipe, (1, 3), (2,), bits)  # the sites the recipe records, in its formats
    return RecordCapturer(spec, SHAPE, max_tokens=max_tokens, num_slots=num_slots, routes=routes, **kw)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("recipe", recipe_names())
def test_round_trip_chunked_prefill_then_decode(recipe, bits):
    """Every recorded format (nvfp4 with its token or static scale, mxfp4, kv_fp4) through the recipes' layouts."""
    cap = make(recipe, bits)
    drv = Driver(cap)
    seeds = list(range(100, 111))  # 11 tokens: prompt 7 in chunks of 4 + 3, then 4 decode steps
    slots = [40, 41, 42, 43, 20, 21, 22, 5, 6, 7, 8]
    drv.forward(list(zip(slots[:4], seeds[:4], strict=True)))
    drv.forward(list(zip(slots[4:7], seeds[4:7], strict=True)))
    ids = [drv.forward([(slots[i], seeds[i]), (0, 999)]) for i in range(7, 11)]  # padded rows hit dummy slot 0
    assert ids == [2, 3, 4, 5]
    got = cap.gather(torch.tensor(slots, dtype=torch.int32), 10)
    assert_same(got, drv.expected(seeds[:10]))
    assert got.records[(2, "k")].code_bits().shape == (10, 64)
    row_bytes = cap.row.row_bytes
    assert cap.stats.forwards == 6 and cap.stats.rows == 15 and cap.stats.bytes == 15 * row_bytes


def test_row_bytes_match_the_record_spec_accounting():
    cap = make(None, 1, routes=None)
    # moe_in: 64 * 1.5 / 8 + 4 (token scale) = 16; k, v: 64 * 1.5 / 8 = 12 each; the written byte: 57, padded to
    # whole 8-byte words (the store copies words)
    assert cap.row.row_bytes == 64
    # routes and hook markers: one 4-aligned sentinel range (3 marker bytes padded to 4), reset by one int32 fill
    cap = make(None, 1, marks=3)
    routes, marks = cap.row.fields[("routes", "routes")], cap.row.fields[("meta", "marks")]
    assert marks == (sum(routes), 3) and cap.row.sentinels == slice(routes[0], sum(routes) + 4)
    assert routes[0] % 4 == 0 and cap.row.row_bytes % 8 == 0
    assert bool((cap.staging[:, cap.row.sentinels] == 0xFF).all())


def test_prefix_sharing_requests_read_the_shared_slots():
    cap = make()
    drv = Driver(cap)
    prompt = [1, 2, 3, 4, 5]
    drv.forward([(10 + i, s) for i, s in enumerate(prompt)] + [(15, 50)])  # request A: prompt + 1 token
    # Request B hits the radix cache for the 5 prompt slots and prefills only its own token.
    drv.forward([(30, 60)])
    drv.forward([(16, 51), (31, 61)])  # one decode step for both
    a = cap.gather(torch.tensor([10, 11, 12, 13, 14, 15, 16]), 7)
    b = cap.gather(torch.tensor([10, 11, 12, 13, 14, 30, 31]), 7)
    assert_same(a, drv.expected(prompt + [50, 51]))
    assert_same(b, drv.expected(prompt + [60, 61]))


def test_retraction_frees_slots_that_a_later_request_reuses():
    cap = make()
    drv = Driver(cap)
    drv.forward([(8, 1), (9, 2), (10, 3)])  # request A prefilled, then retracted
    cap.release(torch.tensor([8, 9, 10]))
    with pytest.raises(ValueError, match="3 of 3 positions have no captured record"):
        cap.gather(torch.tensor([8, 9, 10]), 3)
    drv.forward([(9, 70), (10, 71)])  # request B gets two of the freed slots
    drv.forward([(20, 1), (21, 2), (22, 3), (8, 72)])  # A re-prefilled elsewhere; B's third token
    assert_same(cap.gather(torch.tensor([9, 10, 8]), 3), drv.expected([70, 71, 72]))
    assert_same(cap.gather(torch.tensor([20, 21, 22]), 3), drv.expected([1, 2, 3]))


def test_static_scale_is_repeated_per_row_and_kernels_may_write_views_directly():
    cap = make(None, 2, routes=None, sites=[(1, "moe_in")])
    x = torch.randn(3, 64)
    q = quantize(x, "nvfp4", global_scale=torch.tensor(50.0))
    cap.stage_quantized((1, "moe_in"), q)
    cap.on_forward_end(torch.tensor([4, 5, 6]))
    got = cap.gather(torch.tensor([4, 5, 6]), 3).records[(1, "moe_in")]
    assert torch.equal(got.global_scale, torch.full((3, 1), 50.0))
    assert torch.equal(got.low_bits, pack_low_bits(q.codes, 2))
    assert cap.site_buffers((1, "moe_in")).low_bits.shape == (16, 16)  # [max_tokens, packed bytes]
    buf = cap.staging_rows((1, "moe_in"), 2)  # a kernel writes straight into the fixed staging views
    assert buf.low_bits.shape == (2, 16) and buf.scales.shape == (2, 4) and buf.global_scale.shape == (2, 1)
    buf.low_bits[:2].fill_(0xA5)
    buf.scales[:2].fill_(7)
    buf.global_scale[:2].fill_(3.0)
    cap.on_forward_end(torch.tensor([4, 7]))
    got = cap.gather(torch.tensor([4, 7]), 2).records[(1, "moe_in")]
    assert (got.low_bits == 0xA5).all() and (got.scales == 7).all() and (got.global_scale == 3.0).all()


def test_a_site_that_was_not_staged_fails_the_forward_loudly():
    cap = make(routes=None)
    cap.stage_quantized((1, "moe_in"), quantize_rows("nvfp4", torch.randn(2, 64)))
    with pytest.raises(ValueError, match=r"rows \[0, 2\) but \[\(3, 'moe_in'\), \(2, 'k'\), \(2, 'v'\)\]"):
        cap.on_forward_end(torch.tensor([1, 2]))
    Driver(cap).forward([(1, 1), (2, 2)])
    cap.stage_quantized((1, "moe_in"), quantize_rows("nvfp4", torch.randn(3, 64)))  # every site short of rows [1, 4)
    for site in [(3, "moe_in"), (2, "k"), (2, "v")]:
        cap.stage_quantized(site, quantize_rows(cap.layouts[site][0], torch.randn(2, 64)))
    with pytest.raises(ValueError, match=r"rows \[1, 4\) but .* staged \[3, 2, 2, 2\] rows"):
        cap.on_forward_end(torch.tensor([5, 6, 7]), row_start=1)
    assert cap.stats.forwards == 1 and cap.written.sum() == 2


def test_row_start_selects_this_ranks_rows_of_the_staging_buffer():
    cap = make(routes=None)
    drv = Driver(cap)
    seeds = [40, 41, 42, 43, 44]  # 5 rows staged (all DP ranks' tokens); this rank owns rows 2..4
    for site, (fmt_name, _, n) in cap.layouts.items():
        cap.stage_quantized(site, quantize_rows(fmt_name, site_rows(site, seeds, n)))
    cap.on_forward_end(torch.tensor([30, 31, 32]), row_start=2)
    assert_same(cap.gather(torch.tensor([30, 31, 32]), 3), drv.expected(seeds[2:]))


def test_bad_inputs_are_named():
    cap = make(routes=None)
    with pytest.raises(ValueError, match="not captured by the record spec"):
        make(sites=[(7, "moe_in")])
    with pytest.raises(ValueError, match="exceed max_tokens=16"):
        cap.stage((1, "moe_in"), torch.zeros(17, 8, dtype=torch.uint8), torch.zeros(17, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales must be uint8 \[2, 4\]"):
        cap.stage((1, "moe_in"), torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="global_scale presence"):
        cap.stage((1, "moe_in"), torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected kv_fp4 codes"):
        cap.stage_quantized((2, "k"), quantize(torch.randn(2, 64), "mxfp4"))
    with pytest.raises(ValueError, match="built without routes"):
        cap.stage_routes(0, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="length 5 is outside"):
        cap.gather(torch.tensor([1, 2]), 5)
    with pytest.raises(ValueError, match="slots out of range"):
        cap.gather(torch.tensor([1, 64]), 2)
    with pytest.raises(ValueError, match=r"slots out of range \[0, 64\): min -1"):
        cap.release(torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="slots must be a 1-D int tensor"):
        cap.gather_rows(torch.tensor([[1, 2]]))


def test_out_of_range_out_cache_loc_is_rejected_and_nothing_is_written():
    cap = make(routes=None)
    drv = Driver(cap)
    with pytest.raises(ValueError, match=r"KV slots out of range \[0, 64\)"):
        drv.forward([(3, 1), (64, 2)])
    assert not cap.written.any()
    drv.forward([(3, 1)])
    assert_same(cap.gather(torch.tensor([3]), 1), drv.expected([1]))


@pytest.mark.parametrize("recipe", ["nvfp4-w4a4-kv4", "mxfp4-w4a4-kv4"])
def test_the_quantize_record_kernel_op_writes_into_staging_rows(recipe):
    cap = make(recipe, 1, routes=None, sites=[(3, "moe_in")])
    fmt = cap.layouts[(3, "moe_in")][0]
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    per_token = get_format(fmt).has_global_scale
    buf = cap.staging_rows((3, "moe_in"), 5)
    views = {"low_bits": buf.low_bits, "scales": buf.scales, "token_scale": buf.global_scale}
    quantize_record(x, fmt, 1, per_token=per_token, **views)
    cap.on_forward_end(torch.arange(10, 15))
    want = Record.from_quantized(quantize_rows(fmt, x), 1)
    assert_same(cap.gather(torch.arange(10, 15), 5), TrajectoryRecords(5, {(3, "moe_in"): want}))


def test_rows_gathered_in_one_batch_and_read_elsewhere_equal_per_request_gathers():
    """The batched finish path: one `gather_rows` over several requests' slots, copied to the host, then split and
    checked per request by `read`; a released slot fails its request only."""
    cap = make(versioned=True)
    drv = Driver(cap)
    for rows in ([(5, 1), (6, 2), (7, 3)], [(9, 4), (5, 5)]):
        for site, (fmt_name, _, n) in cap.layouts.items():
            cap.stage_quantized(site, quantize_rows(fmt_name, site_rows(site, [s for _, s in rows], n)))
        for layer in range(ROUTES[0]):
            cap.stage_routes(layer, expected_routes([s for _, s in rows])[:, layer])
        cap.on_forward_end(torch.tensor([slot for slot, _ in rows]), version=3)
    cap.release(torch.tensor([7]))
    host = cap.gather_rows(torch.tensor([6, 5, 9, 7])).clone()  # request A: slots 6, 5; request B: 9, 7
    # the finish path's form: SGLang's int32 slots, written into a view of a larger buffer
    buffer = torch.full((4 * cap.row.row_bytes + 8,), 0xAB, dtype=torch.uint8)
    into = cap.gather_rows(torch.tensor([6, 5, 9, 7], dtype=torch.int32), out=buffer[8:].view(4, -1))
    assert torch.equal(into, host) and into.data_ptr() == buffer.data_ptr() + 8 and bool((buffer[:8] == 0xAB).all())
    with pytest.raises(ValueError, match="out must be contiguous"):
        cap.gather_rows(torch.tensor([6, 5]), out=buffer[8:].view(4, -1))
    with pytest.raises(ValueError, match=r"8-byte aligned address, got torch.uint8 \(4, \d+\) at address offset 4"):
        cap.gather_rows(torch.tensor([6, 5, 9, 7]), out=buffer[4:-4].view(4, -1))
    assert_same(cap.read(host[:2], version=3), drv.expected([2, 5]))
    assert_same(cap.read(host[:2], version=3), cap.gather(torch.tensor([6, 5]), 2, version=3))
    with pytest.raises(ValueError, match=r"1 of 2 positions have no captured record \(first positions \[1\]"):
        cap.read(host[2:], version=3)
    with pytest.raises(ValueError, match=r"weight versions \[3\], not 4"):
        cap.read(host[:2], version=4)
    assert cap.store.device == cap.staging.device and cap.store.shape == (64, cap.row.row_bytes)


def test_a_replay_whose_hook_or_route_capture_did_not_run_is_refused_by_the_reset_sentinels():
    """CUDA-graph replays skip the eager staging check. After every forward one fill resets the hook markers and the
    staged routes (to -1), so a replay that misses a marker or one layer's route capture leaves its rows refusable
    even where an earlier, larger forward left valid-looking values in those staging rows."""
    cap = make(marks=2, versioned=True)
    drv = Driver(cap)

    def replay(rows: list[tuple[int, int]], skip_route: int | None = None, skip_mark: int | None = None) -> None:
        seeds = [seed for _, seed in rows]
        for site, (fmt_name, _, n) in cap.layouts.items():
            cap.stage_quantized(site, quantize_rows(fmt_name, site_rows(site, seeds, n)))
        for layer in range(ROUTES[0]):
            if layer != skip_route:
                cap.stage_routes(layer, expected_routes(seeds)[:, layer])
        for index in range(2):
            if index != skip_mark:
                cap.mark(index, len(rows))
        cap.on_forward_end(torch.tensor([slot for slot, _ in rows]), graph_replay=True, version=0)

    replay([(1, 1), (2, 2), (3, 3)])
    replay([(4, 4), (5, 5)], skip_route=1)
    replay([(6, 6)], skip_mark=0)
    replay([(7, 7), (8, 8)])
    assert_same(cap.gather(torch.tensor([1, 2, 3]), 3, version=0), drv.expected([1, 2, 3]))
    assert_same(cap.gather(torch.tensor([7, 8]), 2, version=0), drv.expected([7, 8]))
    with pytest.raises(
        ValueError, match=r"route layer\) \[\[0, 1\], \[1, 1\]\]\): its route capture .* a hook did not run"
    ):
        cap.gather(torch.tensor([4, 5]), 2)
    with pytest.raises(ValueError, match=r"hook did not run \(first \(position, marker\) \[\[0, 0\]\]"):
        cap.gather(torch.tensor([6]), 1)
    staged = cap.row.view(cap.staging, "routes", "routes", torch.int32)
    assert bool((staged == -1).all()) and bool((cap.row.view(cap.staging, "meta", "marks") == 0xFF).all())


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [(8, torch.uint8), (128, torch.uint8), (255, torch.uint8), (256, torch.int16), (257, torch.int16),
     (1 << 15, torch.int16), ((1 << 15) + 1, torch.int32), (None, torch.int32)],
)  # fmt: skip
def test_routes_are_kept_narrow_on_the_device_and_read_back_as_int32_bit_for_bit(experts, dtype):
    """The record rows keep routes in the narrowest dtype whose all-0xFF reset value is no expert id (uint8 up to
    255 experts, int16 up to 32,768, else int32); `read`, `gather` and a host copy of gathered rows return the staged
    ids as int32, every id of the model (0 and the largest) included."""
    assert route_dtype(experts) is dtype
    cap = make(routes=ROUTES, num_experts=experts, versioned=True)
    assert cap.row.route_dtype is dtype and cap.route_buffer().dtype is dtype
    offset, size = cap.row.fields[("routes", "routes")]
    assert size == dtype.itemsize * ROUTES[0] * ROUTES[1] and offset % 4 == 0
    top = (experts or 1 << 31) - 1
    gen = torch.Generator().manual_seed(experts or 0)
    ids = torch.randint(0, top + 1, (5, *ROUTES), generator=gen, dtype=torch.int64).to(torch.int32)
    ids[0, 0, 0], ids[1, 2, 1] = 0, top  # the smallest and largest expert id
    cap.stage_quantized((1, "moe_in"), quantize_rows("nvfp4", site_rows((1, "moe_in"), range(5), 64)))
    for site in [(3, "moe_in"), (2, "k"), (2, "v")]:
        cap.stage_quantized(site, quantize_rows(cap.layouts[site][0], site_rows(site, range(5), 64)))
    for layer in range(ROUTES[0]):
        cap.stage_routes(layer, ids[:, layer])
    slots = torch.tensor([7, 3, 12, 0, 9])
    cap.on_forward_end(slots, version=2)
    got = cap.gather(slots, 5, version=2)
    assert got.routes.dtype == torch.int32 and torch.equal(got.routes, ids)
    host = cap.gather_rows(slots[[4, 1]]).clone()
    assert torch.equal(cap.read(host, version=2).routes, ids[[4, 1]])


@pytest.mark.parametrize("experts", [8, 128, 256, 257, None])
def test_an_unstaged_route_row_is_refused_in_every_route_dtype(experts):
    """The reset after every forward writes all-0xFF bytes into the staged routes (255 in uint8, -1 in int16 and
    int32): a replay in which one layer's route capture did not run stores that value, and every read of the row
    refuses it with the same error, whatever the routes' dtype."""
    cap = make(routes=ROUTES, num_experts=experts, marks=1, versioned=True)
    unset = 0xFF if cap.row.route_dtype == torch.uint8 else -1
    assert bool((cap.route_buffer() == unset).all())

    def replay(slots: list[int], skip: int | None = None) -> None:
        seeds = list(range(len(slots)))
        for site, (fmt_name, _, n) in cap.layouts.items():
            cap.stage_quantized(site, quantize_rows(fmt_name, site_rows(site, seeds, n)))
        for layer in range(ROUTES[0]):
            if layer != skip:
                cap.stage_routes(layer, torch.ones(len(slots), ROUTES[1], dtype=torch.int32))
        cap.mark(0, len(slots))
        cap.on_forward_end(torch.tensor(slots), graph_replay=True, version=0)

    replay([1, 2, 3])  # every staging row a valid-looking route
    replay([4, 5], skip=2)
    assert bool((cap.route_buffer() == unset).all())
    assert torch.equal(cap.gather(torch.tensor([1, 2, 3]), 3).routes, torch.ones(3, *ROUTES, dtype=torch.int32))
    message = r"2 of 2 positions .* \(first \(position, route layer\) \[\[0, 2\], \[1, 2\]\]\): its route capture"
    with pytest.raises(ValueError, match=message):
        cap.gather(torch.tensor([4, 5]), 2)
    with pytest.raises(ValueError, match=message):
        cap.read(cap.gather_rows(torch.tensor([4, 5])).clone())


@pytest.mark.parametrize("marks", [0, 3])
def test_narrow_routes_of_any_size_keep_the_reset_off_the_other_fields(marks):
    """uint8 routes of 3 layers x top-1 (3 bytes) are padded to 4: the reset fill covers the routes, the padding and
    the hook markers only, so the written byte and the records next to them survive it."""
    cap = make(None, 1, routes=(3, 1), num_experts=16, marks=marks, sites=[(1, "moe_in")])
    offset, size = cap.row.fields[("routes", "routes")]
    assert size == 3 and cap.row.sentinels.start == offset and cap.row.sentinels.stop % 4 == 0
    others = [v for k, v in cap.row.fields.items() if k not in (("routes", "routes"), ("meta", "marks"))]
    assert all(o + n <= cap.row.sentinels.start or o >= cap.row.sentinels.stop for o, n in others)
    cap.stage_quantized((1, "moe_in"), quantize_rows("nvfp4", torch.randn(2, 64)))
    for layer in range(3):
        cap.stage_routes(layer, torch.full((2, 1), 15 - layer, dtype=torch.int32))
    for index in range(marks):
        cap.mark(index, 2)
    cap.on_forward_end(torch.tensor([5, 6]))
    assert bool((cap.row.view(cap.staging, "meta", "written") == 1).all())
    got = cap.gather(torch.tensor([5, 6]), 2)
    assert got.routes.tolist() == [[[15], [14], [13]]] * 2


def test_a_bad_expert_count_is_named():
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_experts must be a positive int or None"):
            route_dtype(bad)


class TestHostRing:
    """The bounded host ring of the finish path: fixed size, first in first out, backpressure when full."""

    def test_spans_wrap_and_a_full_ring_waits_for_a_release_instead_of_overwriting(self):
        ring = HostRing(100, pin=False)
        a, span_a = ring.reserve(40)
        b, span_b = ring.reserve(40)
        span_a.fill_(1)
        span_b.fill_(2)
        got, released = [], threading.Event()

        def third():
            got.append(ring.reserve(30))  # 20 bytes free at the tail, 0 at the head: waits

        t = threading.Thread(target=third)
        t.start()
        time.sleep(0.2)
        assert not got and ring.stats.stalls == 1
        assert bool((span_b == 2).all())  # nothing was overwritten while waiting
        ring.release(b)  # out of order: a is still held, so no space frees up yet
        time.sleep(0.2)
        assert not got
        ring.release(a)
        released.set()
        t.join(5)
        ticket, span_c = got[0]
        assert span_c.data_ptr() == ring.buffer.data_ptr() and span_c.numel() == 30  # wrapped to the start
        _, span_d = ring.reserve(60)  # after c: [30, 90)
        assert span_d.data_ptr() == ring.buffer.data_ptr() + 30
        assert ring.stats.reserves == 4 and ring.stats.stall_s > 0 and ring.in_use == 2

    def test_bad_sizes_and_timeouts_are_named(self):
        ring = HostRing(64, pin=False)
        with pytest.raises(ValueError, match="100 bytes do not fit the host ring of 64 bytes"):
            ring.reserve(100)
        ring.reserve(60)
        with pytest.raises(TimeoutError, match="host ring full"):
            ring.reserve(10, timeout=0.05)
        with pytest.raises(ValueError, match="ticket 9 is not a span in use"):
            ring.release(9)
