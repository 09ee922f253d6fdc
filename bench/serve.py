"""Serving performance of the live patched SGLang server at Qwen3-30B-A3B shapes (issue 31): what TRACE's emulation
and capture cost, and what FP4 KV buys, each configuration a server this bench starts itself.

The model is a local HF directory holding only `config.json` (Qwen3-30B-A3B's shape: hidden 2048, 48 layers, 128
experts top-8, MoE FFN 768, 32 / 4 heads x 128, vocab 151,936), served with random weights (`--load-format dummy
--skip-tokenizer-init`, input ids only). Every server runs `--attention-backend triton --sampling-backend pytorch
--grammar-backend none --page-size 1 --dtype bfloat16 --mem-fraction-static 0.85` with SGLang's default decode CUDA
graphs and no prefill graphs (`--disable-prefill-cuda-graph`: they change only the time to first token and their
capture took 93 s of each start on the H200; `--decode-graph-bs` captures only the listed decode batch sizes, which
must hold every batch of the axis, and a long-context point then runs at the largest of them within its fit, in a
graph of its own size: SGLang's 36 sizes took 80 s of a 135 s start), in its own process group (torn down on exit,
error, SIGINT and SIGTERM; what a killed run left, its server and record store, is found through `PID_FILE` next to
`--out` and removed before the next start).

Configurations (`CONFIGS`):
  bf16                           BF16 W/A, BF16 KV, TRACE off
  fp4kv                          BF16 W/A, FP4 KV (the project's FP4-KV attention), TRACE off
  emulate                        NVFP4 W/A emulated, BF16 KV, no capture (`--trace-sites none`, see below)
  emulate+capture-default        emulate, b = 1 MoE-input records of every layer (BF16 KV: no K/V sites)
  emulate+capture-paper          emulate, b = 1 MoE-input records of the latter half
  emulate+fp4kv                  emulate, FP4 KV (kv_fp4), no capture
  emulate+nvfp4kv                emulate, FP4 KV holding NVFP4 (`--trace-recipe nvfp4-w4a4-nvfp4kv`), no capture
  emulate+fp4kv+capture-default  emulate + FP4 KV, b = 1 MoE-input and K/V records of every layer
  emulate+fp4kv+capture-paper    emulate + FP4 KV, b = 1 MoE-input and K/V records of the latter half
The configurations without capture run `--trace-sites none` (`NO_CAPTURE`, sglang_trace.config): the recipe's
numerics hooks only, no record rows in the KV budget, no record store (`traced` is false for them).

Points: batch 1, 16, 64, 256 at 1K context (`--batches`, input `--batch-context` tokens), then 8K and 32K contexts
(`--contexts`) at the largest batch that fits: floor(`--fill` x the server's KV token capacity / (context +
output)), at most `--max-batch` and the server's max running requests. Every request is `--output-len` tokens
(ignore_eos), greedy. Each point is one call of SGLang's own batch client, `sglang.benchmark.one_batch_server.
run_one_case` (the module behind `python -m sglang.bench_one_batch_server`, random-ids dataset of fixed lengths: one
`/generate` of `batch` streamed requests, the radix cache flushed before it).

Per point (`QUANTITIES` says where each comes from): output tok/s, decode step time (server: SGLang's own step
timer, `SGLANG_RECORD_STEP_TIME=1`, read from `/server_info`; and client: the time after the last first token over
the remaining steps), time to first token (of the batch's last request), peak running requests (server log),
CUDA-graph use of the decode steps, retractions; per server: KV token capacity (`/server_info`
max_total_num_tokens) and memory; for TRACE configurations the record bytes written per token (shard headers of
the record store, read and deleted as they appear) against `trace_core.records.spec.bytes_per_token`. The issue's ratio
targets are evaluated after every point (`TARGETS`), each marked met / missed / not-measured. TRACE points also
carry the server's finish-path counters (`/server_info`'s `internal_states[0]["trace"]`): scheduler-thread ms per
finished request, host-ring waits, the writer's GB/s and the slot fence's allocation waits. The requests of a point
start and finish together, so the finish path (records moved to the writer thread through the host ring) lands
after the decode steps: in latency_s, not in the decode throughput.

Results go to `--out` (JSON, rewritten after every point) and a PNG next to it; a rerun skips the points already
measured under the same settings (`--force` remeasures), so a run cut short resumes where it stopped.

    python bench/serve.py --dry-run                                  # every server command and client call
    timeout -k 30 570 python bench/serve.py --configs bf16,emulate --batches 1 16 64 --contexts \\
        --budget-s 480 --out out/serve/serve.json                    # one slice of a 10-minute window
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.* of this checkout

from bench.serve_records import (
    STORE_S_PER_TOKEN,
    StoreDrain,
    expected_record_bytes,
    finish_path,
    record_bytes,
    store_step_dir,
)
from bench.serve_server import (
    PID_FILE,
    SERVER_ENV,
    Server,
    free_port,
    kill_leftover,
    new_step_times,
    parse_log,
    step_time_dict,
)
from bench.serve_targets import TARGETS, evaluate, plot

NUM_LAYERS = 48
HF_CONFIG: dict[str, object] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": NUM_LAYERS,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": NUM_LAYERS,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
"""Qwen3-30B-A3B's config.json values (the weights are SGLang's dummy init)."""

BASE_FLAGS = (
    "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
    "--page-size", "1", "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
    "--disable-prefill-cuda-graph",
)  # fmt: skip
BF16_KV = ("--kv-cache-dtype", "bfloat16")
FP4_KV = ("--kv-cache-dtype", "fp4_e2m1")
EMULATE = ("--trace-mode", "emulate")


def capture(sites: str, layers: str) -> tuple[str, ...]:
    """Flags of a b = 1 capture policy over `sites` of `layers` ('all', 'latter-half' or layer ids)."""
    return ("--trace-sites", sites, "--trace-layers", layers, "--trace-record-bits", "1")


NO_CAPTURE = ("--trace-sites", "none")  # emulate's numerics, no records


CONFIGS: dict[str, tuple[str, ...]] = {
    "bf16": BF16_KV,
    "fp4kv": FP4_KV,
    "emulate": (*EMULATE, *NO_CAPTURE, *BF16_KV),
    "emulate+capture-default": (*EMULATE, *capture("moe_in", "all"), *BF16_KV),
    "emulate+capture-paper": (*EMULATE, *capture("moe_in", "latter-half"), *BF16_KV),
    "emulate+fp4kv": (*EMULATE, *NO_CAPTURE, *FP4_KV),
    "emulate+nvfp4kv": (*EMULATE, *NO_CAPTURE, *FP4_KV, "--trace-recipe", "nvfp4-w4a4-nvfp4kv"),
    "emulate+fp4kv+capture-default": (*EMULATE, *capture("moe_in,k,v", "all"), *FP4_KV),
    "emulate+fp4kv+capture-paper": (*EMULATE, *capture("moe_in,k,v", "latter-half"), *FP4_KV),
}
"""Server flags of each configuration, on top of `BASE_FLAGS` (TRACE ones also get `--trace-store`)."""

WARMUP = (4, 1024, 16)  # batch, input, output of the request each server gets before its points

QUANTITIES = {
    "output_throughput": "output tok/s of the decode phase: batch x output_len / (latency - ttft_s) "
    "(run_one_case's output_throughput)",
    "e2e_output_throughput": "batch x output_len / latency (prefill included)",
    "latency_s": "client wall time of the whole batch, request sent to last token (run_one_case)",
    "ttft_s": "time to first token of the batch's last request: the batch's prefill (run_one_case's last_ttft)",
    "decode_step_ms": "median server decode step at the point's batch: SGLang's step timer (SGLANG_RECORD_STEP_TIME=1, "
    "wall time over each --decode-log-interval steps / the interval, keyed by running requests, in /server_info "
    "internal_states[0].step_time_dict), the first window of the point dropped (it spans the idle gap and prefill)",
    "decode_throughput": "batch / decode_step_ms: the server's decode tok/s at the point's batch (what the capture "
    "target compares)",
    "decode_step_ms_client": "(latency_s - ttft_s) / (output_len - 1): client-timed step after the last first token",
    "peak_running_requests": "largest '#running-req' of the server log's Prefill / Decode batch lines in the point",
    "cuda_graph_decode_fraction": "share of the point's 'Decode batch' log lines with 'cuda graph: True'",
    "retractions": "'KV cache pool is full. Retract requests.' log lines in the point",
    "slow_finish_s": "scheduler-thread seconds of the result batches whose TRACE transfers took > 50 ms "
    "(the server's 'TRACE finish:' log lines in the point)",
    "slow_finish_ring_wait_s": "of those, seconds waiting for host-ring space (the store writer behind)",
    "slow_finish_requests": "requests finished in those batches",
    "finish_ms_per_request": "scheduler-thread ms per finished request in TRACE's finish path (on_batch_done, host-"
    "ring waits included), from the server's counters (/server_info internal_states[0]['trace'], before and after "
    "the point); finish_requests / finish_tokens_per_request / finish_transfers beside it",
    "ring_wait_s": "seconds the scheduler waited for host-ring space in the point (ring_stalls: how many times)",
    "writer_GBps": "host bytes over the store writer thread's seconds in the point (writer_s), once the store drained",
    "fence_alloc_waits": "allocations that waited for the finish path's copies to free the slots the slot fence "
    "held (fence_alloc_wait_s: their seconds on the scheduler thread)",
    "kv_capacity_tokens": "max_total_num_tokens of /server_info (the KV pool in tokens, after the record store's "
    "share of the cell size)",
    "record_bytes_per_token": "raw record bytes (MoE-input and K/V sites) per token over the point's trajectories, "
    "from the record store's shard headers; routes and disk bytes beside it; expected: trace_core.records.spec."
    "bytes_per_token of the served record spec",
}


@dataclass(frozen=True)
class Point:
    """One measurement: `batch` requests of `context` input tokens; batch None: the largest that fits."""

    context: int
    batch: int | None

    @property
    def key(self) -> str:
        return f"ctx{self.context}-b{self.batch if self.batch is not None else 'fit'}"


def plan(batches: Sequence[int], batch_context: int, contexts: Sequence[int]) -> list[Point]:
    """The points of one configuration: the batch axis at `batch_context`, then each long context at its fit."""
    return [Point(batch_context, b) for b in batches] + [Point(c, None) for c in contexts]


def fit_batch(
    capacity: int, context: int, output_len: int, fill: float, cap: int, graphs: Sequence[int] | None = None
) -> tuple[int, bool]:
    """(batch, capacity_bound): the most requests of `context + output_len` tokens in `fill` of `capacity` KV
    tokens, at most `cap`, and with `graphs` (the decode graph sizes) the largest of them that is no more, so that
    the point decodes in a graph of its own size (0: none is small enough); capacity_bound when the KV pool, not
    `cap`, sets it."""
    fits = math.floor(capacity * fill / (context + output_len))
    batch = min(fits, cap)
    if graphs:
        batch = max((g for g in graphs if g <= batch), default=0)
    return batch, fits < cap


def write_model(directory: Path) -> Path:
    """`directory` holding only the model's config.json (rewritten only when it differs)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    text = json.dumps(HF_CONFIG, indent=2) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return directory


