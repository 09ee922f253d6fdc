"""Bring your own model and data, end to end: a tiny random HF Qwen3-MoE checkpoint (transformers, no download) is
imported, trained for two RL steps (trace mode) on the tiny JSONL math dataset with the Math-Verify reward and a
held-out evaluation, TensorBoard events are read back, and the exported policy reloads in transformers with the
rollout engine's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_tiny import make_hf_checkpoint
from trace_rl.config import load_config
from trace_rl.controller import Controller
from trace_rl.tracking import TENSORBOARD_DIR

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    model = make_hf_checkpoint(root / "hf")
    cfg = load_config(
        None,
        [
            f"model_dir={model}",
            f"out_dir={root / 'run'}",
            f"data={DATA / 'math_tiny.jsonl'}",
            f"eval_data={DATA / 'math_tiny_eval.jsonl'}",
            "prompt_key=question",
            "answer_key=solution.answer",
            "metadata_keys=id",
            "reward=math",
            "reward_workers=2",
            "eval_every=1",
            "eval_k=2",
            "steps=2",
            "prompts_per_step=2",
            "group_size=2",
            "max_new_tokens=8",
            "rollout_workers=1",
            "mode=trace",
        ],
    )
    ctrl = Controller(cfg)
    history = ctrl.run()
    ctrl.close()
    return ctrl, history


def test_two_rl_steps_on_an_imported_hf_checkpoint_with_math_rewards_and_eval(run):
    ctrl, history = run
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["rollout/response_len"] > 0
        assert m["trace/rtn_fallback_real_tokens"] == 0  # every real token guided by the rollout's record
        assert m["trace/record_bytes_per_token"] > 0
        assert {"eval/mean@2", "eval/pass@1", "eval/pass@2"} <= set(m)
        assert m["eval/pass@1"] <= m["eval/pass@2"]
    assert ctrl.trainer.policy_version() == 2
    prompt = ctrl.policy.tokenizer.decode(ctrl.data.batch(0, 2)[0].ids.tolist())
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")


def test_tensorboard_events_hold_the_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ctrl, history = run
    events = EventAccumulator(str(ctrl.out / TENSORBOARD_DIR))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    flips = {t for t in tags if t.startswith("trace/L") and t.endswith("/code_flip_rate")}
    assert flips and "eval/pass@1" in tags and "trace/rtn_fallback" in tags
    for trace_name, verl_name in [("reward/mean", "critic/score/mean"), ("time/step_s", "timing_s/step")]:
        for name in (trace_name, verl_name):
            scalars = events.Scalars(name)
            assert [s.step for s in scalars] == [0, 1]
            assert [s.value for s in scalars] == pytest.approx([m[trace_name] for m in history])
    logged = [json.loads(line) for line in (ctrl.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["train_rollout_k3_kl"] for m in logged] == [m["train_rollout_k3_kl"] for m in history]


def test_exported_policy_reloads_in_transformers_with_the_trainer_weights_and_logits(run, tmp_path):
    """Every reloaded tensor is the trainer's, bit for bit; the logits are the trainer's Megatron logits (FP32:
    transformers and Megatron kernels differ only in rounding)."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    from megatron_trace.model import build_moe_model
    from megatron_trace.parallel import load_full_state
    from megatron_trace.rows import pack_microbatch
    from trace_rl.cli import main

    ctrl, _ = run
    tensors = ctrl.trainer.hf_weights()
    main(["export", str(ctrl.out), str(tmp_path)])  # from the run's last checkpoint
    reloaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == ctrl.policy.tokenizer.chat_template
    for name, t in reloaded.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # transformers fuses the experts on load
            p = name.removesuffix("gate_up_proj")
            want = torch.stack(
                [torch.cat([tensors[f"{p}{e}.{x}_proj.weight"] for x in ("gate", "up")]) for e in range(4)]
            )
        elif name.endswith("experts.down_proj"):
            want = torch.stack([tensors[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] for e in range(4)])
        else:
            want = tensors[name]
        assert torch.equal(t, want), name

    megatron = build_moe_model(ctrl.policy.dims, dtype=torch.float32, routing_replay=False)
    load_full_state(megatron, ctrl.trainer.policy_state())  # the masters: the parameters may be fake-quantized
    hf = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.stack([p.ids[:24] for p in ctrl.data.batch(0, 2)])
    mb = pack_microbatch(list(enumerate(ids)))
    with torch.no_grad():
        ours = megatron(mb.input_ids, mb.position_ids, mb.attention_mask)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
