"""`bench/serve.py`, the serving bench, without a server: its targets judged on stored and constructed results,
the server flags it builds (parsed by SGLang's own parser) and what it refuses before any server starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve import fit_batch
from bench.serve_table import markdown
from bench.serve_targets import TARGETS, Target, evaluate
from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()  # SGLang's parser with TRACE's flags, as a server has it

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"mem_fraction_static": 0.85, "output_len": 256, "batch_context": 1024}


def entry(points: dict[tuple[int, int], dict], status: str = "ok", **server) -> dict:
    """A configuration's results as `bench/serve.py` stores them: its points keyed by context and batch."""
    return {
        "signature": dict(SETTINGS),
        "status": status,
        "server": {"kv_capacity_tokens": 1000, "cuda_graph_decode": {"max_bs": 256}} | server,
        "points": {f"ctx{c}-b{b}": {"context": c, "batch": b} | p for (c, b), p in points.items()},
    }


def target(name: str, config: str) -> Target:
    return next(t for t in TARGETS if t.name == name and t.config == config)


@pytest.mark.parametrize("run", ["serve_h200/run3", "serve_h200/run4", "serve_h200/run5", "serve_h100/run1",
                                 "serve_h100/run2"])  # fmt: skip
def test_the_targets_of_a_stored_run_judge_as_they_did_on_the_gpu(run):
    """Each committed live-server run's targets, judged again on its stored points, keep the status written then."""
    result = json.loads((ROOT / "docs" / "measurements" / f"{run}.json").read_text())
    stored = {(t["target"], t["config"], t["baseline"]): t["status"] for t in result["targets"]}
    again = {(t.name, t.config, t.baseline): evaluate(t, result["configs"])["status"] for t in TARGETS}
    assert again == stored


def test_capture_is_judged_at_every_batch_from_16_and_only_between_runs_of_the_same_settings():
    capture = target("capture", "emulate+capture-paper")
    base = {(1024, 1): 1000.0, (1024, 16): 1000.0, (1024, 64): 2000.0, (1024, 256): 4000.0}
    mine = {(1024, 1): 100.0, (1024, 16): 980.0, (1024, 64): 1942.0, (1024, 256): 3890.0}
    configs = {
        "emulate": entry({k: {"output_throughput": v} for k, v in base.items()}),
        "emulate+capture-paper": entry({k: {"output_throughput": v} for k, v in mine.items()}),
    }
    judged = evaluate(capture, configs)
    assert judged["status"] == "met" and [r["batch"] for r in judged["comparisons"]] == [16, 64, 256]
    configs["emulate+capture-paper"]["points"]["ctx1024-b256"]["output_throughput"] = 3870.0  # 0.9675
    judged = evaluate(capture, configs)
    assert judged["status"] == "missed" and [r["batch"] for r in judged["comparisons"] if not r["met"]] == [256]
    configs["emulate"]["signature"]["mem_fraction_static"] = 0.8
    assert evaluate(capture, configs)["status"] == "not-measured"


def test_emulation_compares_the_decode_step_at_batch_64_of_the_batch_axis_only():
    emulation = target("emulation", "emulate")
    configs = {
        "bf16": entry({(1024, 64): {"output_throughput": 1.0, "decode_step_ms": 20.0},
                       (16384, 64): {"output_throughput": 1.0, "decode_step_ms": 10.0}}),
        "emulate": entry({(1024, 64): {"output_throughput": 1.0, "decode_step_ms": 25.0},
                          (16384, 64): {"output_throughput": 1.0, "decode_step_ms": 30.0}}),
    }  # fmt: skip
    judged = evaluate(emulation, configs)
    assert judged["status"] == "met" and [(r["context"], r["ratio"]) for r in judged["comparisons"]] == [(1024, 1.25)]
    configs["emulate"]["points"]["ctx1024-b64"]["decode_step_ms"] = 26.5
    assert evaluate(emulation, configs)["status"] == "missed"