def server_argv(model: Path, flags: Sequence[str], port: int | str, store: Path | None, args) -> list[str]:
    """The launch command of one configuration's server."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), *BASE_FLAGS, "--mem-fraction-static", str(args.mem_fraction)]
    argv += ["--decode-log-interval", str(args.decode_log_interval), *flags]
    if args.decode_graph_bs:
        argv += ["--cuda-graph-bs-decode", *map(str, args.decode_graph_bs)]
    if store is not None:
        argv += ["--trace-store", str(store)]
    return argv


def traced(flags: Sequence[str]) -> bool:
    """TRACE on and recording (not `--trace-sites none`): the server gets a record store, drained per point."""
    sites = flags[flags.index("--trace-sites") + 1] if "--trace-sites" in flags else None
    return "--trace-mode" in flags and sites != "none"


def client_call(url: str, batch: int, input_len: int, output_len: int, name: str, stream_interval: int) -> dict:
    """Keyword arguments of SGLang's `run_one_case` for one point (random-ids prompts of fixed lengths)."""
    return dict(
        url=url, batch_size=batch, input_len=input_len, output_len=output_len, temperature=0.0,
        return_logprob=False, stream_interval=stream_interval, input_len_step_percentage=0.0, run_name=name,
        result_filename="", dataset_name="random-ids",
    )  # fmt: skip


