"""Precision recipes: lookup and validation, the record layout they imply, MXFP8 against an independent reference,
and, per shipped recipe, the embedded engine's rollout against the trainer's site code at every site.

The engine runs its real batched generation on a tiny transformers Qwen3-MoE; an `ActivationTap` hands over the
rows every site quantized and the values the engine used, a `TorchFunctionMode` observes the expert GEMM operands.
The trainer's `SiteNumerics` (the code Megatron runs at each site) must give bit-identical values on the same rows,
and the engine's records must hold the reference quantizer's codes of those rows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron_trace.config import TraceConfig
from megatron_trace.sites import SiteNumerics
from megatron_trace.source import SiteRows
from trace_core.kernels import record_buffers
from trace_core.numerics import e2m1
from trace_core.numerics.e2m1 import pack_fp4
from trace_core.numerics.formats import KV_FP4, MXFP4, NVFP4, FP4Format
from trace_core.numerics.mxfp8 import MXFP8, dequantize_mxfp8, quantize_mxfp8
from trace_core.numerics.quant import dequantize, quantize, scale_factors
from trace_core.numerics.recipe import DEFAULT_RECIPE, Role, Scale, get_recipe, recipe_names
from trace_core.numerics.role_quant import kv_pool_bytes, kv_pool_format, quantize_role, rollout_rtn
from trace_core.records.capture import SiteBuffers
from trace_core.records.spec import Binding, Record, RecordSpec, pack_low_bits
from trace_rl.config import ConfigError, RLConfig

RECIPES = recipe_names()
H, INTER, E, TOPK, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 4, 2, 2, 4, 2, 16


def test_shipped_recipes_and_lookup_errors():
    assert RECIPES == ("nvfp4-w4a4-kv4", "mxfp4-w4a4-kv4", "mxfp4-w4a8-kv4", "nvfp4-w4a4-nvfp4kv")
    assert DEFAULT_RECIPE == RECIPES[0]
    with pytest.raises(ValueError, match=r"'nvfp5-w4a4'.*known recipes: \['nvfp4-w4a4-kv4', 'mxfp4-w4a4-kv4', "):
        get_recipe("nvfp5-w4a4")
    with pytest.raises(ConfigError, match=r"recipe='mxfp4' is not one of"):
        RLConfig(recipe="mxfp4")
    with pytest.raises(ValueError, match="unknown precision recipe 'fp4'"):
        TraceConfig(recipe="fp4")
    with pytest.raises(ValueError, match="unknown precision recipe"):
        Binding(0, 0, "t", "a", "d", recipe="nvfp4")
    with pytest.raises(ValueError, match="mxfp4 has only E8M0 block scales"):
        Role(MXFP4, Scale.PER_TOKEN)
    with pytest.raises(ValueError, match="kv_fp4 has only E8M0 block scales; got scale static"):
        Role(KV_FP4, Scale.STATIC)  # a static scale sits above the blocks: formats with a global scale only
    with pytest.raises(ValueError, match="nvfp4 has a global scale above its blocks; got scale per_block"):
        Role(NVFP4, Scale.PER_BLOCK)
    with pytest.raises(ValueError, match="records hold FP4 codes only"):
        Role(MXFP8, Scale.PER_BLOCK, recorded=True)
    with pytest.raises(ValueError, match="unknown role 'fc1_in'"):
        get_recipe(DEFAULT_RECIPE).role("fc1_in")


def test_record_spec_layout_follows_the_recipe():
    layers = (0, 1, 2, 3)
    today = RecordSpec.default(layers, layers)
    assert (today.moe_format, today.kv_format, today.per_token_scale, today.recipe) == ("nvfp4", "kv_fp4", True, None)
    nv = RecordSpec.default(layers, layers, recipe="nvfp4-w4a4-kv4")
    assert (nv.moe_format, nv.kv_format, nv.per_token_scale, nv.sites()) == ("nvfp4", "kv_fp4", True, today.sites())
    mx = RecordSpec.default(layers, layers, recipe="mxfp4-w4a4-kv4")
    assert (mx.moe_format, mx.kv_format, mx.moe_layers, mx.attn_layers) == ("mxfp4", "kv_fp4", layers, layers)
    w4a8 = RecordSpec.default(layers, layers, recipe="mxfp4-w4a8-kv4")  # FP8 MoE input: nothing to record there
    assert (w4a8.moe_format, w4a8.moe_layers, w4a8.sites()) == (None, (), [(i, kv) for i in layers for kv in "kv"])
    nvkv = RecordSpec.default(layers, layers, recipe="nvfp4-w4a4-nvfp4kv")
    assert (nvkv.moe_format, nvkv.kv_format, nvkv.per_token_scale, nvkv.sites()) == ("nvfp4", "nvfp4", True, nv.sites())
    assert (mx.per_token_scale, w4a8.kv_format, w4a8.per_token_scale) == (False, "kv_fp4", False)
    with pytest.raises(TypeError, match="moe_format"):  # derived from the recipe, never given (cannot disagree)
        RecordSpec(moe_layers=(1,), moe_format="nvfp4", recipe="mxfp4-w4a4-kv4")
    with pytest.raises(AttributeError):
        mx.moe_format = "nvfp4"
    with pytest.raises(ValueError, match="'mxfp4-w4a8-kv4' does not record moe_in"):
        RecordSpec(moe_layers=(1,), recipe="mxfp4-w4a8-kv4")
    # engines and trainer refuse a spec written for another recipe, or a layout their recipe does not write
    with pytest.raises(ValueError, match="record spec of recipe 'mxfp4-w4a4-kv4' used under precision recipe"):
        TraceConfig(spec=mx, recipe="nvfp4-w4a4-kv4")
    with pytest.raises(ValueError, match="is not what recipe mxfp4-w4a4-kv4 records"):
        TraceConfig(spec=today, recipe="mxfp4-w4a4-kv4")
    with pytest.raises(ValueError, match=r"k/v kv_fp4\) is not what recipe nvfp4-w4a4-nvfp4kv records .* k/v nvfp4\)"):
        TraceConfig(spec=today, recipe="nvfp4-w4a4-nvfp4kv")
    assert TraceConfig(spec=today).recipe.name == DEFAULT_RECIPE and TraceConfig(spec=mx).recipe.name == mx.recipe


def _e4m3_grid() -> tuple[list[float], list[int]]:
    """Every finite non-negative E4M3 value with its byte (decoded one by one, no rounding involved)."""
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    return [(v, b) for b, v in enumerate(values) if math.isfinite(v)]


def test_mxfp8_matches_an_independent_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=gen) * torch.logspace(-6, 4, 6).view(-1, 1)
    x[2, :32] = 0.0  # an all-zero block
    x[3, 5] = 3.0 * 2.0**-9 * x[3, :32].abs().max() / 448  # lands on an E4M3 tie after scaling
    codes, scales = quantize_mxfp8(x)
    grid = _e4m3_grid()
    for r in range(x.shape[0]):
        for blk in range(2):
            block = x[r, 32 * blk : 32 * (blk + 1)].tolist()
            amax = max(abs(v) for v in block)
            e = -127 if amax == 0 else math.ceil(math.log2(float(torch.tensor(amax / 448, dtype=torch.float32))))
            assert int(scales[r, blk]) - 127 == e
            for i, v in enumerate(block):
                a = min(abs(v) * 2.0**-e, 448.0)
                best = min(grid, key=lambda g: (abs(g[0] - a), g[1] & 1))  # nearest, ties to the even mantissa
                assert int(codes[r, 32 * blk + i]) == best[1] | (0x80 if math.copysign(1, v) < 0 else 0), (r, i, v)
    values = dequantize_mxfp8(codes, scales)
    assert torch.equal(values, torch.where(codes & 0x80 > 0, -1.0, 1.0) * values.abs())
    with pytest.raises(ValueError, match="multiple of the block 32"):
        quantize_mxfp8(torch.randn(2, 48))


def _reference_values(role: Role, x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest values of rows `x` under `role` from the reference quantizers (not `role_quant`)."""
    if not isinstance(role.fmt, FP4Format):
        return dequantize_mxfp8(*quantize_mxfp8(x), x.dtype)
    scale = {Scale.PER_TOKEN: {"per_token": True}, Scale.STATIC: {"global_scale": 1.0}}.get(role.scale, {})
    return dequantize(quantize(x, role.fmt, **scale), x.dtype)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=E,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("recipe-model")
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


