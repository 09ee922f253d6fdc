"""The patched SGLang 0.5.15.post1 server, live on a GPU: records are what the server computed.

Each test writes a random Qwen3-MoE HF checkpoint (4 layers, 16 experts, top-4, a `tokenizers` tokenizer), starts
the server as a subprocess with CUDA graphs on (SGLang's defaults: full decode graphs, breakable prefill graphs) in
one of three settings (emulate NVFP4 W/A with BF16 KV, with the FP4 KV pool, and with the NVFP4 KV recipe over the
same pool: E4M3 block scales), sends greedy, sampled, prefix-sharing, chunked-prefill and aborted requests, and
checks, against the debug tap (`--trace-debug-layer`, which keeps what the expert GEMMs and the FP4-KV attention
consumed at one layer), that the stored records decode to exactly those tensors, that every request's records are
stored (none refused), and that the routes in the records are the routes SGLang returns
(`--enable-return-routed-experts`).

Run on a GPU machine with SGLang 0.5.15.post1 and this package installed (its `sglang.srt.plugins` entry point):
`pytest -m gpu tests/sglang/test_sglang_served_gpu.py`.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from tests.hf_tiny import make_hf_checkpoint
from tests.sglang_server import CHUNK, SERVED_MODEL, Server, served_flags
from trace_core.numerics.e2m1 import unpack_fp4
from trace_core.numerics.fc2 import fc2_input_fake_quant
from trace_core.numerics.formats import NVFP4
from trace_core.numerics.quant import Quantized, dequantize
from trace_core.numerics.recipe import get_recipe
from trace_core.records.reader import RecordReader
from trace_core.records.store import StepWatcher, finalize_step, step_dir

pytestmark = pytest.mark.gpu

DEBUG_LAYER = 1
START_S = 480


def _requests(vocab: int) -> list[dict]:
    """(rid, input ids, sampling params): greedy, sampled, two sharing a prefix, one longer than the prefill chunk."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab - 8, (n,), generator=g).tolist()

    prefix = ids(90)
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 24, "ignore_eos": True}
    reqs = [
        {"rid": "greedy#0", "input_ids": ids(20), "sampling_params": greedy},
        {"rid": "sampled#0", "input_ids": ids(33), "sampling_params": sampled},
        {"rid": "prefix-a#0", "input_ids": prefix + ids(7), "sampling_params": greedy},
        {"rid": "prefix-b#0", "input_ids": prefix + ids(11), "sampling_params": sampled},
        {"rid": "long#0", "input_ids": ids(3 * CHUNK + 17), "sampling_params": greedy},
    ]
    for r in reqs[::2]:  # R3's answer for some; the records carry routes for all
        r["return_routed_experts"] = True
    return reqs


def _run(server: Server, reqs: list[dict]) -> dict[str, dict]:
    """Send `reqs` concurrently (they batch), plus one request aborted mid-decode; answers by rid."""
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def send(payload: dict) -> None:
        try:
            out[payload["rid"]] = server.generate(payload)
        except BaseException as e:
            errors.append(e)

    abort = {
        "rid": "aborted#0",
        "input_ids": reqs[0]["input_ids"],
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
    }
    threads = [threading.Thread(target=send, args=(r,)) for r in [*reqs, abort]]
    for t in threads:
        t.start()
    time.sleep(1.0)
    requests.post(f"{server.url}/abort_request", json={"rid": "aborted#0"}, timeout=30)
    for t in threads:
        t.join(180)
    assert not errors, errors
    return out


def _wait_for_records(store: Path, trajectories: list[str], server: Server, timeout_s: float = 60) -> None:
    """Until the writer thread has stored every trajectory's shard (it writes after the answer is sent)."""
    watcher = StepWatcher(store, 0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = watcher.refresh()
        assert not watcher.failed, watcher.failed
        if all(t in found for t in trajectories):
            return
        time.sleep(0.5)
    raise AssertionError(f"records of {set(trajectories) - set(watcher.refresh())} not stored:\n{server.tail()}")


def _handle(answer: dict) -> dict:
    from sglang_trace.handle import from_meta_info

    handle = from_meta_info(answer["meta_info"])
    assert handle is not None, answer["meta_info"].keys()
    assert "error" not in handle, handle
    return handle


def _r3(answer: dict, tokens: int, layers: int, topk: int) -> torch.Tensor:
    raw = base64.b64decode(answer["meta_info"]["routed_experts"])
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy()).view(tokens, layers, topk)