def without_hf_datasets() -> None:
    """Let SGLang's bench client import where HF `datasets` is not installed (a GPU image without it).

    `sglang.benchmark.datasets` imports its MMMU loader, which imports `datasets.load_dataset`, at package import;
    the random-ids prompts never call it. The stand-in raises if anything does.
    """
    import importlib.util
    from types import ModuleType

    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return

    def load_dataset(*args, **kwargs):
        raise ImportError("bench/serve.py: the HF `datasets` package is not installed (only random-ids prompts run)")

    stand_in = ModuleType("datasets")
    stand_in.load_dataset = load_dataset  # type: ignore[attr-defined]
    sys.modules["datasets"] = stand_in


def run_client(call: dict, seed: int):
    """One `run_one_case`; the random-ids dataset needs only the vocabulary size of a tokenizer."""
    import numpy as np

    without_hf_datasets()
    from sglang.benchmark.one_batch_server import run_one_case

    random.seed(seed)
    np.random.seed(seed)
    return run_one_case(**call, tokenizer=SimpleNamespace(vocab_size=HF_CONFIG["vocab_size"]))


def profiled(specs: Sequence[str]) -> set[tuple[str, str]]:
    """`--profile CONFIG:POINT` values as (configuration, point key); ValueError naming a malformed one or an
    unknown configuration."""
    out = set()
    for spec in specs:
        name, sep, key = spec.rpartition(":")
        if not sep or not re.fullmatch(r"ctx\d+-b(\d+|fit)", key) or name not in CONFIGS:
            raise ValueError(
                f"--profile {spec!r}: expected CONFIG:ctx<context>-b<batch|fit>, CONFIG one of {list(CONFIGS)}"
            )
        out.add((name, key))
    return out


