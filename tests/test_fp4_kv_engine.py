"""The embedded engine with FP4-KV decode attention (`trace_rl.fp4_kv_engine`): its pool holds exactly the FP4 K/V
the engine attends over, in SGLang's pool layout at the engine's slots, decode steps read it, and generation gives
the tokens and log-probs of the engine that attends over the dequantized values (CPU: the pure-torch twin; CUDA:
the Triton kernel)."""

from __future__ import annotations

import pytest
import torch

from trace_core.kv_attention import dequantize_kv
from trace_core.records import RecordSpec
from trace_rl.engine import EmbeddedEngine
from trace_rl.fp4_kv_engine import FP4AttentionEngine
from trace_rl.task import EOS, AdditionTask
from trace_rl.warmup import HF_DIR

TASK = AdditionTask(1)
SPEC = RecordSpec(bits=2, moe_layers=(1,), attn_layers=(1,))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    out = tiny_model(10)
    return str(out / HF_DIR)


class _KVTap:
    """Collects each forward's K/V site outputs (the FP4 values the engine attends over) and slots."""

    def __init__(self):
        self.values: list[dict] = [{}]
        self.slots: list[torch.Tensor] = []

    def site(self, site, x, y):
        if site[1] in ("k", "v"):
            self.values[-1][site] = y.clone()

    def forward_end(self, slots):
        self.slots.append(slots.clone())
        self.values.append({})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pool_holds_the_attended_values_and_decode_reads_it(model_dir, device):
    prompts = TASK.prompts(torch.tensor([[3, 4], [9, 9], [0, 1]]))
    engine = FP4AttentionEngine(model_dir, spec=SPEC, max_batch=4, max_len=TASK.prompt_len + 4, device=device)
    engine.tap = tap = _KVTap()
    calls = []
    decode = engine.decode_attention
    engine.decode_attention = lambda layer, q, scaling: calls.append(layer) or decode(layer, q, scaling)
    ours = engine.generate(prompts, 4, eos=EOS, seed=0)
    steps = len(tap.slots) - 1  # forwards after the prefill
    assert calls == [0, 1] * steps  # every decode forward, every layer, read the pool
    for values, slots in zip(tap.values, tap.slots, strict=False):
        for (layer, kind), y in values.items():
            codes, scales = engine.kv_pool[(layer, kind)]
            got = dequantize_kv(codes[slots], scales[slots]).reshape(y.shape)
            assert torch.equal(got, y), (layer, kind)

    ref = EmbeddedEngine(model_dir, fp4=True, spec=SPEC, max_batch=4, max_len=TASK.prompt_len + 4, device=device)
    theirs = ref.generate(prompts, 4, eos=EOS, seed=0)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-2)