def _check_served(tmp_path: Path, kv: str, recipe_name: str) -> dict:
    model = make_hf_checkpoint(tmp_path / "model", **SERVED_MODEL)
    store = tmp_path / "records"
    sites = "moe_in,k,v" if kv == "fp4_e2m1" else "moe_in"
    flags = served_flags(store, kv, recipe=recipe_name, sites=sites, debug_layer=DEBUG_LAYER)
    server = Server(model, flags, tmp_path / "server.log")
    try:
        server.wait_ready(START_S)
        reqs = _requests(128)
        answers = _run(server, reqs)
        _wait_for_records(store, [_handle(answers[r["rid"]])["trajectory"] for r in reqs], server)
        counters = requests.get(f"{server.url}/server_info", timeout=30).json()["internal_states"][0]["trace"]
    finally:
        server.stop()
    # the finish path's counters, as /server_info reports them (hooks.add_internal_state)
    assert counters["failed"] == counters["write_failures"] == 0, counters
    assert counters["requests"] >= counters["trajectories_written"] >= len(reqs), counters
    assert counters["finish_s"] > 0 and counters["write_s"] > 0 and counters["host_bytes"] > 0, counters
    assert counters["ring"]["capacity"] == counters["ring"]["tokens"] * counters["token_bytes"] > 0, counters
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "not stored" not in log and "refused" not in log, server.tail()
    finalize_step(store, 0)
    reader = RecordReader(store, 0)
    recipe = get_recipe(recipe_name)
    report = {"requests": len(answers), "sites_checked": 0, "tokens": 0, "trace_counters": counters}
    for req in reqs:
        answer = answers[req["rid"]]
        handle = _handle(answer)
        n = handle["tokens"]
        assert n == len(req["input_ids"]) + len(answer["output_ids"]) - 1
        recs = reader.load([(handle["trajectory"], 0, n)])
        debug = torch.load(store / "debug" / f"{req['rid']}.pt")
        # MoE input of the debug layer: the record (full codes, b = 4) decodes to what the experts ran on
        rec = recs.records[(DEBUG_LAYER, "moe_in")]
        q = Quantized(rec.code_bits()[0], rec.scales[0], rec.global_scale[0], NVFP4)
        assert torch.equal(dequantize(q, torch.bfloat16), debug["moe_in"]), req["rid"]
        # FC2 input: the tensor the second GEMM consumed is on the NVFP4 grid (the hook ran on the path that runs)
        fc2 = debug["fc2_in"].flatten(0, 1)
        assert fc2.abs().sum() > 0
        assert torch.equal(fc2_input_fake_quant(fc2.cuda(), recipe.fc2_in).cpu(), fc2), req["rid"]
        if kv == "fp4_e2m1":  # K and V: the records are the pool bytes the FP4-KV attention read
            for kind in ("k", "v"):
                rec = recs.records[(DEBUG_LAYER, kind)]
                assert torch.equal(rec.code_bits()[0], unpack_fp4(debug[f"{kind}_codes"].flatten(1))), (
                    req["rid"],
                    kind,
                )
                assert torch.equal(rec.scales[0], debug[f"{kind}_scales"].flatten(1)), (req["rid"], kind)
        # R3: the routes in the records are the routes SGLang's R3 interface returns for the same positions
        assert recs.routes is not None and bool(recs.has_routes.all()), req["rid"]
        if req.get("return_routed_experts"):
            r3 = _r3(answer, n, SERVED_MODEL["num_hidden_layers"], SERVED_MODEL["num_experts_per_tok"])
            assert torch.equal(recs.routes[0].long(), r3.long()), req["rid"]
        report["sites_checked"] += 1
        report["tokens"] += n
    if "aborted#0" in answers:
        report["aborted_finish"] = answers["aborted#0"]["meta_info"]["finish_reason"]
    report["shards"] = sorted(p.name for p in step_dir(store, 0).iterdir())[:5]
    return report


@pytest.mark.parametrize(
    ("kv", "recipe"),
    [("bfloat16", "nvfp4-w4a4-kv4"), ("fp4_e2m1", "nvfp4-w4a4-kv4"), ("fp4_e2m1", "nvfp4-w4a4-nvfp4kv")],
    ids=["bf16-kv", "fp4-kv", "nvfp4-kv"],
)
def test_records_are_what_the_served_model_computed(tmp_path: Path, kv: str, recipe: str) -> None:
    report = _check_served(tmp_path, kv, recipe)
    print(json.dumps({"kv": kv, "recipe": recipe, **report}))


def test_server_without_the_trace_plugin_refuses_to_start(tmp_path: Path) -> None:
    """A deliberately broken hook set (the plugin filtered out by SGLANG_PLUGINS) stops the start, naming the hooks."""
    model = make_hf_checkpoint(tmp_path / "model", **SERVED_MODEL)
    server = Server(
        model, served_flags(tmp_path / "records", "bfloat16"), tmp_path / "server.log", env={"SGLANG_PLUGINS": "none"}
    )
    try:
        server.wait_exit(START_S)
    finally:
        server.stop()
    assert "TRACE's SGLang plugin hooks are not registered" in server.log.read_text(errors="replace"), server.tail()
