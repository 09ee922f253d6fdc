"""The algorithm settings of the RL loop (`trace_rl.algorithm`) on the trainers: at their defaults both the
single-rank trainer and the trainer group (DP = 2, two micro-batches per rank) reproduce today's numbers bit for bit
(the reference of `tests/data/rl_defaults_reference.json` for this torch build and CPU kind, recorded by
`tests/rl_reference.py` before the settings existed); set, each one changes the run as it should (clip-higher,
aggregation, GSPO, KL with its reference policy only when its coefficient is non-zero, entropy, weight decay,
gradient clipping, the learning-rate schedule, top-k)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.rl_reference import GROUP, REPRODUCIBLE_ENV, cpu_kind, reproduce, run
from tests.rl_small import SMALL_RUN
from trace_rl.config import RLConfig
from trace_rl.controller import Controller, RewardError
from trace_rl.optim import LRSchedule
from trace_rl.rollout.engine import filter_probs

REFERENCES = json.loads((Path(__file__).parents[1] / "data" / "rl_defaults_reference.json").read_text())["references"]
NEW_KEYS = {"actor/lr", "reward/zero_variance_groups"}  # metrics added with the settings (not in the reference)
# Bytes of the record-store directory per token: the store's file format (its index, bindings), not the algorithm.
FORMAT_KEYS = {"trace/record_bytes_per_token"}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model(10))


def _reference() -> dict:
    """The reference recorded with this torch build, `REPRODUCIBLE_ENV` and CPU kind (its BF16 extensions)."""
    here = (torch.__version__, REPRODUCIBLE_ENV, cpu_kind())
    for ref in REFERENCES:
        if (ref["torch"], ref["env"], ref["cpu"]) == here:
            return ref
    kinds = [(ref["torch"], ref["cpu"]) for ref in REFERENCES]
    pytest.skip(f"no reference for torch / env / CPU {here}, only for {kinds}: record one (tests/rl_reference.py)")


def _reproduce(tmp_path: Path, layout: str) -> dict:
    """Today's numbers of `layout`, run as the reference was (`tests/rl_reference.py`: a fresh process under
    `REPRODUCIBLE_ENV`, so the bits do not depend on the CPU's vendor or core count)."""
    return reproduce(tmp_path / f"{layout}.json", [layout], timeout=600)[layout]


def _assert_reference(got: dict, want: dict) -> None:
    assert got["weights_sha256"] == want["weights_sha256"]
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert set(g) - NEW_KEYS == set(w), set(g) ^ set(w)
        for k, v in w.items():
            if k in FORMAT_KEYS:
                continue
            assert g[k] == v or (isinstance(v, float) and math.isnan(v) and math.isnan(g[k])), (w["step"], k)


def test_single_rank_defaults_reproduce_todays_numbers(tmp_path):
    want = _reference()["single"]
    got = _reproduce(tmp_path, "single")
    _assert_reference(got, want)
    assert all(m["actor/lr"] == RLConfig().lr for m in got["metrics"])


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_group_defaults_reproduce_todays_numbers(tmp_path):
    pytest.importorskip("ray")
    want = _reference()["group"]
    _assert_reference(_reproduce(tmp_path, "group"), want)


def _cfg(model_dir, out, **kw) -> RLConfig:
    return RLConfig(model_dir=model_dir, out_dir=str(out), **(SMALL_RUN | kw))


