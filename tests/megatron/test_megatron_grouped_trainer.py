"""The RL trainers on the TRACE grouped experts with the expert weights fake-quantized in place (the trainer's
default, `trainer_experts = "grouped"`, `expert_weights_in_place = true`): the same RL steps, policy export,
evaluation and checkpoints as the per-step weight copy, bit for bit, on the tiny addition model (BF16 parameters,
FP32 masters). The parameters of the in-place trainer are not the policy (their expert weights are fake-quantized),
so each check also asserts that reading the parameters instead of the masters would give another answer."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.config import TraceConfig
from megatron_trace.emulate import emulate_rollout
from megatron_trace.export import export_hf
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from tests.rl_small import SMALL_RUN, overflow_gradient, trainer_state
from trace_rl.cli import export_run
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import Controller, record_spec
from trace_rl.policy import load_policy
from trace_rl.trainer import MegatronTrainer, TrainBatch


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model(10))


def _trainer(model_dir: str, mode: str, **kw) -> MegatronTrainer:
    policy = load_policy(model_dir)
    spec = record_spec(policy.dims.layers, RLConfig(model_dir=model_dir))
    return MegatronTrainer(policy.dims, policy.state, mode=mode, spec=spec, lr=1e-3, max_version_diff=0, **kw)


def _update(trainer: MegatronTrainer) -> None:
    """One AdamW step of the trainer on seeded master gradients (the same in every trainer)."""
    g = torch.Generator().manual_seed(11)
    for m in trainer.master:
        m.grad = torch.randn(m.shape, generator=g)
    trainer._update()


def _batch(trainer: MegatronTrainer) -> TrainBatch:
    """Four sequences with their RTN-rollout records and routes from `trainer`'s model (weights not in place), as
    an evaluation batch."""
    g = torch.Generator().manual_seed(5)
    vocab = trainer.model.vocab_size
    trajs = [(i, torch.randint(0, vocab, (n,), generator=g)) for i, n in enumerate((9, 12, 7, 11))]
    mb = pack_microbatch(trajs)
    trainer.session.remove()
    try:
        source = emulate_rollout(trainer.model, [mb], trainer.cfg.spec, num_trajectories=4, max_positions=16)
    finally:
        trainer.session = TraceSession(trainer.model, trainer.cfg)
    mask = mb.valid[:, 1:].clone()
    return TrainBatch(mb, source, mask, torch.zeros(mask.shape), {}, {}, 0, 0)


def _expert_params(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".experts." in n}


def test_in_place_trainer_exports_evaluates_and_checkpoints_the_masters(model_dir, tmp_path):
    """After an update, the in-place trainer (grouped experts) and the weight-copy trainer give the same HF export,
    the same `bf16` and `qat` evaluations, and checkpoints whose model entries and masters are the same; a
    checkpoint of the in-place trainer loads into a SequentialMLP trainer as the copy trainer's policy."""
    in_place = _trainer(model_dir, "qat")
    copy = _trainer(model_dir, "qat", expert_weights_in_place=False)
    assert in_place.cfg.expert_weights_in_place and not copy.cfg.expert_weights_in_place
    for t in (in_place, copy):
        _update(t)
    for a, b in zip(in_place.master, copy.master, strict=True):
        assert torch.equal(a, b)
    quantized = _expert_params(in_place)
    # The in-place parameters are not the policy: exporting them would give other expert weights.
    raw, policy = export_hf(in_place.model), copy.hf_weights()
    assert any(not torch.equal(raw[k], policy[k]) for k in policy if ".experts." in k)
    exported = in_place.hf_weights()
    assert exported.keys() == policy.keys()
    for k, w in policy.items():
        assert torch.equal(exported[k], w), k
    for n, p in _expert_params(in_place).items():  # quantized in place again after the export
        assert torch.equal(p, quantized[n]), n

    batch = _batch(copy)
    for mode in ("bf16", "qat"):
        cfg = TraceConfig(mode=mode, spec=copy.cfg.spec, replay_routes=True, measure=False)
        got, want = in_place.evaluate(batch, cfg), copy.evaluate(batch, cfg)
        assert got == want, mode
    # Evaluating the parameters as they are (fake-quantized experts) would have given another bf16 answer.
    bf16 = TraceConfig(mode="bf16", spec=copy.cfg.spec, replay_routes=True, measure=False)
    with torch.no_grad():
        for n, p in copy.model.named_parameters():
            if n in quantized:
                p.copy_(quantized[n])
    assert copy.evaluate(batch, bf16) != in_place.evaluate(batch, bf16)
    copy._masters_to_params()

    in_place.save_sharded(str(tmp_path / "in_place"))
    for n, p in _expert_params(in_place).items():  # quantized in place again after the save
        assert torch.equal(p, quantized[n]), n
    # A SequentialMLP trainer without in-place weights takes the checkpoint's model entries as its parameters.
    sequential = _trainer(model_dir, "qat", experts="sequential", expert_weights_in_place=False)
    sequential.load_sharded(str(tmp_path / "in_place"))
    loaded = sequential.hf_weights()
    for k, w in policy.items():
        assert torch.equal(loaded[k], w), k
    # An in-place trainer restores the masters and quantizes from them.
    again = _trainer(model_dir, "qat")
    again.load_sharded(str(tmp_path / "in_place"))
    for n, p in _expert_params(again).items():
        assert torch.equal(p, quantized[n]), n