def test_fp4_kv_at_32k_is_judged_only_against_a_capacity_bound_bf16_at_each_ones_largest_batch():
    at_32k = target("fp4kv_32k", "emulate+fp4kv")
    configs = {
        "emulate": entry({(32768, 19): {"output_throughput": 400.0, "capacity_bound": False}}),
        "emulate+fp4kv": entry({(32768, 68): {"output_throughput": 1300.0, "capacity_bound": True}}),
    }
    assert evaluate(at_32k, configs)["status"] == "not-measured"
    configs["emulate"]["points"]["ctx32768-b19"]["capacity_bound"] = True
    judged = evaluate(at_32k, configs)
    assert judged["status"] == "met" and judged["comparisons"][0]["baseline_batch"] == 19
    configs["emulate+fp4kv"]["points"]["ctx32768-b68"]["output_throughput"] = 590.0  # 1.475 x
    assert evaluate(at_32k, configs)["status"] == "missed"


def test_graphs_capacity_and_the_finish_path_are_judged_on_what_the_server_reported():
    graphs, capacity = target("fp4kv_graphs", "emulate+fp4kv"), target("fp4kv_capacity", "emulate+fp4kv")
    ok = {(1024, 64): {"output_throughput": 1.0, "cuda_graph_decode_fraction": 1.0}}
    configs = {"emulate": entry(ok, kv_capacity_tokens=1000), "emulate+fp4kv": entry(ok, kv_capacity_tokens=3560)}
    assert evaluate(graphs, configs)["status"] == "met" and evaluate(capacity, configs)["ratio"] == 3.56
    configs["emulate+fp4kv"]["points"]["ctx1024-b64"]["cuda_graph_decode_fraction"] = 0.95
    configs["emulate+fp4kv"]["server"]["kv_capacity_tokens"] = 3400
    assert evaluate(graphs, configs)["status"] == evaluate(capacity, configs)["status"] == "missed"
    configs["emulate+fp4kv"] = entry({}, status="failed")
    assert evaluate(graphs, configs)["why"] == "server did not start"

    finish = target("finish_path", "emulate+fp4kv+capture-default")
    short = {"output_throughput": 1.0, "finish_tokens_per_request": 1279.0, "finish_ms_per_request": 0.01}
    configs["emulate+fp4kv+capture-default"] = entry({(1024, 64): short})
    assert evaluate(finish, configs)["status"] == "not-measured"
    long = {"output_throughput": 1.0, "finish_tokens_per_request": 8320.0, "finish_ms_per_request": 0.6}
    configs["emulate+fp4kv+capture-default"] = entry({(8064, 16): long})
    assert evaluate(finish, configs)["status"] == "not-measured"  # 8K-token requests say nothing of 16K ones
    long |= {"finish_tokens_per_request": 16639.0, "finish_ms_per_request": 1.05}  # 1.033 ms per 16K tokens
    configs["emulate+fp4kv+capture-default"] = entry({(16384, 16): long})
    assert evaluate(finish, configs)["status"] == "missed"


