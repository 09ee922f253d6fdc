"""The embedded engine with FP4-KV decode attention (`trace_rl.rollout.fp4_kv_engine`): its pool holds exactly the FP4
K/V the engine attends over, in SGLang's pool layout at the engine's slots, decode steps read it, and the engine gives
its sampled tokens the log-probs that the engine attending over the dequantized values (SDPA) gives them; under the
default recipe (`kv_fp4` pool) and under `nvfp4-w4a4-nvfp4kv` (NVFP4 pool: E4M3 scale bytes, static unit scale).

On CPU decode runs the pure-torch twin; on CUDA the Triton kernel, checked on every call against the twin on the
same pool within the kernel-vs-twin tolerance of tests/kernels/test_fp4_attention.py (one BF16 rounding: 2^-7 relative +
2^-7 absolute). End to end the comparison is teacher-forced (the reference scores the FP4 engine's own tokens), so
a sampling draw near a boundary cannot turn a rounding difference into a different trajectory. Log-probs are
differences of BF16 logits: with every logit within two of its BF16 steps, a log-prob moves by at most four steps
of the largest |logit| (`_logprob_atol`), the tolerance used.
The CUDA case runs the `small` preset (head dim 64, 3 query heads per KV head); the kernel at the tiny model's
head dim 16 is checked against SGLang's in tests/kernels/test_fp4_attention.py.

In the RL loop (`fp4_attention = "decode"`): a controller step's rollout workers are this engine, its pools hold
codes, the step's reported decode reads are one per layer and decode forward of each batch it sampled (the
evaluation's are reported apart), and a resume with the option changed is refused; the launcher (`trace-rl demo`)
runs the FP4 modes with it. The config's refusals are in tests/rl/test_rl_config.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from trace_core.numerics.kv_attention import decode_attention_reference, dequantize_kv
from trace_core.numerics.recipe import DEFAULT_RECIPE, get_recipe
from trace_core.records.spec import RecordSpec
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.launch import main
from trace_rl.rollout.engine import EmbeddedEngine, _SiteCache
from trace_rl.rollout.fp4_kv_engine import FP4AttentionEngine
from trace_rl.task import EOS, AdditionTask
from trace_rl.warmup import HF_DIR, make_tiny_model

TASK = AdditionTask(1)
RECIPES = [DEFAULT_RECIPE, "nvfp4-w4a4-nvfp4kv"]  # a kv_fp4 pool and an NVFP4 one
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tiny_model):
    out = tiny_model(10)
    return str(out / HF_DIR)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """The `small` preset (head dim 64, 3 query heads per KV head), a model shape like the ones served."""
    out = tmp_path_factory.mktemp("small")
    make_tiny_model(out, steps=4, preset="small", lr=1e-4)  # near its initialization: small logits
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


def _logprob_atol(top: float) -> float:
    """Four BF16 steps (ulps) at the largest |logit| `top`."""
    return 4 * 2.0 ** (math.floor(math.log2(max(top, 1.0))) - 7)


def _forced(engine: EmbeddedEngine, prompts: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(log-probs `[B, n]` the engine gives `tokens` after `prompts`, fed back one position per forward as
    `generate` feeds its samples; the largest |logit| seen)."""
    cache = _SiteCache(engine._kv_site, engine.model.config)
    logits = engine._forward(prompts.to(engine.device), cache, 0)
    out, top = [], 0.0
    for t in range(tokens.shape[1]):
        tok = tokens[:, t : t + 1].to(engine.device)
        out.append(torch.log_softmax(logits, -1).gather(1, tok)[:, 0])
        top = max(top, logits.abs().max().item())
        logits = engine._forward(tok, cache, prompts.shape[1] + t)
    return torch.stack(out, 1).cpu(), top


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pool_holds_the_attended_values_and_decode_reads_it(request, device, recipe):
    model_dir = request.getfixturevalue("tiny_dir" if device == "cpu" else "small_dir")
    prompts = TASK.prompts(torch.tensor([[3, 4], [9, 9], [0, 1]]))
    spec = RecordSpec(bits=2, moe_layers=(1,), attn_layers=(1,), recipe=recipe)
    engine = FP4AttentionEngine(model_dir, spec=spec, max_batch=4, max_len=TASK.prompt_len + 4, device=device)
    assert engine.kv_fmt is get_recipe(recipe).k.fmt
    engine.tap = tap = _KVTap()
    calls = []
    decode = engine.decode_attention

    def checked_decode(layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        out = decode(layer, q, scaling)
        calls.append(layer)
        if out.is_cuda:  # the kernel ran: against the twin on the same pool and pages
            pool = (*engine.kv_pool[(layer, "k")], *engine.kv_pool[(layer, "v")])
            twin = decode_attention_reference(q.contiguous(), *pool, *engine.decode_pages(q.shape[0]), scaling,
                                              kv_fmt=engine.kv_fmt)  # fmt: skip
            torch.testing.assert_close(out, twin, rtol=2**-7, atol=2**-7)
        return out

    engine.decode_attention = checked_decode
    ours = engine.generate(prompts, 4, eos=EOS, seed=0)
    steps = len(tap.slots) - 1  # forwards after the prefill
    layers = engine.model.config.num_hidden_layers
    assert calls == list(range(layers)) * steps  # every decode forward, every layer, read the pool
    for values, slots in zip(tap.values, tap.slots, strict=False):
        for (layer, kind), y in values.items():
            codes, scales = engine.kv_pool[(layer, kind)]
            got = dequantize_kv(codes[slots], scales[slots], fmt=engine.kv_fmt).reshape(y.shape)
            assert torch.equal(got, y), (layer, kind)

    # the reference scores our tokens (rows past their EOS are padded with it; those positions are not compared)
    n = max(len(t.logprobs) for t in ours)
    tokens = torch.stack([torch.cat([t.tokens[t.prompt_len :], torch.full((n,), EOS)])[:n] for t in ours])
    ref = EmbeddedEngine(model_dir, fp4=True, spec=spec, max_batch=4, max_len=TASK.prompt_len + 4, device=device)
    theirs, top = _forced(ref, prompts, tokens)
    for i, t in enumerate(ours):
        torch.testing.assert_close(t.logprobs, theirs[i, : len(t.logprobs)], rtol=0, atol=_logprob_atol(top))


RL = dict(prompts_per_step=2, group_size=2, max_new_tokens=3, steps=1, loggers="none", fp4_attention="decode")


@pytest.mark.parametrize("recipe", RECIPES)
def test_rl_step_with_fp4_attention_reads_the_pool(tiny_model, tmp_path, recipe):
    evaluation = dict(eval_data="addition", eval_every=1, eval_prompts=2, eval_k=2)
    cfg = RLConfig(model_dir=str(tiny_model(10)), out_dir=str(tmp_path), mode="trace", rollout_workers=1,
                   recipe=recipe, **RL, **evaluation)  # fmt: skip
    with Controller(cfg) as ctrl:
        (worker,) = ctrl.pool.workers
        engine = worker.engine
        assert isinstance(engine, FP4AttentionEngine)
        batch = ctrl.rollout(0)
        # one batch per prompt length; each decode forward (one per token sampled by its longest row) reads the pool
        # once per layer
        longest: dict[int, int] = {}
        for t in batch.trajectories:
            longest[t.prompt_len] = max(longest.get(t.prompt_len, 0), len(t.response))
        assert batch.decode_reads == engine.model.config.num_hidden_layers * sum(longest.values()) > 0
        assert all(codes.any() and scales.any() for codes, scales in engine.kv_pool.values())
        ctrl.pending.append(batch)
        metrics = ctrl.train_step()
    assert metrics["rollout/fp4_decode_reads"] == batch.decode_reads
    assert metrics["eval/fp4_decode_reads"] > 0  # the held-out evaluation's rollouts, counted apart
    assert metrics["trace/rtn_fallback_real_tokens"] == 0  # the trainer is guided by this rollout's records
    assert math.isfinite(metrics["train_rollout_logprob_abs_diff"])
    with pytest.raises(ValueError, match="written with fp4_attention='decode', the config has 'off'"):
        Controller(cfg.replace(fp4_attention="off"))  # the step's checkpoint: a resume keeps the rollout numerics


def test_launcher_runs_the_fp4_modes_with_fp4_attention(tiny_model, tmp_path):
    table = main(
        [f"model_dir={tiny_model(10)}", f"out_dir={tmp_path}", "rollout_workers=1"]
        + [f"{k}={v}" for k, v in RL.items()]
    )
    assert list(table) == ["qat", "trace"]
    title = "TRACE embedded default: FP4 + QAT vs FP4 + TRACE, decode attention from the FP4 KV pool"
    assert title in " ".join((tmp_path / "summary.txt").read_text().split())
    for mode in table:
        (line,) = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        assert json.loads(line)["rollout/fp4_decode_reads"] > 0