def test_kl_keeps_a_reference_policy_only_with_a_coefficient(model_dir, tmp_path):
    """kl_coef = 0 (the default) builds no reference model; kl_coef > 0 builds one from the initial weights, counts
    its bytes, and its KL is 0 at step 0 (the policy is the reference there, bit for bit) and positive after the
    first update. The entropy term is reported when its coefficient is set."""
    with Controller(_cfg(model_dir, tmp_path / "off"), resume=False) as ctrl:
        assert ctrl.trainer.ref is None and ctrl.trainer.ref_bytes == 0
    cfg = _cfg(model_dir, tmp_path / "on", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    with Controller(cfg, resume=False) as ctrl:
        history = ctrl.run()
        params = sum(p.numel() * p.element_size() for p in ctrl.trainer.model.parameters())
        assert ctrl.trainer.ref_bytes == params
    assert [m["memory/reference_bytes"] for m in history] == [float(params)] * 2
    assert history[0]["actor/kl_loss"] == 0.0 and history[1]["actor/kl_loss"] > 0
    assert all(m["actor/entropy"] > 0 for m in history)


def test_lr_schedule_by_hand(model_dir, tmp_path):
    """Warm-up (step + 1) / warmup, then cosine / linear decay to min_lr_ratio over the remaining updates; the
    trainer takes each update at the scheduled rate (`actor/lr`)."""
    cos = LRSchedule(warmup_steps=2, style="cosine", total_steps=6, min_lr_ratio=0.1)
    want = [
        0.5,
        1.0,
        1.0,
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),
        0.1 + 0.9 * 0.5,
        0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)),
    ]
    assert [cos.factor(s) for s in range(6)] == pytest.approx(want)
    lin = LRSchedule(style="linear", total_steps=4)
    assert [lin.factor(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert LRSchedule().is_constant and not LRSchedule(warmup_steps=1).is_constant
    cfg = _cfg(model_dir, tmp_path, lr_warmup_steps=2, weight_decay=0.1, grad_clip=0.5)
    with Controller(cfg, resume=False) as ctrl:
        history = ctrl.run()
        assert ctrl.trainer.clip_grad == 0.5
    assert [m["actor/lr"] for m in history] == [cfg.lr / 2, cfg.lr]


def test_weight_decay_is_decoupled_and_spares_the_norms(model_dir, tmp_path):
    """With zero gradients Adam's first update is 0, so what moves is the decay alone: every matrix's master is
    multiplied by 1 - lr * weight_decay, the 1-D norm weights are unchanged (Megatron's convention)."""
    with Controller(_cfg(model_dir, tmp_path, weight_decay=0.1), resume=False) as ctrl:
        trainer = ctrl.trainer
        before = [m.detach().clone() for m in trainer.master]
        for m in trainer.master:
            m.grad = torch.zeros_like(m)
        trainer._update()
        factor = torch.tensor(1 - trainer.peak_lr * 0.1, dtype=torch.float32)
        assert any(b.dim() == 1 for b in before)
        for b, m in zip(before, trainer.master, strict=True):
            assert torch.equal(m.detach(), b * factor if b.dim() > 1 else b)


def test_filter_probs_by_hand():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    torch.testing.assert_close(filter_probs(p, top_k=2), torch.tensor([[0.0, 0.4, 0.0, 0.3]]))
    # top_p = 0.6: 0.4 (mass before 0), 0.3 (before 0.4 < 0.6) kept; 0.2 (before 0.7) dropped.
    torch.testing.assert_close(filter_probs(p, top_p=0.6), torch.tensor([[0.0, 0.4, 0.0, 0.3]]))
    torch.testing.assert_close(filter_probs(p, top_p=0.75), torch.tensor([[0.0, 0.4, 0.2, 0.3]]))
    torch.testing.assert_close(filter_probs(p, top_p=0.3), torch.tensor([[0.0, 0.4, 0.0, 0.0]]))


def test_top_k_1_samples_greedily_and_zero_variance_is_warned(model_dir, tmp_path, capsys):
    """top_k = 1 samples each group's argmax response, so every group's samples (and rewards) are equal: each step
    warns and counts its zero-variance groups, and the run says how many steps trained nothing. The samples land in
    samples.jsonl with prompt, response, reward, Δ logp and version."""
    cfg = _cfg(model_dir, tmp_path, top_k=1, samples_per_step=2, loggers="tensorboard")
    with Controller(cfg, resume=False) as ctrl:
        batch = ctrl.rollout(0)
        for g in range(cfg.prompts_per_step):
            group = batch.trajectories[g * cfg.group_size : (g + 1) * cfg.group_size]
            assert all(torch.equal(t.tokens, group[0].tokens) for t in group)
        ctrl.pending.append(batch)
        history = ctrl.run()
    assert [m["reward/zero_variance_groups"] for m in history] == [float(cfg.prompts_per_step)] * 2
    err = capsys.readouterr().err
    assert "warning: step 0: all 2 groups have zero reward variance" in err
    assert "2 of 2 steps trained nothing" in err
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["trajectory"]) for r in rows] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    assert set(rows[0]) == {"step", "version", "trajectory", "prompt", "response", "reward", "logprob_abs_diff"}
    assert rows[0]["prompt"].endswith("=") and rows[2]["version"] == 1
    assert 0 <= rows[0]["logprob_abs_diff"] < 0.1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = [e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")]
    assert len(text) == 2 and text[0].startswith("| step | version | trajectory | reward |")
    assert rows[0]["response"].replace("|", "\\|") in text[0]


_calls = {"n": 0}


def interrupting_reward(response: str, answer: str | None, metadata: dict) -> float:
    """`varied_reward` that sends this process a SIGINT at its first call (during step 0's rollout)."""
    _calls["n"] += 1
    if _calls["n"] == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return float(sum(map(ord, response)) % 3)


def test_ctrl_c_saves_a_checkpoint_at_the_step_end_and_resume_says_so(model_dir, tmp_path, capsys):
    cfg = _cfg(model_dir, tmp_path, steps=3, reward=f"{__name__}:interrupting_reward", reward_workers=0)
    _calls["n"] = 0
    with Controller(cfg, resume=False) as ctrl, pytest.raises(SystemExit) as stop:
        ctrl.run()
    assert stop.value.code == 130
    assert "interrupted: checkpoint of step 1 saved" in capsys.readouterr().err
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["reward"] == cfg.reward and config["steps"] == 3
    with Controller(cfg) as ctrl:
        assert ctrl.step == 1
        assert "resumed from step 1" in capsys.readouterr().out
        assert len(ctrl.run()) == 3
    assert " 1/3 " in capsys.readouterr().err  # the progress bar starts at the resumed step


def test_eval_before_train_evaluates_a_fresh_run_once(model_dir, tmp_path, capsys):
    cfg = _cfg(model_dir, tmp_path, steps=1, eval_data="addition", eval_every=1, eval_prompts=4, eval_k=2)
    with Controller(cfg.replace(eval_before_train=True), resume=False) as ctrl:
        ctrl.run()
    out = capsys.readouterr().out
    initial = json.loads(out.split("evaluation before training: ", 1)[1].splitlines()[0])
    assert set(initial) >= {"eval/mean@2", "eval/pass@1", "eval/pass@2"}
    with Controller(cfg.replace(eval_before_train=True, steps=2)) as ctrl:  # resumed: not again
        ctrl.run()
    assert "evaluation before training" not in capsys.readouterr().out


def raising_reward(response: str, answer: str | None, metadata: dict) -> float:
    raise ZeroDivisionError("division by zero")


def nan_reward(response: str, answer: str | None, metadata: dict) -> float:
    return float("nan")


@pytest.mark.parametrize(
    ("fn", "what"), [("raising_reward", "raised ZeroDivisionError: division by zero"), ("nan_reward", "returned nan")]
)
def test_a_bad_reward_names_the_prompt(model_dir, tmp_path, fn, what):
    cfg = _cfg(model_dir, tmp_path, reward=f"{__name__}:{fn}", reward_workers=0)
    with Controller(cfg, resume=False) as ctrl, pytest.raises(RewardError) as e:
        ctrl.train_step()
    message = str(e.value)
    assert f"reward='{__name__}:{fn}' {what} at step 0, trajectory 0, prompt addition (" in message
    assert message.endswith("it must return a finite float for every response") and "\n" not in message


# A train-rollout log-prob difference subtracts two FP32 log-probs of magnitude up to ~10, each summed in another
# order by each layout: its noise is a few FP32 ulps of the log-probs (measured 1.2e-6 on an Intel CPU), absolute,
# not relative to the small difference.
LOGPROB_DIFF_KEYS = {f"train_rollout_logprob_{s}" for s in ("diff_max", "diff_min", "abs_diff")}
LOGPROB_DIFF_ATOL = 1e-5
SETTINGS = dict(
    kl_coef=0.1,
    kl_estimator="k3",
    entropy_coef=0.01,
    loss_agg_mode="seq-mean-token-mean",
    clip_ratio_high=0.28,
    policy_loss="gspo",
    lr_warmup_steps=2,
    weight_decay=0.01,
    trainer_dtype="float32",
)


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [dict(tp=2, ep=2), GROUP, dict(pp=2, train_micro_batch=4)],
    ids=["tp2_ep2", "dp2_microbatch2", "pp2_microbatch4"],
)
def test_the_group_applies_the_settings_as_one_rank(model_dir, tmp_path, layout):
    """Every non-default setting at once (GSPO, clip-higher, sequence aggregation, KL with its reference forward
    through Megatron's schedule, entropy over the vocab-parallel logits, warm-up, weight decay) on the trainer group
    gives the single rank's metrics (FP32 trainer; rtol 1e-4 as tests/megatron/test_megatron_parallel_rl.py
    explains; the train-rollout log-prob differences within `LOGPROB_DIFF_ATOL`)."""
    ray = pytest.importorskip("ray")
    single = run(model_dir, str(tmp_path / "single"), **SETTINGS)["metrics"]
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        group = run(model_dir, str(tmp_path / "group"), **SETTINGS, **layout)["metrics"]
    finally:
        ray.shutdown()
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
    assert single[1]["actor/kl_loss"] > 0 and single[0]["actor/entropy"] > 0
    for g, s in zip(group, single, strict=True):
        assert set(g) == set(s)
        for k, v in s.items():
            if k == "memory/reference_bytes":  # every rank's shards: TP replicates the norms
                assert g[k] >= v
            elif isinstance(v, float):
                atol = LOGPROB_DIFF_ATOL if k in LOGPROB_DIFF_KEYS else 1e-6
                assert g[k] == pytest.approx(v, rel=1e-4, abs=atol), (s["step"], k)


def test_reward_processes_ignore_ctrl_c():
    """A terminal's Ctrl-C reaches the reward processes too: they ignore it, so the step they score finishes."""
    import signal

    from trace_rl.rewards import RewardPool, _sigint_ignored

    before = signal.getsignal(signal.SIGINT)  # a background job's shell may already ignore it
    pool = RewardPool("exact_match", 1, "process")
    try:
        assert pool.executor.submit(_sigint_ignored).result() is True
    finally:
        pool.close()
    assert signal.getsignal(signal.SIGINT) is before  # the controller's own process keeps its handler
