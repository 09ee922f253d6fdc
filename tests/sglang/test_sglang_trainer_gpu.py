"""The trainer follows the live server: the server's sampled tokens, teacher-forced through the Megatron model
imported from the same HF checkpoint, on one GPU at TP = 1.

- An FP4 server (emulate NVFP4 W/A, FP4 KV, capture of every site at b = 4) rolls out through `SGLangWorker`, the
  RL loop's client. The trainer reads the records with `MegatronTrainer.prepare` and runs the forward of each
  mode: `qat` (RTN), `trace` with the full records (b = 4) and `trace` with the default policy (b = 1, all layers).
  At every captured site the guided value equals the recorded one wherever the recorded code is a neighbour of the
  trainer's value under the recorded scale; the fraction of codes that are not neighbours is reported. With b = 1
  the trainer's whole codes flip less against the records than under RTN, and trace's mean |Δ log p| against the
  server is below qat's. Every MoE layer replays the server's routes (R3), and no record is missing.
- A BF16 server (TRACE off, SGLang's R3 routes returned) against the trainer in `bf16` mode, replaying those routes.

Run on a GPU machine with SGLang 0.5.15.post1, megatron-core and this package installed:
`pytest -m gpu tests/sglang/test_sglang_trainer_gpu.py -s`. The report is printed as one JSON line per mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoConfig

from megatron_trace.config import TraceConfig
from megatron_trace.rows import pack_microbatch
from megatron_trace.source import Site, SiteRows, TensorRolloutSource
from tests.hf_tiny import make_hf_checkpoint
from tests.sglang_server import SERVED_MODEL, Server, served_flags
from trace_core.numerics import e2m1
from trace_core.numerics.quant import scale_factors
from trace_core.records.spec import RecordSpec
from trace_core.records.store import finalize_step
from trace_rl.config import RLConfig
from trace_rl.policy import load_policy
from trace_rl.rollout.engine import Trajectory
from trace_rl.rollout.sglang_worker import SGLangWorker
from trace_rl.rollout.workers import Request
from trace_rl.trainer import MegatronTrainer, TrainBatch

pytestmark = pytest.mark.gpu

RECIPES = ("nvfp4-w4a4-kv4", "nvfp4-w4a4-nvfp4kv")
MAX_NEW = 32
START_S = 480


def _prompts(n: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, vocab - 8, (int(torch.randint(12, 60, (1,), generator=g)),), generator=g) for _ in range(n)
    ]


def _trainer(model: Path, recipe: str) -> MegatronTrainer:
    policy = load_policy(model)
    ids = tuple(range(SERVED_MODEL["num_hidden_layers"]))
    spec = RecordSpec.of_recipe(recipe, ids, ids, 4)
    return MegatronTrainer(policy.dims, policy.state, mode="qat", spec=spec, lr=1e-6, max_version_diff=0)


class NeighbourCheck:
    """A session tap: at every captured site, the guided value equals the recorded value wherever the recorded
    code is a neighbour (floor or ceiling on the E2M1 grid) of the trainer's value under the recorded scale."""

    def __init__(self, source: TensorRolloutSource):
        self.source = source
        self.elements: dict[Site, int] = {}
        self.non_neighbours: dict[Site, int] = {}
        self.differ_at_neighbours = 0

    def __call__(self, site: Site, rows, x: torch.Tensor, y: torch.Tensor) -> None:
        got: SiteRows = self.source.records(site, rows)
        rec, has = got.record, got.has_record
        fmt = rec.fmt
        decode, encode = scale_factors(fmt, rec.scales, rec.global_scale)
        blocks = (*x.shape[:-1], x.shape[-1] // fmt.block, fmt.block)
        z = (x.float().reshape(blocks) * encode.unsqueeze(-1)).clamp(-e2m1.E2M1_MAX, e2m1.E2M1_MAX)
        a = z.abs()
        lo = e2m1.floor_index(a)
        hi = torch.where(e2m1.magnitudes(lo) == a, lo, (lo + 1).clamp(max=7))
        recorded = rec.code_bits().reshape(blocks)
        neg = torch.signbit(z) if fmt.negative_zero else z < 0
        sign = torch.where(neg, -1.0, 1.0)
        q = e2m1.code_values(recorded.long())
        neighbour = (q == sign * e2m1.magnitudes(lo)) | (q == sign * e2m1.magnitudes(hi))
        mask = has[:, None, None].expand_as(neighbour)
        want = (q * decode.unsqueeze(-1)).to(y.dtype)
        same = y.reshape(blocks) == want
        self.elements[site] = self.elements.get(site, 0) + int(mask.sum())
        self.non_neighbours[site] = self.non_neighbours.get(site, 0) + int((mask & ~neighbour).sum())
        self.differ_at_neighbours += int((mask & neighbour & ~same).sum())


def _fp4_rollout(tmp_path: Path, model: Path, vocab: int, recipe: str) -> tuple[list[Trajectory], Path]:
    """Trajectories of an FP4 server through the RL loop's client, their records (b = 4, every site) stored."""
    store = (tmp_path / "records").resolve()
    pinned = ("--weight-version", "0", "--trace-step", "0")
    flags = served_flags(store, "fp4_e2m1", recipe=recipe, sites="moe_in,k,v", extra=pinned)
    server = Server(model, flags, tmp_path / "fp4.log")
    try:
        server.wait_ready(START_S)
        cfg = RLConfig(
            rollout_backend="sglang", sglang_urls=server.url, rollout_workers=1, max_new_tokens=MAX_NEW,
            temperature=1.0, recipe=recipe, record_bits=4, mode="trace", sglang_timeout_s=120,
        )  # fmt: skip
        worker = SGLangWorker(server.url, cfg, vocab, eos=(vocab - 1,))
        ids = tuple(range(SERVED_MODEL["num_hidden_layers"]))
        worker.check_policy(RecordSpec.of_recipe(recipe, ids, ids, 4), AutoConfig.from_pretrained(model))
        prompts = _prompts(8, vocab)
        req = Request(index=0, step=0, prompts=prompts, rows=tuple(range(len(prompts))), seed=0, store=str(store))
        trajs = worker.generate(req.next_attempt())
    finally:
        server.stop()
    log = (tmp_path / "fp4.log").read_text(errors="replace")
    assert "not stored" not in log and "refused" not in log, server.tail()
    finalize_step(store, 0)
    return trajs, store


def _bf16_rollout(tmp_path: Path, model: Path, vocab: int) -> tuple[list[Trajectory], list[torch.Tensor]]:
    """Sampled trajectories of a BF16 server (TRACE off) and SGLang's R3 routes `[n, layers, topk]` of each."""
    from tests.sglang.test_sglang_served_gpu import _r3

    flags = served_flags(None, "bfloat16")
    server = Server(model, flags, tmp_path / "bf16.log")
    trajs, routes = [], []
    try:
        server.wait_ready(START_S)
        for p in _prompts(8, vocab):
            out = server.generate({
                "input_ids": p.tolist(), "return_logprob": True, "return_routed_experts": True,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": MAX_NEW, "stop_token_ids": [vocab - 1]},
            })  # fmt: skip
            meta = out["meta_info"]
            tokens = p.tolist() + out["output_ids"]
            logp = torch.tensor([e[0] for e in meta["output_token_logprobs"]])
            trajs.append(Trajectory(torch.tensor(tokens), len(p), logp, records=None, recorded=len(tokens) - 1))
            routes.append(
                _r3(out, len(tokens) - 1, SERVED_MODEL["num_hidden_layers"], SERVED_MODEL["num_experts_per_tok"])
            )
    except requests.RequestException as e:
        raise AssertionError(f"{e}\n{server.tail()}") from None
    finally:
        server.stop()
    return trajs, routes


def _routed_batch(trainer: MegatronTrainer, trajs: list[Trajectory], routes: list[torch.Tensor]) -> TrainBatch:
    """A batch with no records and the server's R3 routes, for the bf16 comparison."""
    mb = pack_microbatch(list(enumerate(t.tokens for t in trajs)))
    s = mb.input_ids.shape[1]
    mask = torch.zeros(len(trajs), s - 1, dtype=torch.bool)
    logp = torch.zeros(len(trajs), s - 1)
    table = torch.zeros(len(trajs), s, *routes[0].shape[1:], dtype=torch.long)
    has = torch.zeros(len(trajs), s, dtype=torch.bool)
    for i, (t, r) in enumerate(zip(trajs, routes, strict=True)):
        p, n = t.prompt_len, len(t.tokens) - t.prompt_len
        mask[i, p - 1 : p - 1 + n], logp[i, p - 1 : p - 1 + n] = True, t.logprobs
        table[i, : r.shape[0]], has[i, : r.shape[0]] = r, True
    dev = trainer.device
    source = TensorRolloutSource(
        {}, {layer: (table[:, :, j].to(dev), has.to(dev)) for j, layer in enumerate(trainer.moe_layers)}
    )
    return TrainBatch(mb.to(dev), source, mask.to(dev), logp.to(dev), {}, {}, 0, 0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_trainer_follows_the_served_records(tmp_path: Path, recipe: str) -> None:
    model = make_hf_checkpoint(tmp_path / "model", **SERVED_MODEL)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = tuple(range(SERVED_MODEL["num_hidden_layers"]))
    trajs, store = _fp4_rollout(tmp_path, model, vocab, recipe)
    trainer = _trainer(model, recipe)
    batch = trainer.prepare(trajs, str(store), 0, 0)
    assert batch.records_missing == 0 and not any(batch.missing_rows.values()), batch.missing_rows
    full = RecordSpec.of_recipe(recipe, ids, ids, 4)
    default = RecordSpec.default(ids, ids, bits=1, recipe=recipe)
    report: dict = {"recipe": recipe, "trajectories": len(trajs)}
    for name, cfg in {
        "qat": TraceConfig(mode="qat", spec=full),
        "trace_b4": TraceConfig(mode="trace", spec=full),
        "trace_b1": TraceConfig(mode="trace", spec=default),
    }.items():
        tap = NeighbourCheck(batch.source) if name == "trace_b4" else None
        m = trainer.evaluate(batch, cfg, tap=tap)
        flips = {k.split("/")[1]: v for k, v in m.items() if k.endswith("/code_flip_rate")}
        row = {
            "mean_abs_dlogp": m["train_rollout_logprob_abs_diff"],
            "code_flip_rate": sum(flips.values()) / len(flips),
            "rtn_fallback_real_tokens": m.get("trace/rtn_fallback_real_tokens", 0.0),
        }
        if tap is not None:
            assert tap.elements and tap.differ_at_neighbours == 0, vars(tap)
            assert set(tap.elements) == set(full.sites())
            for (layer, kind), n in tap.elements.items():
                # b = 4: the only codes guided rounding cannot reproduce are the non-neighbours
                assert flips[f"L{layer}.{kind}"] == pytest.approx(tap.non_neighbours[(layer, kind)] / n), (layer, kind)
            row["non_neighbour_fraction"] = sum(tap.non_neighbours.values()) / sum(tap.elements.values())
            # records that describe other tensors (or scale bytes read in another format) are mostly non-neighbours
            worst = max(tap.non_neighbours[site] / n for site, n in tap.elements.items())
            assert worst < 0.1, {
                f"L{layer}.{kind}": tap.non_neighbours[(layer, kind)] / n for (layer, kind), n in tap.elements.items()
            }
        report[name] = row
    print(json.dumps(report))
    assert report["trace_b4"]["rtn_fallback_real_tokens"] == report["trace_b1"]["rtn_fallback_real_tokens"] == 0
    assert report["trace_b1"]["code_flip_rate"] < report["qat"]["code_flip_rate"], report
    assert report["trace_b4"]["mean_abs_dlogp"] < report["qat"]["mean_abs_dlogp"], report
    assert report["trace_b1"]["mean_abs_dlogp"] < report["qat"]["mean_abs_dlogp"], report


def test_the_bf16_trainer_follows_a_bf16_server(tmp_path: Path) -> None:
    model = make_hf_checkpoint(tmp_path / "model", **SERVED_MODEL)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    trajs, routes = _bf16_rollout(tmp_path, model, vocab)
    trainer = _trainer(model, RECIPES[0])
    m = trainer.evaluate(_routed_batch(trainer, trajs, routes), TraceConfig(mode="bf16", spec=trainer.cfg.spec))
    report = {"mode": "bf16", "trajectories": len(trajs), "mean_abs_dlogp": m["train_rollout_logprob_abs_diff"]}
    print(json.dumps(report))
    assert 0 <= report["mean_abs_dlogp"] < 0.1, report