class _Tap:
    """Every site's rows (x) and the values the engine used (y), with the KV slots of each forward."""

    def __init__(self) -> None:
        self.rows: list[tuple[tuple[int, str], torch.Tensor, torch.Tensor]] = []
        self.by_slot: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
        self._pending: list[tuple[tuple[int, str], torch.Tensor]] = []

    def site(self, site, x, y) -> None:
        self.rows.append((site, x.clone(), y.clone()))
        self._pending.append((site, x.clone()))

    def forward_end(self, slots) -> None:
        for site, x in self._pending:
            for slot, row in zip(slots.tolist(), x, strict=True):
                self.by_slot.setdefault(site, {})[slot] = row
        self._pending.clear()


class _ExpertGemms(TorchFunctionMode):
    """(input, weight) of every `F.linear` call; the calls run unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.calls.append((args[0].detach().clone(), args[1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", RECIPES)
def test_engine_rollout_and_trainer_sites_agree_bit_for_bit(tiny_hf, name):
    from transformers import Qwen3MoeForCausalLM

    from trace_rl.rollout.engine import EmbeddedEngine

    recipe = get_recipe(name)
    layers = tuple(range(LAYERS))
    spec = RecordSpec.of_recipe(name, layers, layers, 4)
    max_len = 8
    engine = EmbeddedEngine(tiny_hf, fp4=True, spec=spec, max_batch=2, max_len=max_len, recipe=name)
    engine.tap = tap = _Tap()
    prompts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with _ExpertGemms() as gemms:
        trajs = engine.generate(prompts, 3, eos=31, seed=0)
    trainer = SiteNumerics(TraceConfig(mode="qat", spec=spec, recipe=name, replay_routes=False))

    # activation sites (moe_in, k, v of every layer): the trainer's RTN is the engine's value, and the reference's
    kinds = {site[1] for site, _, _ in tap.rows}
    assert kinds == {"moe_in", "k", "v"}
    for site, x, y in tap.rows:
        assert torch.equal(trainer.activation(site, x, None), y), (name, site)
        assert torch.equal(_reference_values(recipe.role(site[1]), x), y), (name, site)

    # records: the engine's kernel-written codes and scales are the trainer's reference codes of the same rows
    assert set(trajs[0].records.records) == set(spec.sites())
    for i, t in enumerate(trajs):
        for site, rec in t.records.records.items():
            rows = torch.stack([tap.by_slot[site][i * max_len + p] for p in range(t.records.num_tokens)])
            q = quantize_role(recipe.role(site[1]), rows)
            assert rec.fmt == q.fmt and torch.equal(rec.low_bits, pack_low_bits(q.codes, 4)), (name, site)
            assert torch.equal(rec.scales, q.scales)
            assert (rec.global_scale is None) == (q.global_scale is None)
            if q.global_scale is not None:  # per token, or the static S_enc repeated per row
                assert torch.equal(rec.global_scale, q.global_scale.expand_as(rec.global_scale))

    # expert weights and FC2 inputs: each FC1 GEMM of an expert is followed by its FC2 GEMM
    original = Qwen3MoeForCausalLM.from_pretrained(tiny_hf, dtype=torch.bfloat16)
    checked = 0
    for layer in range(LAYERS):
        ours, theirs = engine.model.model.layers[layer].mlp.experts, original.model.layers[layer].mlp.experts
        w13 = {ours.gate_up_proj[e].data_ptr(): e for e in range(E)}
        for e in range(E):
            assert torch.equal(trainer.weight(theirs.gate_up_proj[e]), ours.gate_up_proj[e]), (name, layer, e)
            assert torch.equal(trainer.weight(theirs.down_proj[e]), ours.down_proj[e]), (name, layer, e)
        for (x, w), (h_used, w2) in zip(gemms.calls, gemms.calls[1:], strict=False):
            e = w13.get(w.data_ptr())
            if e is None:
                continue
            assert w2.data_ptr() == ours.down_proj[e].data_ptr()
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            h = F.silu(gate) * up
            assert torch.equal(trainer.fc2_input(h), h_used), (name, layer, e)
            assert torch.equal(_reference_values(recipe.fc2_in, h), h_used)
            checked += 1
    assert checked >= LAYERS * 3  # prefill + 3 decode forwards route to experts of every layer


RECORDED = [(n, kind) for n in RECIPES for kind in ("moe_in", "k") if get_recipe(n).recorded(kind)]
"""(recipe, site kind) of every recorded role (V is K's role in every recipe)."""


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize(("name", "kind"), RECORDED)
def test_guided_rounding_recovers_every_adjacent_rollout_codeword(name, kind, bits):
    """The record the rollout-side quantizer writes (`role_quant.rollout_rtn` into staging buffers, as the engines
    do; an NVFP4 K/V record carries S_enc = 1 per row) holds the reference's codes, and guides the trainer's site on
    a perturbed copy of the rows: every rollout codeword adjacent to the trainer's bracket is recovered, and rows
    without a record take exactly the role's RTN (the reference's, not a per-token rescale)."""
    role = get_recipe(name).role(kind)
    gen = torch.Generator().manual_seed(bits)
    rollout = (torch.randn(16, H, generator=gen) * 2).to(torch.bfloat16)
    train = (rollout.float() + 0.15 * torch.randn(rollout.shape, generator=gen)).to(torch.bfloat16)
    low, scales, _ = record_buffers(16, H, role.fmt, bits, "cpu")
    gs = torch.full((16, 1), float("nan")) if role.fmt.has_global_scale else None
    rollout_rtn(role, rollout, bits, SiteBuffers(low, scales, gs))
    q = quantize_role(role, rollout)
    assert torch.equal(low, pack_low_bits(q.codes, bits)) and torch.equal(scales, q.scales)
    if gs is not None:
        assert torch.equal(gs, q.global_scale.expand_as(gs))
    has = torch.arange(16) % 5 != 4
    spec = RecordSpec.of_recipe(name, (0,), (0,), bits)
    trainer = SiteNumerics(TraceConfig(mode="trace", spec=spec))
    y = trainer.activation((0, kind), train, SiteRows(Record(role.fmt, bits, H, low, scales, gs), has))
    assert torch.equal(y[~has], _reference_values(role, train)[~has])
    _, encode = scale_factors(role.fmt, q.scales, q.global_scale)
    z = torch.clamp(train.float() * encode.repeat_interleave(role.fmt.block, dim=-1), -6, 6)
    grid = sorted({s * m for m in e2m1.MAGNITUDES for s in (-1.0, 1.0)})
    rolled, rollout_values = e2m1.code_values(q.codes), dequantize(q, torch.bfloat16)
    adjacent = 0
    columns = (z[has].flatten().tolist(), rolled[has].flatten().tolist(), (y[has] == rollout_values[has]).flatten())
    for zi, qr, same in zip(*columns, strict=True):
        lo, hi = max(g for g in grid if g <= zi), min(g for g in grid if g >= zi)
        if qr in (lo, hi):
            adjacent += 1
            assert same
    assert adjacent > 0.9 * y[has].numel()
    metrics = trainer.metrics()
    assert metrics[f"trace/L0.{kind}/guided"] == y[has].numel() and metrics["trace/rtn_fallback"] == y[~has].numel()


@pytest.mark.parametrize("name", RECIPES)
def test_kv_pool_bytes_are_the_reference_quantizers(name):
    """`role_quant.kv_pool_bytes` of K/V rows under the recipe's K role: the pool's packed codes and scale bytes of
    the reference quantizer (kv_fp4, or NVFP4 at S_enc = 1), byte for byte; other roles have no pool."""
    role = get_recipe(name).k
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(9, KV_HEADS * HEAD_DIM, generator=gen) * torch.logspace(-2, 2, 9)[:, None]).to(torch.bfloat16)
    codes, scales = kv_pool_bytes(role, x)
    q = quantize(x, role.fmt, **({"global_scale": 1.0} if role.fmt is NVFP4 else {}))
    assert kv_pool_format(role) is role.fmt and torch.equal(codes, pack_fp4(q.codes)) and torch.equal(scales, q.scales)
    for other in (Role(MXFP4, Scale.PER_BLOCK), Role(NVFP4, Scale.PER_TOKEN)):
        with pytest.raises(ValueError, match=f"holds kv_fp4 or static-scale nvfp4 K/V; got {other.fmt.name} with"):
            kv_pool_bytes(other, x)