def profile_point(server: Server, point: Point, batch: int, name: str, out_dir: Path, args) -> str:
    """One more run of a measured point under SGLang's torch profiler (`run_one_case(profile=True)`: CPU and GPU
    activities, `--profile-steps` forward steps from `--profile-start-step`); returns the traces' directory."""
    where = (out_dir / "profiles" / f"{name.replace('+', '_')}_{point.key}").resolve()
    where.mkdir(parents=True, exist_ok=True)
    call = client_call(server.url, batch, point.context, args.output_len, f"{point.key}-profile", args.stream_interval)
    call |= dict(profile=True, profile_steps=args.profile_steps, profile_start_step=args.profile_start_step,
                 profile_output_dir=str(where), profile_activities=("CPU", "GPU"))  # fmt: skip
    run_client(call, args.seed)
    server.check()
    return str(where)


def measure(server: Server, point: Point, batch: int, args, store: Path | None, expected: dict | None) -> dict:
    """One point on a running server: the client call, then the server's step timer, log, TRACE counters (read
    again once the record store has drained, so the writer's time is in) and record store."""
    from sglang_trace.config import served_counters

    call = client_call(server.url, batch, point.context, args.output_len, point.key, args.stream_interval)
    first = server.info()
    before, counters, offset = step_time_dict(first), served_counters(first), server.log_size()
    drain = StoreDrain(store, point.context + args.output_len - 1) if store is not None else None
    if drain is not None:
        drain.start()
    res = run_client(call, args.seed)
    server.check()
    info = server.info()
    steps = new_step_times(before, step_time_dict(info), batch)
    out = {
        "context": point.context,
        "batch": batch,
        "output_len": args.output_len,
        "output_throughput": res.output_throughput,
        "e2e_output_throughput": batch * args.output_len / res.latency,
        "latency_s": res.latency,
        "ttft_s": res.last_ttft,
        "decode_step_ms": 1e3 * statistics.median(steps) if steps else None,
        "decode_throughput": batch / statistics.median(steps) if steps else None,
        "decode_step_windows": len(steps),
        "decode_step_ms_client": 1e3 * (res.latency - res.last_ttft) / max(1, args.output_len - 1),
        "last_gen_throughput": res.last_gen_throughput,
        **parse_log(server.log_since(offset)),
    }
    if drain is not None and expected is not None:
        tokens = batch * (point.context + args.output_len)
        usage = drain.finish(batch, max(120.0, tokens * STORE_S_PER_TOKEN), server)
        out |= record_bytes(usage, expected)
    if counters is None:  # no TRACE capturer on this server
        return out
    return out | finish_path(counters, served_counters(server.info()))


