"""Record capture on the CPU path: staging -> host store keyed by KV slot -> gather per request.

A small driver plays the rollout engine: every token row's activations derive from a content seed, so a row's
expected record is the reference quantizer's output on that row alone (all formats here quantize row-independently:
block scales, and nvfp4 with a per-token scale).
"""

import threading

import pytest
import torch

from trace_core.capture import RecordCapturer
from trace_core.drain import DrainQueue
from trace_core.formats import format_names, get_format
from trace_core.kernels import quantize_record
from trace_core.quant import quantize
from trace_core.records import ModelShape, Record, RecordSpec, pack_low_bits
from trace_core.sites import SITE_KINDS
from trace_core.store import TrajectoryRecords

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
        assert torch.equal(g.low_bits, rec.low_bits), site
        assert torch.equal(g.scales, rec.scales), site
        if rec.global_scale is None:
            assert g.global_scale is None
        else:
            assert torch.equal(g.global_scale, rec.global_scale.reshape(-1, 1)), site
    if want.routes is None:
        assert got.routes is None
    else:
        assert torch.equal(got.routes, want.routes)


def make(fmt: str = "nvfp4", bits: int = 1, *, routes=ROUTES, max_tokens=16, num_slots=64, **kw) -> RecordCapturer:
    spec = RecordSpec(bits=bits, moe_layers=(1, 3), attn_layers=(2,), moe_format=fmt, kv_format=kw.pop("kv", "kv_fp4"))
    return RecordCapturer(spec, SHAPE, max_tokens=max_tokens, num_slots=num_slots, routes=routes, **kw)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", format_names())
def test_round_trip_chunked_prefill_then_decode(fmt, bits):
    cap = make(fmt, bits, kv=fmt)
    drv = Driver(cap)
    seeds = list(range(100, 111))  # 11 tokens: prompt 7 in chunks of 4 + 3, then 4 decode steps
    slots = [40, 41, 42, 43, 20, 21, 22, 5, 6, 7, 8]
    drv.forward(list(zip(slots[:4], seeds[:4], strict=True)))
    drv.forward(list(zip(slots[4:7], seeds[4:7], strict=True)))
    ids = [drv.forward([(slots[i], seeds[i]), (0, 999)]) for i in range(7, 11)]  # padded rows hit dummy slot 0
    assert ids == [2, 3, 4, 5]
    got = cap.gather(torch.tensor(slots, dtype=torch.int32), 10, after_forward=ids[-2])
    assert_same(got, drv.expected(seeds[:10]))
    assert got.records[(2, "k")].code_bits().shape == (10, 64)
    row_bytes = cap.row.row_bytes
    assert cap.stats.forwards == 6 and cap.stats.rows == 15 and cap.stats.bytes == 15 * row_bytes


def test_row_bytes_match_the_record_spec_accounting():
    cap = make("nvfp4", 1, routes=None)
    # moe_in: 64 * 1.5 / 8 + 4 (token scale) = 16; k, v: 64 * 1.5 / 8 = 12 each.
    assert cap.row.row_bytes == 2 * 16 + 2 * 12


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
    cap = make("nvfp4", 2, routes=None, sites=[(1, "moe_in")])
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
        cap.gather_async(torch.tensor([[1, 2]]), 2)


def test_out_of_range_out_cache_loc_is_rejected_and_nothing_is_written():
    cap = make(routes=None)
    drv = Driver(cap)
    with pytest.raises(ValueError, match=r"KV slots out of range \[0, 64\)"):
        drv.forward([(3, 1), (64, 2)])
    assert not cap.written.any()
    drv.forward([(3, 1)])
    assert_same(cap.gather(torch.tensor([3]), 1), drv.expected([1]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_quantize_record_kernel_op_writes_into_staging_rows(fmt):
    cap = make(fmt, 1, routes=None, sites=[(3, "moe_in")])
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    per_token = get_format(fmt).has_global_scale
    buf = cap.staging_rows((3, "moe_in"), 5)
    views = {"low_bits": buf.low_bits, "scales": buf.scales, "token_scale": buf.global_scale}
    quantize_record(x, fmt, 1, per_token=per_token, **views)
    cap.on_forward_end(torch.arange(10, 15))
    want = Record.from_quantized(quantize_rows(fmt, x), 1)
    assert_same(cap.gather(torch.arange(10, 15), 5), TrajectoryRecords(5, {(3, "moe_in"): want}))


def test_gather_async_and_release_are_ordered_after_earlier_forwards_on_the_cpu_path():
    cap = make(routes=None)
    drv = Driver(cap)
    drv.forward([(5, 1), (6, 2)])
    future = cap.gather_async(torch.tensor([5, 6]), 2)
    cap.release(torch.tensor([5, 6]))
    drv.forward([(5, 8)])
    assert_same(future.result(timeout=0), drv.expected([1, 2]))
    with pytest.raises(ValueError, match=r"1 of 2 positions have no captured record \(first positions \[1\]"):
        cap.gather(torch.tensor([5, 6]), 2)
    assert cap.gather_async(torch.tensor([6]), 1).exception(timeout=0) is not None


class TestDrainQueue:
    """The ordered job queue behind the CUDA ring, driven with plain jobs on the CPU."""

    def test_thread_runs_jobs_in_order_and_waits_only_up_to_a_tag(self):
        q = DrainQueue(thread=True)
        gate, order = threading.Event(), []
        q.put(lambda: order.append(0), 0)
        q.put(lambda: (gate.wait(5), order.append(1)), 1)  # a copy still in flight
        late = q.put(lambda: order.append(2) or "done", 2, report=False)
        q.wait_upto(0)
        assert order == [0]
        assert not q.wait_upto(0) and not late.done()  # job 0 is done; job 1 still blocks job 2
        with q.cv:
            assert q.busy_upto(1) and q.busy_upto(None)
        gate.set()
        assert late.result(timeout=5) == "done" and order == [0, 1, 2]
        q.close()
        assert q.completed == 3

    def test_inline_poll_runs_only_ready_jobs_and_wait_runs_the_rest(self):
        q = DrainQueue(thread=False)
        ready, order = [False], []
        q.put(lambda: order.append("copy"), 0, ready=lambda: ready[0])
        q.put(lambda: order.append("gather"), 0)
        q.poll()
        assert order == []  # the head's copy is not done: nothing may overtake it
        ready[0] = True
        q.poll()
        assert order == ["copy", "gather"]
        q.put(lambda: order.append("blocking copy"), 1, ready=lambda: False)
        assert q.wait_upto(1) and order[-1] == "blocking copy"
        with pytest.raises(RuntimeError, match="no queued job can satisfy"):
            q.wait_for(lambda: False)

    @pytest.mark.parametrize("thread", [True, False])
    def test_errors_reach_the_future_and_reported_ones_the_next_wait(self, thread):
        q = DrainQueue(thread=thread)

        def fail():
            raise ValueError("KV slots out of range")

        quiet = q.put(fail, 0, report=False)
        q.poll()  # inline: runs the job; an unreported failure is the future holder's business
        assert isinstance(quiet.exception(timeout=5), ValueError)
        q.poll()
        q.put(fail, 1)
        with pytest.raises(ValueError, match="KV slots out of range"):
            q.wait_upto(None)
        q.wait_upto(None)  # raised once
        ok = q.put(lambda: 7, 2)
        q.close()
        assert ok.result(timeout=0) == 7
        with pytest.raises(RuntimeError, match="closed"):
            q.put(lambda: None, 3)
