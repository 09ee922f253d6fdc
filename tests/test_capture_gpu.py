"""Record capture on CUDA: async ring under back-to-back forwards, staging writes inside a CUDA graph, and
backpressure when the copy consumer is slow. Each test checks the gathered bytes against the CPU path or the
tensors that were staged."""

import pytest
import torch

from tests.test_capture import Driver, assert_same, make
from trace_core.kernels import quantize_record
from trace_core.quant import quantize
from trace_core.records import Record

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time: makes the side stream (the copy consumer) slow


class CudaDriver(Driver):
    """Same forwards as `Driver`, with every staged tensor on the GPU; `prepare` builds a forward's tensors ahead
    so that `run` can submit forwards back to back with no host work in between."""

    def prepare(self, rows):
        slots = torch.tensor([s for s, _ in rows], dtype=torch.int64, device="cuda")
        cpu = self.expected([seed for _, seed in rows])
        staged = {
            site: [None if t is None else t.cuda() for t in (r.low_bits, r.scales, r.global_scale)]
            for site, r in cpu.records.items()
        }
        return slots, staged, None if cpu.routes is None else cpu.routes.cuda()

    def run(self, prepared):
        slots, staged, routes = prepared
        for site, tensors in staged.items():
            self.cap.stage(site, *tensors)
        if routes is not None:
            for layer in range(routes.shape[1]):
                self.cap.stage_routes(layer, routes[:, layer])
        return self.cap.on_forward_end(slots)

    def forward(self, rows):
        return self.run(self.prepare(rows))


def schedule(num_forwards: int, gen: torch.Generator) -> list[list[tuple[int, int]]]:
    """Forwards of 1..64 rows over distinct slots, each row with its own content seed; slots are reused late."""
    out, seed = [], 0
    for f in range(num_forwards):
        n = int(torch.randint(1, 65, (1,), generator=gen))
        base = (f * 64) % 4000 + 1
        out.append([(base + i, seed + i) for i in range(n)])
        seed += n
    return out


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
@pytest.mark.parametrize("depth", [1, 2, 8])
def test_async_copies_are_correct_under_back_to_back_forwards(depth, drain_thread):
    gen = torch.Generator().manual_seed(depth)
    forwards = schedule(120, gen)  # 120 * 64 > 4000 slots: later forwards overwrite earlier slots
    gpu = CudaDriver(make(device="cuda", ring_depth=depth, num_slots=4096, max_tokens=64, drain_thread=drain_thread))
    cpu = Driver(make(num_slots=4096, max_tokens=64))
    prepared = [gpu.prepare(rows) for rows in forwards]
    torch.cuda.synchronize()
    for p in prepared:  # back to back: each forward's staging writes follow the previous forward's submit at once
        gpu.run(p)
    for rows in forwards:
        cpu.forward(rows)
    latest: dict[int, int] = {}
    for rows in forwards:
        latest.update(rows)
    slots = torch.tensor(sorted(latest))
    assert_same(gpu.cap.gather(slots, len(slots)), cpu.expected([latest[s] for s in sorted(latest)]))
    assert torch.equal(gpu.cap.host, cpu.cap.host) and torch.equal(gpu.cap.written, cpu.cap.written)
    assert gpu.cap.stats.bytes == cpu.cap.stats.bytes and gpu.cap.stats.forwards == 120
    gpu.cap.close()


