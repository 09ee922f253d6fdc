"""Same-batch analyses (trace_rl.experiments.analysis) on the tiny model: activations of the engine and the trainer
matched by (trajectory, position), the ablation grid, and relative excess discrepancy; the wider-record guidance they
rely on."""

from __future__ import annotations

import pytest

from trace_core.records.spec import RecordSpec
from trace_rl.experiments.analysis import (
    BITS,
    LAYER_SETS,
    ablation_specs,
    analyze,
    captured_layers,
    flip_policy,
    record_bytes,
    relative_excess,
)
from trace_rl.warmup import PRESETS, make_tiny_model


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    make_tiny_model(out / "model", steps=20)
    return analyze(out / "model", out, batches=1, prompts=4, group_size=4, max_new_tokens=4)


def test_layer_sets():
    assert captured_layers(8, "all") == tuple(range(8))
    assert captured_layers(8, "half") == (4, 5, 6, 7)
    assert captured_layers(8, "quarter") == (6, 7)
    assert captured_layers(8, "first_half") == (0, 1, 2, 3)
    assert captured_layers(8, "every_other") == (0, 2, 4, 6)
    assert captured_layers(2, "quarter") == (1,)
    with pytest.raises(ValueError, match="flips"):
        captured_layers(8, "flips")
    specs = ablation_specs(8)
    assert len(specs) == len(BITS) * (len(LAYER_SETS) - 1)  # `flips` needs calibration flip rates
    assert specs["b2/quarter"] == RecordSpec(bits=2, moe_layers=(6, 7), attn_layers=(6, 7))


def test_flip_policy_takes_the_layers_of_highest_flip_rate_per_site_kind():
    rates = {f"trace/L{i}.moe_in/code_flip_rate": r for i, r in enumerate([0.1, 0.5, 0.2, 0.4])}
    rates |= {f"trace/L{i}.k/code_flip_rate": r for i, r in enumerate([0.3, 0.0, 0.0, 0.1])}
    rates |= {f"trace/L{i}.v/code_flip_rate": r for i, r in enumerate([0.3, 0.0, 0.2, 0.0])}
    assert flip_policy(rates, 4, 2) == ((1, 3), (0, 2))
    spec = ablation_specs(4, rates)["b1/flips"]
    assert (spec.moe_layers, spec.attn_layers) == ((1, 3), (0, 2))
    with pytest.raises(ValueError, match="cover layers"):
        flip_policy({k: v for k, v in rates.items() if "L3." not in k}, 4, 2)


def test_every_configuration_is_measured_on_one_batch(results):
    configs = [r["config"] for r in results]
    calib = next(r for r in results if r["batch"] < 0)
    assert configs == ["bf16", "qat", "qat", *ablation_specs(2, calib)]
    tiny = PRESETS["tiny"]
    for r in results:
        if "/" in r["config"]:  # bytes of the spec's captured sites, from the record layout
            spec = RecordSpec(
                bits=int(r["config"][1]), moe_layers=tuple(r["moe_layers"]), attn_layers=tuple(r["attn_layers"])
            )
            assert r["record_bytes_per_token"] == record_bytes(tiny, spec) > 0
        else:
            assert r["record_bytes_per_token"] == 0
        assert {f"mse/L{i}.{k}" for i in (0, 1) for k in ("moe_in", "k", "v")} <= set(r)
        assert r["train_rollout_logprob_abs_diff"] >= 0
        if "/" in r["config"]:  # the TRACE ablation entries
            assert r["trace/rtn_fallback_real_tokens"] == 0


def test_full_information_at_the_first_layer_reproduces_the_rollout(results):
    """Rows matched wrongly between engine and trainer would leave a large MSE; b = 4 guidance reproduces the
    rollout's values exactly wherever its code is reachable, which at layer 0 (inputs nearly equal) is everywhere."""
    full = next(r for r in results if r["config"] == "b4/all")
    qat = next(r for r in results if r["config"] == "qat" and r["batch"] == 0)
    for kind in ("moe_in", "k", "v"):
        assert full[f"mse/L0.{kind}"] == 0
        assert full[f"trace/L0.{kind}/code_flip_rate"] == 0
        assert qat[f"mse/L0.{kind}"] > 0
        assert qat[f"trace/L0.{kind}/code_flip_rate"] > 0
    flips = sum(qat[f"trace/flip_distance/{d}"] for d in range(1, 15))
    assert flips > 0 and qat["trace/flip_distance/1"] > 0


def test_relative_excess_against_the_bf16_batch(results):
    excess = relative_excess(results)
    assert set(excess) == {r["config"] for r in results} - {"bf16"}
    bf16 = next(r for r in results if r["config"] == "bf16")
    qat = next(r for r in results if r["config"] == "qat" and r["batch"] == 0)  # not the calibration batch's
    for site, value in excess["qat"].items():
        assert value == pytest.approx((qat[f"mse/{site}"] - bf16[f"mse/{site}"]) / bf16[f"mse/{site}"])
    assert all(v == -1 for s, v in excess["b4/all"].items() if s.startswith("L0."))