def test_in_place_weights_are_verified_against_the_masters(model_dir):
    """`verify_in_place_weights`: after updates every grouped expert weight is the fake-quantized copy of its master;
    a parameter written without quantizing, and a master overwritten by the fake-quant (what an optimizer whose
    masters are views of FP32 parameters would do), are named."""
    trainer = _trainer(model_dir, "qat")
    layers = trainer.model.config.num_layers
    for _ in range(2):
        _update(trainer)
        assert trainer.verify_in_place_weights() == 2 * layers
    trainer._masters_to_params()  # the masters' copy, not quantized
    with pytest.raises(RuntimeError, match="fc1.weight: the parameter is not the fake-quantized copy of its master"):
        trainer.verify_in_place_weights()
    trainer._quantize_in_place()
    i = next(i for i, p in enumerate(trainer.params) if p is trainer.session.in_place_weights()[0])
    with torch.no_grad():
        trainer.master[i].copy_(trainer.params[i])
    with pytest.raises(RuntimeError, match="fake-quantized"):
        trainer.verify_in_place_weights()
    copying = _trainer(model_dir, "qat", expert_weights_in_place=False)
    assert copying.session.in_place_weights() == []  # the group trainer separates no FP32 masters for it
    with pytest.raises(ValueError, match="needs expert_weights_in_place"):
        copying.verify_in_place_weights()


def test_rl_steps_with_in_place_expert_weights_equal_the_weight_copy(model_dir, tmp_path):
    """Two `trace` RL steps (the embedded rollout, records, R3) with the default trainer (grouped experts, weights in
    place) and with the per-step weight copy: every metric, the policy sent to the rollout and the exported
    checkpoint are the same bit for bit."""
    runs = {}
    for name, in_place in (("in_place", True), ("copy", False)):
        cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / name), expert_weights_in_place=in_place, **SMALL_RUN)
        with Controller(cfg, resume=False) as ctrl:
            assert ctrl.trainer.cfg.expert_weights_in_place is in_place
            history = [{k: v for k, v in h.items() if not k.startswith("time/")} for h in ctrl.run()]
            runs[name] = history, ctrl.trainer.hf_weights()
    (history, weights), (ref_history, ref_weights) = runs["in_place"], runs["copy"]
    assert history == ref_history
    for h in history:
        assert sum(v for k, v in h.items() if k.endswith("/guided")) > 0 and h["actor/grad_norm"] > 0
    for k, w in ref_weights.items():
        assert torch.equal(weights[k], w), k
    exported = load_file(export_run(tmp_path / "in_place", tmp_path / "hf") / "model.safetensors")
    for k, w in ref_weights.items():
        assert torch.equal(exported[k], w), k


def test_a_non_finite_gradient_is_refused_before_the_update(model_dir, tmp_path):
    """A `trace` RL step whose backward leaves an inf in one parameter's gradient (set by a torch hook after the
    gradient is accumulated, as an overflow would) is refused by name: parameters, masters, AdamW state and policy
    version are as before. The next step on the same batch without the inf then gives the same metrics and policy
    as a trainer that never saw the refusal."""
    cfg = RLConfig(model_dir=model_dir, **SMALL_RUN)
    results = []
    for name, refuse in (("refused", True), ("reference", False)):
        with Controller(cfg.replace(out_dir=str(tmp_path / name)), resume=False) as ctrl:
            ctrl.train_step()  # AdamW has moments to keep
            trainer, batch = ctrl.trainer, ctrl.rollout(1)
            rewards = torch.tensor([f.result() for f in batch.rewards])
            args = (batch.trajectories, rewards, cfg.group_size, str(ctrl.store), batch.step, batch.version)
            if refuse:
                before, version = trainer_state(trainer), trainer.policy_version()
                hook = trainer.params[0].register_post_accumulate_grad_hook(overflow_gradient)
                with pytest.raises(FloatingPointError, match="(?s)gradient norm inf: .*rollout step 1 refused"):
                    trainer.step(*args)
                hook.remove()
                assert trainer.policy_version() == version
                for a, b in zip(trainer_state(trainer), before, strict=True):
                    assert torch.equal(a, b)
            metrics = trainer.step(*args)
            results.append((metrics, trainer_state(trainer)))
    (metrics, state), (ref_metrics, ref_state) = results

    def untimed(m: dict) -> dict:  # wall times (time/record_read_s) differ between any two runs
        return {k: v for k, v in m.items() if not k.startswith("time/")}

    assert untimed(metrics) == untimed(ref_metrics) and metrics["actor/grad_norm"] > 0
    for a, b in zip(state, ref_state, strict=True):
        assert torch.equal(a, b)


def test_trainer_expert_settings_are_checked_by_name(monkeypatch):
    assert RLConfig().trainer_experts == "grouped" and RLConfig().expert_weights_in_place
    with pytest.raises(ConfigError, match="trainer_experts='dense' is not one of"):
        RLConfig(trainer_experts="dense")
    with pytest.raises(ConfigError, match="expert_weights_in_place=true needs trainer_experts='grouped'"):
        RLConfig(trainer_experts="sequential")
    RLConfig(trainer_experts="sequential", expert_weights_in_place=False)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")  # a torch without the grouped GEMM
    with pytest.raises(ConfigError, match="trainer_experts='grouped' needs torch.nn.functional.grouped_mm"):
        RLConfig()
    RLConfig(trainer_experts="sequential", expert_weights_in_place=False)
