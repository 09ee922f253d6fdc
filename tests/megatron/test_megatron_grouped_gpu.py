"""TRACE grouped experts and the sync-free sites on CUDA (`pytest -m gpu`): grouped_mm + Triton fake-quant against
SequentialMLP in BF16 (outputs bit for bit), the expert weights fake-quantized in place against the per-step copy,
the row-scaled FC2 against its twin, and the sites captured in a CUDA graph (any host sync would abort the
capture)."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.sites import SiteNumerics, expert_weight_fake_quant
from megatron_trace.source import SiteRows
from tests.megatron.test_megatron_grouped import check_grouped_matches_sequential, check_row_scaled_fc2
from tests.megatron.test_megatron_grouped_in_place import check_fake_quant_into_own_storage, check_in_place_matches_copy
from trace_core.numerics.quant import quantize
from trace_core.records.spec import Record, RecordSpec

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("megatron_rank")]


@pytest.mark.parametrize("mode", ["bf16", "qat", "trace"])
def test_grouped_experts_match_sequential_mlp_on_cuda(mode):
    check_grouped_matches_sequential(mode, torch.bfloat16)


@pytest.mark.parametrize("mode", ["qat", "trace"])
def test_in_place_expert_weights_match_the_weight_copy_on_cuda(mode):
    check_in_place_matches_copy(mode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["nvfp4-w4a4-kv4", "mxfp4-w4a4-kv4"])
def test_expert_weight_fake_quant_into_its_own_storage_on_cuda(recipe, dtype):
    """The Triton kernel writing over the weights it reads (`out=w`)."""
    check_fake_quant_into_own_storage(recipe, "cuda", dtype)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_row_scaled_fc2_matches_its_twin_on_cuda(scale_dtype):
    check_row_scaled_fc2(torch.bfloat16, scale_dtype, "cuda")


def test_sites_capture_in_a_cuda_graph():
    """Guided (rows without a record, flip counting on), RTN, FC2-input and all-expert weight fake-quant inside
    `torch.cuda.graph`; replaying on new inputs gives what eager gives on them."""
    spec = RecordSpec(bits=1, moe_layers=(0,), attn_layers=())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    rollout = quantize(x.float() + 0.05 * torch.randn(x.shape, device="cuda", generator=g), "nvfp4", per_token=True)
    has = torch.rand(256, device="cuda", generator=g) < 0.9
    rows = SiteRows(Record.from_quantized(rollout, 1), has)
    w = torch.randn(8, 1536, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    numerics = SiteNumerics(TraceConfig(mode="trace", spec=spec))
    numerics.track([(0, "moe_in"), (1, "moe_in")])

    def run():
        return (
            numerics.activation((0, "moe_in"), x, rows),
            numerics.activation((1, "moe_in"), x, rows),
            numerics.fc2_input(x),
            expert_weight_fake_quant(w),
        )

    run()  # warm-up: Triton compilation outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
    w.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    eager = SiteNumerics(TraceConfig(mode="trace", spec=spec))
    ref = (
        eager.activation((0, "moe_in"), x, rows),
        eager.activation((1, "moe_in"), x, rows),
        eager.fc2_input(x),
        expert_weight_fake_quant(w),
    )
    assert all(torch.equal(a, b) for a, b in zip(outs, ref, strict=True))