def test_packed_expert_export_only_where_sglang_loads_it():
    from megatron_trace.export import check_packed_export

    check_packed_export("nvfp4-w4a4-kv4")  # ModelOpt NVFP4 (tests/megatron/test_megatron_export.py decodes it)
    for name in ("mxfp4-w4a4-kv4", "mxfp4-w4a8-kv4"):
        with pytest.raises(ValueError, match=f"packed routed-expert export for recipe {name} .*refused"):
            check_packed_export(name)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> str:
    from trace_rl.warmup import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-policy")
    make_tiny_model(out, steps=4, batch=8)  # the numerics, not the policy quality, are under test
    return str(out)


@pytest.mark.parametrize("name", [n for n in RECIPES if n != DEFAULT_RECIPE])  # the default: tests/rl/test_rl_loop.py
def test_demo_runs_each_recipe(tiny_policy, tmp_path, name):
    from trace_core.records.store import read_header, shard_paths, step_dir
    from trace_rl.launch import main

    size = ["steps=1", "prompts_per_step=2", "group_size=2", "max_new_tokens=3", "rollout_workers=1"]
    table = main([f"model_dir={tiny_policy}", f"out_dir={tmp_path}", f"recipe={name}", *size, "--modes", "qat,trace"])
    assert table["trace"]["RTN fallback (real tokens)"] == 0
    assert table["trace"]["code flips k/v"] < table["qat"]["code flips k/v"]
    if get_recipe(name).recorded("moe_in"):
        assert table["trace"]["code flips moe_in"] < table["qat"]["code flips moe_in"]
    else:  # FP8 MoE input: no record, nothing to compare
        assert math.isnan(table["trace"]["code flips moe_in"]) and math.isnan(table["qat"]["code flips moe_in"])
    shards = shard_paths(step_dir(tmp_path / "trace" / "records", 0))
    headers = [read_header(p) for p in shards]
    bindings = [entry["binding"] for h in headers for entry in h["trajectories"].values()]
    assert len(bindings) == 4 and {b["recipe"] for b in bindings} == {name}
    formats = {site["fmt"] for h in headers for e in h["trajectories"].values() for site in e["sites"].values()}
    recipe = get_recipe(name)
    assert formats == {recipe.role(kind).fmt.name for kind in ("moe_in", "k", "v") if recipe.recorded(kind)}


