"""Record capture on CUDA: the device record store under back-to-back forwards, staging writes inside a CUDA
graph, and a batched gather copied into the pinned host ring. Each test checks the gathered bytes against the CPU
path or the tensors that were staged."""

import pytest
import torch

from tests.core.test_capture import Driver, assert_same, make
from trace_core.kernels import quantize_record
from trace_core.numerics.quant import quantize
from trace_core.records.host_ring import HostRing
from trace_core.records.spec import Record

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


def test_device_store_equals_the_cpu_store_under_back_to_back_forwards():
    gen = torch.Generator().manual_seed(0)
    forwards = schedule(120, gen)  # 120 * 64 > 4000 slots: later forwards overwrite earlier slots
    gpu = CudaDriver(make(device="cuda", num_slots=4096, max_tokens=64))
    cpu = Driver(make(num_slots=4096, max_tokens=64))
    prepared = [gpu.prepare(rows) for rows in forwards]
    torch.cuda.synchronize()
    for p in prepared:  # back to back: no host work between forwards
        gpu.run(p)
    for rows in forwards:
        cpu.forward(rows)
    latest: dict[int, int] = {}
    for rows in forwards:
        latest.update(rows)
    slots = torch.tensor(sorted(latest))
    assert_same(gpu.cap.gather(slots, len(slots)), cpu.expected([latest[s] for s in sorted(latest)]))
    assert torch.equal(gpu.cap.store.cpu(), cpu.cap.store) and torch.equal(gpu.cap.written.cpu(), cpu.cap.written)
    assert gpu.cap.stats.bytes == cpu.cap.stats.bytes and gpu.cap.stats.forwards == 120


def test_staging_writes_inside_a_captured_cuda_graph():
    cap = make(device="cuda", num_slots=256, max_tokens=32, sites=[(1, "moe_in")], routes=(3, 2))
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
        assert torch.equal(rec.low_bits.cpu(), (values * 7).to(torch.uint8))
        assert torch.equal(rec.scales.cpu(), (values[:, :4] + 1).to(torch.uint8))
        assert torch.equal(rec.global_scale.cpu(), values[:, :1] * 0.5 + 2)
        for layer in range(3):
            assert torch.equal(got.routes[:, layer].cpu(), values[:, :2].to(torch.int32) + layer)


def test_quantize_record_kernel_writes_staging_rows_inside_a_cuda_graph():
    cap = make(device="cuda", num_slots=512, max_tokens=64, sites=[(1, "moe_in"), (3, "moe_in")])
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
            assert torch.equal(rec.low_bits.cpu(), want.low_bits) and torch.equal(rec.scales.cpu(), want.scales)
            assert torch.equal(rec.global_scale.cpu(), want.global_scale)


def test_a_batched_gather_copied_into_the_pinned_ring_is_ordered_before_a_reuse_of_the_slots():
    """The finish path: one gather of two requests' rows, an async copy into a pinned ring span, then the slots are
    freed and reused by the next forward on the same stream; the span holds the finished requests' rows."""
    gpu = CudaDriver(make(device="cuda", num_slots=512, max_tokens=64))
    gpu.forward([(5, 1), (6, 2), (9, 3)])
    ring = HostRing(1 << 16, pin=True)
    torch.cuda._sleep(SLEEP_CYCLES)  # the gather and the copy are still queued when the reuse is issued
    staged = torch.empty(3 * gpu.cap.row.row_bytes + 16, dtype=torch.uint8, device="cuda")  # the transfer's buffer
    rows = gpu.cap.gather_rows(torch.tensor([5, 6, 9], dtype=torch.int32, device="cuda"), out=staged[16:].view(3, -1))
    ticket, span = ring.reserve(rows.numel())
    host = span.view(rows.shape)
    host.copy_(rows, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    gpu.cap.release(torch.tensor([5, 6, 9], device="cuda"))
    gpu.forward([(5, 8), (6, 9)])  # the freed slots are reused by the next request
    copied.synchronize()
    assert_same(gpu.cap.read(host[:2]), Driver(gpu.cap).expected([1, 2]))
    assert_same(gpu.cap.read(host[2:]), Driver(gpu.cap).expected([3]))
    assert_same(gpu.cap.gather(torch.tensor([5, 6]), 2), Driver(gpu.cap).expected([8, 9]))
    ring.release(ticket)
