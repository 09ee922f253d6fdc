"""The embedded reference engine: FP4 weights on the NVFP4 grid, records and routes of every generated token equal to
the reference quantizer's on the real activations, BF16 mode, weight updates and their errors."""

from __future__ import annotations

import pytest
import torch

from trace_core.numerics.formats import NVFP4
from trace_core.numerics.guided import rtn_fake_quant
from trace_core.numerics.quant import quantize
from trace_core.records.spec import Record, RecordSpec
from trace_rl.rollout.engine import EmbeddedEngine
from trace_rl.task import EOS, AdditionTask
from trace_rl.warmup import HF_DIR

TASK = AdditionTask(1)
SPEC = RecordSpec(bits=2, moe_layers=(1,), attn_layers=(1,))


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    out = tiny_model(10)
    return str(out / HF_DIR)


def _engine(model_dir: str, fp4: bool) -> EmbeddedEngine:
    return EmbeddedEngine(model_dir, fp4=fp4, spec=SPEC, max_batch=4, max_len=TASK.prompt_len + 4)


def _prompts() -> torch.Tensor:
    return TASK.prompts(torch.tensor([[3, 4], [9, 9], [0, 1]]))


def test_fp4_expert_weights_are_on_the_nvfp4_grid(model_dir):
    raw = _engine(model_dir, fp4=False).model.model.layers[0].mlp.experts.gate_up_proj.detach()
    fp4 = _engine(model_dir, fp4=True).model.model.layers[0].mlp.experts.gate_up_proj.detach()
    for e in range(fp4.shape[0]):
        assert torch.equal(fp4[e], rtn_fake_quant(raw[e], NVFP4))
        assert torch.equal(rtn_fake_quant(fp4[e], NVFP4), fp4[e])
    assert not torch.equal(raw, fp4)


def test_records_and_routes_match_the_reference_on_the_real_activations(model_dir):
    engine = _engine(model_dir, fp4=True)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    experts = engine.model.model.layers[1].mlp.experts
    experts.register_forward_pre_hook(lambda m, args: seen.append((args[0].clone(), args[1].clone())))
    trajs = engine.generate(_prompts(), 4, eos=EOS, seed=0)
    p = TASK.prompt_len
    # Forward 0 is the prefill ([b * p] rows, b-major), forward t >= 1 decodes position p + t - 1 ([b] rows).
    for i, traj in enumerate(trajs):
        assert traj.records.num_tokens == len(traj.tokens)
        rec = traj.records.records[(1, "moe_in")]
        for pos in range(len(traj.tokens)):
            x, ids = seen[0] if pos < p else seen[pos - p + 1]
            row = i * p + pos if pos < p else i
            want = Record.from_quantized(quantize(x[row : row + 1], NVFP4, per_token=True), SPEC.bits)
            assert torch.equal(rec.low_bits[pos], want.low_bits[0]), (i, pos)
            assert torch.equal(rec.scales[pos], want.scales[0])
            assert torch.equal(rec.global_scale[pos], want.global_scale[0])
            assert torch.equal(traj.records.routes[pos, 1].long(), ids[row])
        assert len(traj.logprobs) == len(traj.response) and bool((traj.logprobs <= 0).all())
    assert len(seen) == 1 + max(len(t.response) for t in trajs)
    kv = trajs[0].records.records[(1, "k")]
    assert kv.n == engine.model.config.num_key_value_heads * engine.model.config.head_dim


def test_bf16_engine_records_routes_only_and_is_deterministic(model_dir):
    engine = _engine(model_dir, fp4=False)
    a = engine.generate(_prompts(), 4, eos=EOS, seed=5)
    b = engine.generate(_prompts(), 4, eos=EOS, seed=5)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logprobs, y.logprobs)
        assert not x.records.records and x.records.routes.shape == (len(x.tokens), 2, 2)


def test_weight_updates_requantize_and_reject_stale_or_incomplete_weights(model_dir):
    engine = _engine(model_dir, fp4=True)
    tensors = {k: v.clone() for k, v in _engine(model_dir, fp4=False).model.state_dict().items()}
    hf = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        for e in range(tensors[f"{p}.gate_up_proj"].shape[0]):
            gate, up = (2 * tensors[f"{p}.gate_up_proj"][e]).chunk(2)
            hf |= {f"{p}.{e}.gate_proj.weight": gate, f"{p}.{e}.up_proj.weight": up}
            hf[f"{p}.{e}.down_proj.weight"] = tensors[f"{p}.down_proj"][e]
    engine.load_weights(hf, version=1)
    w = engine.model.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert torch.equal(w[0], rtn_fake_quant(2 * tensors["model.layers.0.mlp.experts.gate_up_proj"][0], NVFP4))
    with pytest.raises(ValueError, match="not newer"):
        engine.load_weights(hf, version=1)
    with pytest.raises(KeyError, match="misses"):
        engine.load_weights({k: v for k, v in hf.items() if k != "lm_head.weight"}, version=2)
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights(hf | {"model.extra.weight": torch.zeros(1)}, version=2)
    bad = {k: 3 * v for k, v in hf.items()} | {"model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="model.norm.weight: update of shape"):
        engine.load_weights(bad, version=2)
    assert torch.equal(engine.model.model.layers[0].mlp.experts.gate_up_proj.detach(), w) and engine.version == 1