def test_records_of_another_recipe_are_refused_by_the_trainer_check(tmp_path):
    from trace_core.records.layout import TrajectoryRecords
    from trace_core.records.reader import BindingMismatchError, RecordReader
    from trace_core.records.store import StepWriter

    x = torch.randn(3, H)
    record = Record.from_quantized(quantize_role(get_recipe("mxfp4-w4a4-kv4").moe_in, x), 1)
    written = Binding(0, 0, "0", "a", "d", recipe="mxfp4-w4a4-kv4")
    StepWriter(tmp_path, 0).write({"0": TrajectoryRecords(3, {(1, "moe_in"): record}, binding=written)})
    reader = RecordReader(tmp_path, 0)
    reader.check_bindings({"0": written})
    with pytest.raises(BindingMismatchError, match="recipe 'mxfp4-w4a4-kv4' != expected 'nvfp4-w4a4-kv4'"):
        reader.check_bindings({"0": Binding(0, 0, "0", "a", "d")})


def test_a_record_in_another_format_than_its_binding_recipe_records_is_refused_on_read(tmp_path):
    """The shard header keeps each site's format (`fmt`, what `RecordSpec.moe_format` / `kv_format` derive from the
    recipe); the reader checks it against the recipe the trajectory is bound to and names the field."""
    from trace_core.records.layout import TrajectoryRecords
    from trace_core.records.reader import RecordReader
    from trace_core.records.store import CorruptShardError, StepWriter

    x = torch.randn(3, H)
    mx = Record.from_quantized(quantize_role(get_recipe("mxfp4-w4a4-kv4").moe_in, x), 1)
    nv = Record.from_quantized(quantize_role(get_recipe(DEFAULT_RECIPE).moe_in, x), 1)
    bind = {
        name: Binding(0, 0, name, "a", "d", recipe=recipe)
        for name, recipe in (("ok", "mxfp4-w4a4-kv4"), ("other", DEFAULT_RECIPE), ("unrecorded", "mxfp4-w4a8-kv4"))
    }
    writer = StepWriter(tmp_path, 0)
    for name, rec in (("ok", mx), ("other", mx), ("unrecorded", mx)):
        writer.write({name: TrajectoryRecords(3, {(1, "moe_in"): rec}, binding=bind[name])})
    writer.write({"unbound": TrajectoryRecords(3, {(1, "moe_in"): nv})})
    reader = RecordReader(tmp_path, 0)
    assert reader.load([("ok", 0, 3)]).records[(1, "moe_in")].fmt is MXFP4
    assert reader.load([("unbound", 0, 3)]).records[(1, "moe_in")].fmt is NVFP4  # no recipe named: not checked
    with pytest.raises(
        CorruptShardError,
        match=r"site 1.moe_in: fmt 'mxfp4' disagrees with the binding's recipe "
        r"'nvfp4-w4a4-kv4', which records it as 'nvfp4'",
    ):
        reader.load([("other", 0, 3)])
    with pytest.raises(CorruptShardError, match="fmt 'mxfp4' disagrees with .*'mxfp4-w4a8-kv4', which records no"):
        reader.load([("unrecorded", 0, 3)])


@pytest.mark.parametrize("name", RECIPES)
def test_fc2_input_codes_do_not_depend_on_the_tp_split(name):
    """Two tensor-parallel halves of FC2-input rows quantize to the halves of the full rows: NVFP4 with the max of the
    halves' row amax, the block-scaled formats with nothing exchanged."""
    from trace_core.numerics.fc2 import fc2_input_fake_quant, needs_row_amax, row_amax

    role = get_recipe(name).fc2_in
    gen = torch.Generator().manual_seed(9)
    h = (torch.randn(6, 2 * INTER, generator=gen) * torch.linspace(0.1, 30, 2 * INTER)).to(torch.bfloat16)
    halves = h[:, :INTER], h[:, INTER:]
    full_amax = torch.maximum(*(row_amax(p) for p in halves)) if needs_row_amax(role) else None
    split = torch.cat([fc2_input_fake_quant(p, role, full_amax) for p in halves], dim=1)
    assert torch.equal(split, fc2_input_fake_quant(h, role))
    assert needs_row_amax(role) == (name in ("nvfp4-w4a4-kv4", "nvfp4-w4a4-nvfp4kv"))