def server_summary(info: dict, start_s: float) -> dict:
    """What a started server reports about its capacity and memory (with TRACE, its host ring)."""
    from sglang_trace.config import served_counters

    state = (info.get("internal_states") or [{}])[0]
    counters = served_counters(info)
    graphs = (info.get("cuda_graph_config") or {}).get("decode") or {}
    return {
        "kv_capacity_tokens": info.get("max_total_num_tokens"),
        "max_running_requests": state.get("effective_max_running_requests_per_dp"),
        "memory_usage_gb": state.get("memory_usage"),
        "cuda_graph_decode": {"backend": graphs.get("backend"), "max_bs": graphs.get("max_bs"), "bs": graphs.get("bs")},
        "chunked_prefill_size": info.get("chunked_prefill_size"),
        "context_length": info.get("context_length") or HF_CONFIG["max_position_embeddings"],
        "sglang": info.get("version"),
        "start_s": start_s,
        "trace": {k: v for k, v in info.items() if k.startswith("trace_")},
        "host_ring": None
        if counters is None
        else {
            "gib": counters["ring"]["capacity"] / 2**30,
            "tokens": counters["ring"]["tokens"],
            "token_bytes": counters["token_bytes"],
        },
        "finish_device_reserved_gib": None if counters is None else counters["device_reserved_bytes"] / 2**30,
    }


def signature(name: str, args) -> dict:
    """What a configuration's stored points depend on: they are remeasured when it changes."""
    return {
        "flags": list(BASE_FLAGS + CONFIGS[name]),
        "mem_fraction_static": args.mem_fraction,
        "output_len": args.output_len,
        "batch_context": args.batch_context,
        "fill": args.fill,
        "max_batch": args.max_batch,
        "decode_log_interval": args.decode_log_interval,
        "stream_interval": args.stream_interval,
        "seed": args.seed,
    } | ({"decode_graph_bs": args.decode_graph_bs} if args.decode_graph_bs else {})


def run_config(name: str, points: list[Point], result: dict, args, save: Callable[[], None], left: Callable) -> None:
    """Start one configuration's server, measure its pending points (saving after each), stop it."""
    entry = result["configs"].get(name)
    if entry is None or entry.get("signature") != signature(name, args) or args.force:
        entry = {"signature": signature(name, args), "points": {}}
    pending = [p for p in points if p.key not in entry["points"]]
    if not pending and entry.get("status") == "ok":
        print(f"serve: {name}: all {len(points)} points measured; skipped (--force remeasures)")
        result["configs"][name] = entry
        return
    if left() < args.min_start_s:
        print(f"serve: {name}: {max(0.0, left()):.0f} s of --budget-s left, under --min-start-s; not started")
        return
    flags = CONFIGS[name]
    out_dir = args.out.parent
    store = Path(tempfile.mkdtemp(prefix="serve-store-", dir=args.store_dir)).resolve() if traced(flags) else None
    port = free_port()
    argv = server_argv(write_model((args.model_dir or out_dir / "model").resolve()), flags, port, store, args)
    log = out_dir / "logs" / f"{name.replace('+', '_')}.log"
    entry |= {"server_command": argv, "log": str(log)}
    result["configs"][name] = entry
    t0 = time.monotonic()
    server = Server(argv, f"http://127.0.0.1:{port}", log, out_dir / PID_FILE, store)
    try:
        wait_s = min(args.start_timeout_s, max(1.0, left()))
        try:
            server.wait_ready(wait_s)
            info = server.info()
        except RuntimeError as e:  # a live server cut off by --budget-s did not fail: nothing is judged on it
            cut = wait_s < args.start_timeout_s and server.proc.poll() is None
            entry |= {"status": "budget" if cut else "failed", "error": str(e)[-4000:]}
            save()
            print(f"serve: {name}: {e}", file=sys.stderr)
            return
        entry |= {"status": "ok", "server": server_summary(info, time.monotonic() - t0)}
        entry.pop("error", None)
        expected = expected_record_bytes(info, HF_CONFIG) if store is not None else None
        entry["server"]["expected_records"] = expected
        step_dir = store_step_dir(store) if store is not None else None
        warm = client_call(server.url, *WARMUP, "warmup", args.stream_interval)
        run_client(warm, args.seed)
        if step_dir is not None:  # the warm-up's records (and those of SGLang's own warm-up request) go
            drain = StoreDrain(step_dir)
            drain.start()
            drain.finish(WARMUP[0], 120, server)
        save()
        capacity = int(entry["server"]["kv_capacity_tokens"])
        cap = min(args.max_batch, int(entry["server"]["max_running_requests"] or args.max_batch))
        for point in pending:
            if left() <= 0:
                print(f"serve: budget spent; {name} stops before {point.key}")
                break
            if point.batch is None:
                batch, bound = fit_batch(capacity, point.context, args.output_len, args.fill, cap, args.decode_graph_bs)
            else:
                batch, bound = point.batch, False
            tokens = batch * (point.context + args.output_len)
            skip = None
            if point.batch is None and batch < 1 and args.decode_graph_bs:
                fits, _ = fit_batch(capacity, point.context, args.output_len, args.fill, cap)
                skip = f"no --decode-graph-bs size of {args.decode_graph_bs} is within its fit of {fits} requests"
            elif batch < 1 or tokens > capacity or point.context + args.output_len > entry["server"]["context_length"]:
                skip = f"{batch} x ({point.context} + {args.output_len}) tokens do not fit (KV {capacity})"
            if skip is not None:
                entry["points"][point.key] = {"context": point.context, "batch": batch, "skipped": skip}
                save()
                continue
            print(f"serve: {name} {point.key}: batch {batch}", flush=True)
            try:
                measured = measure(server, point, batch, args, step_dir, expected)
            except Exception as e:  # a failed point (e.g. out of memory) is a result; a dead server ends the config
                entry["points"][point.key] = {"context": point.context, "batch": batch, "error": repr(e)[-2000:]}
                save()
                server.check()
                continue
            entry["points"][point.key] = {**measured, "capacity_bound": bound}
            if (name, point.key) in args.profiled:
                entry["points"][point.key]["profile_dir"] = profile_point(server, point, batch, name, out_dir, args)
            save()
    finally:
        server.stop()
        if store is not None:
            shutil.rmtree(store, ignore_errors=True)
        save()