def test_the_serving_bench_profiles_named_points_and_refuses_a_bad_spec():
    """`bench/serve.py --profile CONFIG:POINT`: the points it profiles, and a malformed or unknown one refused by
    name before any server starts (the dry run prints the profiled run)."""
    from bench.serve import profiled

    assert profiled(["emulate+capture-default:ctx1024-b256", "emulate:ctx32768-bfit"]) == {
        ("emulate+capture-default", "ctx1024-b256"),
        ("emulate", "ctx32768-bfit"),
    }
    for bad in ("emulate:ctx1024", "nope:ctx1024-b16", "ctx1024-b16"):
        with pytest.raises(ValueError, match=f"--profile '{bad}': expected CONFIG:ctx"):
            profiled([bad])
    bench = Path(__file__).resolve().parents[2] / "bench" / "serve.py"
    run = [sys.executable, str(bench), "--configs", "emulate", "--batches", "16", "--contexts", "--dry-run"]
    dry = subprocess.run([*run, "--profile", "emulate:ctx1024-b16"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "then once more with profile=True, profile_steps=8" in dry.stdout, dry.stderr
    bad = subprocess.run([*run, "--profile", "emulate:b16"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--profile 'emulate:b16'" in bad.stderr


def test_the_serving_bench_captures_only_the_decode_graphs_asked_for_and_runs_no_point_padded():
    """`bench/serve.py --decode-graph-bs`: every server is launched with SGLang's `--cuda-graph-bs-decode`, which
    SGLang's own parser (with the TRACE flags) takes as that list; a batch of the axis with no graph of its size is
    refused before any server starts, and a long-context point runs at the largest graph size within its fit."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    bench = Path(__file__).resolve().parents[2] / "bench" / "serve.py"
    run = [sys.executable, str(bench), "--configs", "emulate+capture-paper", "--dry-run", "--decode-graph-bs", "16"]
    dry = subprocess.run(
        [*run, "64", "--batches", "16", "64", "--contexts", "32768"], capture_output=True, text=True, timeout=120
    )
    assert dry.returncode == 0, dry.stderr
    command = next(line for line in dry.stdout.splitlines() if "sglang.launch_server" in line)
    argv = command[command.index("sglang.launch_server") + len("sglang.launch_server") :].split()
    argv = ["30000" if a == "PORT" else a for a in argv]  # the dry run's placeholder for the port picked at start
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args(argv)
    assert parsed.cuda_graph_bs_decode == [16, 64] and parsed.trace_layers == "latter-half"
    assert "then the largest of [16, 64] no more" in dry.stdout
    bad = subprocess.run([*run, "--batches", "16", "256", "--contexts"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "batches [256] have no graph" in bad.stderr, bad.stderr

    # 32K context on one H200 at fill 0.95: BF16 KV fits 19 requests, FP4 KV 68
    assert fit_batch(665_166, 32768, 256, 0.95, 256) == (19, True)
    assert fit_batch(665_166, 32768, 256, 0.95, 256, [16, 19, 64, 68, 256]) == (19, True)
    assert fit_batch(2_365_037, 32768, 256, 0.95, 256, [16, 64, 256]) == (64, True)
    assert fit_batch(2_365_037, 1024, 256, 0.95, 256, [16, 64, 256]) == (256, False)
    assert fit_batch(665_166, 32768, 256, 0.95, 256, [64, 256]) == (0, True)  # no graph small enough: skipped


def test_the_table_keeps_each_gpus_throughput_apart_and_names_each_gpus_judgement():
    """Two runs on two GPUs: each GPU gets its own throughput table (one GPU's figure never stands in another's
    cell), and a target both judged gets a row per GPU, naming its run; one never judged is `not measured`."""

    def run(card: str, tok_s: float, ratio: float) -> dict:
        configs = {"emulate": entry({(1024, 64): {"output_throughput": tok_s}}),
                   "bf16": entry({(1024, 64): {"output_throughput": tok_s}})}  # fmt: skip
        judged = {"target": "emulation", "config": "emulate", "baseline": "bf16", "status": "met",
                  "comparisons": [{"context": 1024, "batch": 64, "ratio": ratio}]}  # fmt: skip
        return {"gpu": f"NVIDIA {card}, 1 MiB", "configs": configs, "targets": [judged]}

    text = markdown([("h200 r1", run("H200", 3000.0, 1.05)), ("h100 r1", run("H100", 2400.0, 1.04))])
    h200, h100 = text.split("NVIDIA H200, output tok/s:")[1].split("NVIDIA H100, output tok/s:")
    assert "3,000.0 (h200 r1)" in h200 and "2,400" not in h200
    assert "2,400.0 (h100 r1)" in h100 and "3,000" not in h100.split("| target |")[0]
    rows = [line for line in text.splitlines() if line.startswith("| emulate NVFP4 W/A decode step")]
    assert [r.rsplit("|", 2)[-2].strip() for r in rows] == ["h200 r1", "h100 r1"]
    assert "1.050 (b64)" in rows[0] and "1.040 (b64)" in rows[1]
    assert any("| emulate+capture-paper vs emulate | not measured |" in line for line in text.splitlines())