def test_staging_writes_inside_a_captured_cuda_graph():
    cap = make(device="cuda", ring_depth=2, num_slots=256, max_tokens=32, sites=[(1, "moe_in")], routes=(3, 2))
    x = torch.zeros(32, 8, device="cuda")  # the graph's static input
    staging_ptr = cap.staging.data_ptr()

    def body():
        low = (x * 7).to(torch.uint8)
        scales = (x[:, :4] + 1).to(torch.uint8)
        cap.stage((1, "moe_in"), low, scales, x[:, :1] * 0.5 + 2)
        ids = x[:, :2].to(torch.int32)
        for layer in range(3):
            cap.stage_routes(layer, ids + layer)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    cap._staged.clear()
    assert cap.staging.data_ptr() == staging_ptr
    expected = {}
    for step in range(6):
        values = torch.randint(0, 30, (32, 8), device="cuda").float()
        x.copy_(values)
        graph.replay()
        slots = torch.arange(32, device="cuda") + 32 * step + 1
        cap.on_forward_end(slots, graph_replay=True)
        expected[step] = (values.cpu(), slots.cpu())
    for values, slots in expected.values():
        got = cap.gather(slots, 32)
        rec = got.records[(1, "moe_in")]
        assert torch.equal(rec.low_bits, (values * 7).to(torch.uint8))
        assert torch.equal(rec.scales, (values[:, :4] + 1).to(torch.uint8))
        assert torch.equal(rec.global_scale, values[:, :1] * 0.5 + 2)
        for layer in range(3):
            assert torch.equal(got.routes[:, layer], values[:, :2].to(torch.int32) + layer)


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
def test_backpressure_waits_for_a_slow_consumer_and_never_overwrites_unread_rows(drain_thread):
    kwargs = {"device": "cuda", "ring_depth": 2, "num_slots": 4096, "max_tokens": 64, "drain_thread": drain_thread}
    forwards = [[(100 * f + i + 1, 1000 * f + i) for i in range(16)] for f in range(6)]
    # A throwaway capturer first: lazy CUDA set-up (kernels, pinned pages, the drain thread) in the first forward of
    # a process could otherwise outlast the sleep below. Host work is done before the sleep for the same reason.
    warm = CudaDriver(make(**kwargs))
    warm.forward(forwards[0])
    torch.cuda.synchronize()
    warm.cap.close()
    gpu = CudaDriver(make(**kwargs))
    cpu = Driver(make(num_slots=4096, max_tokens=64))
    prepared = [gpu.prepare(rows) for rows in forwards]
    with torch.cuda.stream(gpu.cap.ring.side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the D2H consumer is busy: copies queue behind this
    for p in prepared:
        gpu.run(p)
    for rows in forwards:
        cpu.forward(rows)
    stats = gpu.cap.stats
    assert stats.stalls >= 1 and stats.stall_s > 0.01  # the third forward found both entries in flight
    for rows in forwards:
        slots = torch.tensor([s for s, _ in rows])
        assert_same(gpu.cap.gather(slots, len(rows)), cpu.expected([seed for _, seed in rows]))


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
def test_gather_waits_for_copies_in_flight(drain_thread):
    gpu = CudaDriver(make(device="cuda", ring_depth=4, num_slots=512, max_tokens=64, drain_thread=drain_thread))
    with torch.cuda.stream(gpu.cap.ring.side):
        torch.cuda._sleep(SLEEP_CYCLES)
    gpu.forward([(5, 1), (6, 2), (7, 3)])
    assert gpu.cap.stats.waits == 0
    got = gpu.cap.gather(torch.tensor([5, 6, 7], device="cuda"), 3)
    assert gpu.cap.stats.waits == 1 and gpu.cap.stats.wait_s > 0
    assert_same(got, Driver(gpu.cap).expected([1, 2, 3]))


def test_quantize_record_kernel_writes_staging_rows_inside_a_cuda_graph():
    cap = make(device="cuda", ring_depth=2, num_slots=512, max_tokens=64, sites=[(1, "moe_in"), (3, "moe_in")])
    x = torch.zeros(48, 64, device="cuda", dtype=torch.bfloat16)

    def body():
        for site in cap.layouts:
            buf = cap.staging_rows(site, x.shape[0])
            views = {"low_bits": buf.low_bits, "scales": buf.scales, "token_scale": buf.global_scale}
            quantize_record(x * (site[0] + 1), "nvfp4", 1, per_token=True, **views)
        for layer in range(3):
            cap.stage_routes(layer, torch.full((x.shape[0], 2), layer, device="cuda", dtype=torch.int32))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    inputs = []
    for step in range(4):
        x.copy_(torch.randn(48, 64, device="cuda"))
        graph.replay()
        slots = torch.arange(48, device="cuda") + 48 * step + 1
        cap.on_forward_end(slots, graph_replay=True)
        inputs.append((x.cpu(), slots.cpu()))
    for values, slots in inputs:
        got = cap.gather(slots, 48)
        for layer in (1, 3):
            q = quantize(values * (layer + 1), "nvfp4", per_token=True)
            want = Record.from_quantized(q, 1)
            rec = got.records[(layer, "moe_in")]
            assert torch.equal(rec.low_bits, want.low_bits) and torch.equal(rec.scales, want.scales)
            assert torch.equal(rec.global_scale, want.global_scale)


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
def test_a_bad_kv_slot_found_while_draining_is_raised_by_the_next_call(drain_thread):
    gpu = CudaDriver(make(device="cuda", ring_depth=2, num_slots=64, max_tokens=64, drain_thread=drain_thread))
    gpu.forward([(3, 1), (64, 2)])  # slot 64 is outside the host store; only the drain can see it
    with pytest.raises(ValueError, match=r"KV slots out of range \[0, 64\)"):
        gpu.cap.flush()
    gpu.forward([(5, 7)])
    assert_same(gpu.cap.gather(torch.tensor([5]), 1), Driver(gpu.cap).expected([7]))


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
def test_gather_after_a_forward_does_not_wait_for_the_next_forward_in_flight(drain_thread):
    gpu = CudaDriver(make(device="cuda", ring_depth=4, num_slots=512, max_tokens=64, drain_thread=drain_thread))
    want = Driver(gpu.cap).expected([1, 2])
    first = gpu.forward([(5, 1), (6, 2)])
    gpu.cap.flush(first)
    later = gpu.prepare([(7, 3)])
    torch.cuda._sleep(SLEEP_CYCLES)  # the next forward is still computing (overlap scheduler)
    second = gpu.run(later)
    assert (first, second) == (0, 1)
    waits = gpu.cap.stats.waits
    got = gpu.cap.gather(torch.tensor([5, 6]), 2, after_forward=first)
    assert not torch.cuda.current_stream().query()  # gather returned while the next forward still runs
    assert gpu.cap.stats.waits == waits
    assert_same(got, want)
    assert_same(gpu.cap.gather(torch.tensor([5, 6, 7]), 3, after_forward=second), Driver(gpu.cap).expected([1, 2, 3]))
    assert gpu.cap.stats.waits == waits + 1


@pytest.mark.parametrize("drain_thread", [True, False], ids=["drain_thread", "drain_inline"])
def test_gather_async_sees_earlier_forwards_and_not_a_later_reuse_of_the_slots(drain_thread):
    gpu = CudaDriver(make(device="cuda", ring_depth=2, num_slots=512, max_tokens=64, drain_thread=drain_thread))
    with torch.cuda.stream(gpu.cap.ring.side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copies of the first forward are still in flight at finish
    gpu.forward([(5, 1), (6, 2)])
    future = gpu.cap.gather_async(torch.tensor([5, 6], device="cuda"), 2)
    assert future.done() != drain_thread  # the drain thread does the copy; inline, gather_async waits
    gpu.cap.release(torch.tensor([5, 6]))
    gpu.forward([(5, 8), (6, 9)])  # the freed slots are reused by the next request
    assert_same(future.result(timeout=30), Driver(gpu.cap).expected([1, 2]))
    assert_same(gpu.cap.gather(torch.tensor([5, 6]), 2), Driver(gpu.cap).expected([8, 9]))
    gpu.cap.close()