def save_json(path: Path, result: dict) -> None:
    """Write `result` to `path` through a temporary file (a run killed mid-write leaves the previous one)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def gpu_name() -> str | None:
    """The GPU as nvidia-smi names it (the bench process itself opens no CUDA context)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def dry_run(configs: list[str], points: list[Point], args) -> None:
    """Print every server command and client call, and what each TRACE configuration should write per token."""
    from sglang_trace.config import SERVER_ARGS_FIELDS

    model = args.model_dir or args.out.parent / "model"
    print(f"# model: {model}/config.json = {json.dumps(HF_CONFIG)}")
    print(f"# server env: {SERVER_ENV}")
    for name in configs:
        flags = CONFIGS[name]
        store = Path(args.store_dir or tempfile.gettempdir(), "serve-store-XXXX") if traced(flags) else None
        print(f"\n## {name}\n{' '.join(server_argv(model, flags, 'PORT', store, args))}")
        if store is not None:
            info = dict(SERVER_ARGS_FIELDS)
            it = iter(flags)
            for flag in it:
                if flag.startswith("--trace-"):
                    field = flag[2:].replace("-", "_")
                    info[field] = type(SERVER_ARGS_FIELDS[field])(next(it))
            info["trace_store"] = str(store)
            exp = expected_record_bytes(info, HF_CONFIG)
            print(
                f"# records: {exp['spec']}, {exp['record_bytes_per_token']:.1f} B/token expected "
                f"(+ routes {exp['routes_bytes_per_token']}), record store {exp['record_bytes_per_slot']} B/slot"
            )
        url = "http://127.0.0.1:PORT"
        print(f"run_one_case(**{client_call(url, *WARMUP, 'warmup', args.stream_interval)})  # warm-up, not recorded")
        for p in points:
            call = client_call(url, p.batch or 0, p.context, args.output_len, p.key, args.stream_interval)
            if p.batch is None:
                call["batch_size"] = "BATCH"
            print(f"run_one_case(**{call})")
            if (name, p.key) in args.profiled:
                print(f"#   then once more with profile=True, profile_steps={args.profile_steps}, "
                      f"profile_start_step={args.profile_start_step}: traces under <out dir>/profiles/")  # fmt: skip
            if p.batch is None:
                print(
                    f"#   BATCH = min({args.max_batch}, max running requests, floor({args.fill} x KV capacity / "
                    f"({p.context} + {args.output_len})))"
                    + (f", then the largest of {args.decode_graph_bs} no more" if args.decode_graph_bs else "")
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/serve/serve.json"), help="results JSON (PNG beside it)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256], help="batch axis (none: skip it)")
    p.add_argument("--batch-context", type=int, default=1024, help="input tokens of the batch axis")
    p.add_argument(
        "--contexts", type=int, nargs="*", default=[8192, 32768], help="long contexts at the largest batch that fits"
    )
    p.add_argument("--output-len", type=int, default=256, help="output tokens of every request (ignore_eos)")
    p.add_argument("--max-batch", type=int, default=256, help="most requests of a long-context point")
    p.add_argument("--fill", type=float, default=0.95, help="share of the KV capacity a long-context point fills")
    p.add_argument("--mem-fraction", type=float, default=0.85, help="--mem-fraction-static of every server")
    p.add_argument("--decode-log-interval", type=int, default=20, help="decode steps per SGLang step-timer window")
    p.add_argument(
        "--stream-interval", type=int, default=1, help="tokens per streamed chunk (SGLang's client default: 1)"
    )
    p.add_argument("--seed", type=int, default=42, help="seed of the random prompt ids")
    p.add_argument("--model-dir", type=Path, help="where config.json is written (default: <out dir>/model)")
    p.add_argument("--store-dir", help="parent of the record stores of TRACE servers (default: the temp dir)")
    p.add_argument("--start-timeout-s", type=float, default=600, help="wait for a server's /health")
    p.add_argument("--budget-s", type=float, help="start no server or point after this many seconds")
    p.add_argument(
        "--min-start-s", type=float, default=120, help="start no server with less of --budget-s left (a start: 1-4 min)"
    )
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="CONFIG:POINT",
        help="after measuring POINT (a key such as ctx1024-b256) of CONFIG, run it once more under SGLang's torch "
        "profiler (CPU + GPU, run_one_case's own); traces under <out dir>/profiles/, the point is not re-stored",
    )
    p.add_argument("--profile-steps", type=int, default=8, help="forward steps each profile records")
    p.add_argument("--profile-start-step", type=int, help="first profiled forward step (default: the first)")
    p.add_argument(
        "--decode-graph-bs",
        type=int,
        nargs="+",
        help="decode CUDA-graph batch sizes of every server (default: SGLang's 36 sizes up to 256, about 80 s of "
        "each start); every batch of the axis must be one of them, and a long-context point runs at the largest "
        "of them within its fit (list the fits you expect, e.g. 19 and 68 at 32K on one H200)",
    )
    p.add_argument("--force", action="store_true", help="remeasure points already in --out")
    p.add_argument("--dry-run", action="store_true", help="print server commands and client calls; start nothing")
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    try:
        args.profiled = profiled(args.profile)  # checked before any server starts
    except ValueError as e:
        p.error(str(e))
    if args.decode_graph_bs:
        missing = sorted(set(args.batches) - set(args.decode_graph_bs))
        if missing:
            p.error(
                f"--decode-graph-bs {args.decode_graph_bs}: batches {missing} have no graph of their size (their "
                "decode would run padded to a larger graph)"
            )
    points = plan(args.batches, args.batch_context, args.contexts)
    if args.dry_run:
        dry_run(configs, points, args)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(args.out.read_text()) if args.out.exists() else {"configs": {}}
    result |= {"bench": "bench/serve.py", "hf_config": HF_CONFIG, "quantities": QUANTITIES, "gpu": gpu_name()}
    start = time.monotonic()

    def left() -> float:
        return math.inf if args.budget_s is None else args.budget_s - (time.monotonic() - start)

    def save() -> None:
        result["targets"] = [evaluate(t, result["configs"]) for t in TARGETS]
        result["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save_json(args.out, result)
        plot(result, args.out.with_suffix(".png"), args.batch_context)

    def on_term(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    kill_leftover(args.out.parent / PID_FILE)
    for name in configs:
        run_config(name, points, result, args, save, left)
    save()
    for t in result["targets"]:
        print(f"serve: target {t['target']} {t['config']} vs {t['baseline']}: {t['status']}")


if __name__ == "__main__":
    main()
