"""Weight sync into a live patched SGLang server at Qwen3-30B-A3B scale (issue 32): seconds per sync against the
policy's bytes, and the memory a sync adds, for `weight_sync = "tensor"` from the trainer's GPU (CUDA IPC handles)
and from CPU tensors (shared memory).

The policy is the trainer's own export path: `megatron_trace.export.export_state` of a random BF16 single-rank
Megatron state of the model's shape (`bench/serve.py`'s Qwen3-30B-A3B config; `--layers` keeps the first N
layers), so names, order, dtypes and views are those a trainer's `hf_weights()` hands the pool. Each sync is
`trace_rl.weight_sync.TensorTransport.push` in buckets of `--bucket-mb`, then every worker's version check: what
`WeightSync.push` runs, less its name check against a checkpoint on disk (the server has none: dummy weights).

The server is started by the bench in emulate mode without records (`--trace-mode emulate --trace-sites none`), so
every update goes through `FusedMoE.weight_loader`, where the expert weights are fake-quantized as after a disk
load; with `--load-format dummy --skip-tokenizer-init`, and on CUDA `--disable-cuda-graph` (a sync does not touch
the graphs; their capture would take most of the start) and `--mem-fraction-static` (`--mem-fraction`, low enough
that the sender's copy of the policy fits beside the server on one GPU). `--server-command` replaces
`python -m sglang.launch_server` (e.g. `python tests/sglang_cpu_server.py` for SGLang's CPU engine) and then only
the model and TRACE flags are given.

Per sync (`QUANTITIES`): seconds, bytes, GB/s, buckets; `sender_peak_extra_bytes` (CUDA: the bench process's peak
allocation above the one before the sync, i.e. the staging), `device_peak_extra_bytes` (CUDA: the device's used
memory, total - free, sampled every 2 ms, above before: the server's temporaries too) and `host_peak_extra_bytes`
(MemTotal - MemAvailable, sampled likewise: the shared-memory staging of CPU tensors). The first sync of each
source and bucket size is reported apart (`first`): it pays the server's first-call costs.

    python bench/weight_sync.py --out OUT/weight_sync.json                 # 48 layers: 61.1 GB (56.9 GiB) a sync
    python bench/weight_sync.py --out OUT/ws.json --layers 4 --sources cuda,cpu --bucket-mb 256 1024
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, the packages of this checkout

from bench.serve import HF_CONFIG
from bench.serve_server import PID_FILE, Server, free_port, kill_leftover
from megatron_trace.export import export_state
from megatron_trace.hf_import import megatron_names, model_dims
from megatron_trace.model import MoEModelConfig
from trace_rl.weight_buckets import MIB, nbytes

SERVER_FLAGS = ("--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16")
TRACE_FLAGS = ("--trace-mode", "emulate", "--trace-sites", "none", "--weight-version", "0", "--trace-step", "0")
"""Emulate's weight loader, no records; the integer policy version TRACE's RL client needs."""
CUDA_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--disable-cuda-graph")  # fmt: skip

QUANTITIES = {
    "seconds": "TensorTransport.push of every bucket plus each worker's /model_info version check (WeightSync.push)",
    "bytes": "the policy's HF bytes (every tensor of the export once)",
    "GBps": "bytes / seconds / 1e9",
    "buckets": "update_weights_from_tensor calls per server",
    "sender_peak_extra_bytes": "CUDA: torch.cuda.max_memory_allocated of the bench process above before the sync",
    "device_peak_extra_bytes": "CUDA: the device's total - free memory (torch.cuda.mem_get_info), sampled every 2 ms "
    "during the sync, above before it: the server's temporaries and the sender's staging together",
    "host_peak_extra_bytes": "MemTotal - MemAvailable of /proc/meminfo, sampled every 2 ms, above before the sync",
}


def megatron_shape(name: str, d: MoEModelConfig) -> tuple[int, ...]:
    """The full (single-rank) shape of Megatron parameter `name` (`megatron_names`) of a Qwen3-MoE of dims `d`."""
    rest = name.rsplit(".weight", 1)[0]
    if rest in ("embedding.word_embeddings", "output_layer"):
        return (d.vocab, d.hidden)
    if rest.endswith(("q_layernorm", "k_layernorm")):
        return (d.head_dim,)
    if rest.endswith("layernorm"):  # input, pre-MLP and final
        return (d.hidden,)
    if rest.endswith("linear_qkv"):
        return ((d.heads + 2 * d.kv_heads) * d.head_dim, d.hidden)
    if rest.endswith("linear_proj"):
        return (d.hidden, d.heads * d.head_dim)
    if rest.endswith("mlp.router"):
        return (d.experts, d.hidden)
    if rest.endswith("linear_fc1"):
        return (2 * d.expert_ffn, d.hidden)
    if rest.endswith("linear_fc2"):
        return (d.hidden, d.expert_ffn)
    raise KeyError(f"no shape for Megatron parameter {name}")


def export_config(d: MoEModelConfig) -> SimpleNamespace:
    """The TransformerConfig fields `export_state` reads, for a Qwen3-MoE of dims `d`."""
    return SimpleNamespace(
        gated_linear_unit=True, add_bias_linear=False, qk_layernorm=True, normalization="RMSNorm",
        num_layers=d.layers, num_attention_heads=d.heads, num_query_groups=d.kv_heads, kv_channels=d.head_dim,
        num_moe_experts=d.experts,
    )  # fmt: skip


def policy(hf_config: dict, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's HF export of a random BF16 policy of `hf_config`'s shape, on `device`."""
    d = model_dims(hf_config)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name in megatron_names(d):
        t = torch.empty(megatron_shape(name, d), dtype=torch.bfloat16, device=device)
        state[name] = t.normal_(0.0, 0.02, generator=gen)
    return export_state(state, export_config(d))


class Peak(threading.Thread):
    """The largest value of `read()` above its value at the start, sampled every 2 ms until `stop`."""

    def __init__(self, read: Callable[[], int]) -> None:
        super().__init__(daemon=True)
        self.read, self.base = read, read()
        self.peak = self.base
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, self.read()) - self.base


def host_used() -> int:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def sync_once(transport, workers: list, tensors: dict[str, torch.Tensor], version: int, timeout_s: float) -> dict:
    """One sync of `tensors` as policy `version` into every worker's server, with its time and memory."""
    cuda = any(t.is_cuda for t in tensors.values())
    samplers = [Peak(host_used)] + ([Peak(device_used)] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for s in samplers:
        s.start()
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    buckets = transport.push(tensors, version, deadline)
    for w in workers:
        w.check_version(version, deadline=deadline)
    seconds = time.perf_counter() - start
    extra = [s.stop() for s in samplers]
    size = sum(nbytes(t) for t in tensors.values())
    return {
        "seconds": seconds,
        "bytes": size,
        "GBps": size / seconds / 1e9,
        "buckets": buckets,
        "sender_peak_extra_bytes": torch.cuda.max_memory_allocated() - base if cuda else None,
        "device_peak_extra_bytes": extra[1] if cuda else None,
        "host_peak_extra_bytes": extra[0],
    }


def summary(syncs: list[dict]) -> dict:
    """The first sync apart, the median of the others (each quantity)."""
    rest = syncs[1:] or syncs
    keys = [k for k in syncs[0] if syncs[0][k] is not None]
    return {"first": syncs[0], "median": {k: statistics.median(s[k] for s in rest) for k in keys}, "syncs": syncs}


def server_argv(args, model: Path, port: int) -> list[str]:
    command = args.server_command.split() if args.server_command else [sys.executable, "-m", "sglang.launch_server"]
    argv = [*command, "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port), *SERVER_FLAGS]
    argv += TRACE_FLAGS
    if not args.server_command:
        argv += [*CUDA_FLAGS, "--mem-fraction-static", str(args.mem_fraction)]
    return argv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("out/weight_sync/weight_sync.json"), help="results JSON")
    p.add_argument("--hf-config", type=Path, help="config.json of the model (default: bench/serve.py's 30B shape)")
    p.add_argument("--layers", type=int, help="keep the first N layers (default: all)")
    p.add_argument("--sources", default="cuda", help="comma-separated: cuda (CUDA IPC), cpu (shared memory)")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[512.0], help="weight_sync_bucket_mb values")
    p.add_argument("--syncs", type=int, default=3, help="syncs per source and bucket size (the first apart)")
    p.add_argument("--mem-fraction", type=float, default=0.45, help="--mem-fraction-static of the server (CUDA)")
    p.add_argument("--server-command", help="instead of `python -m sglang.launch_server` (then no CUDA flags)")
    p.add_argument("--start-timeout-s", type=float, default=600, help="wait for the server's /health")
    p.add_argument("--timeout-s", type=float, default=600, help="weight_sync_timeout_s of each sync")
    args = p.parse_args()
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = [s for s in sources if s not in ("cuda", "cpu")]
    if bad or not sources:
        p.error(f"--sources: {bad or 'none given'}; choose from cuda, cpu")
    if "cuda" in sources and not torch.cuda.is_available():
        p.error("--sources cuda needs a CUDA GPU in this process")
    if args.syncs < 1:
        p.error(f"--syncs {args.syncs}: at least 1")
    hf = json.loads(args.hf_config.read_text()) if args.hf_config else dict(HF_CONFIG)
    if args.layers is not None:
        if not 1 <= args.layers <= hf["num_hidden_layers"]:
            p.error(f"--layers {args.layers}: between 1 and the model's {hf['num_hidden_layers']}")
        hf |= {"num_hidden_layers": args.layers, "max_window_layers": args.layers}
    # imported here: the RL package's SGLang client (no SGLang import) and its transport
    from trace_rl.config import RLConfig
    from trace_rl.rollout.sglang_worker import SGLangWorker
    from trace_rl.weight_sync import TensorTransport

    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = Path(tempfile.mkdtemp(prefix="weight-sync-model-"))
    (model / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    kill_leftover(args.out.parent / PID_FILE)
    port = free_port()
    argv = server_argv(args, model, port)
    result: dict = {"bench": "bench/weight_sync.py", "hf_config": hf, "quantities": QUANTITIES, "server_command": argv}
    server = Server(argv, f"http://127.0.0.1:{port}", args.out.parent / "weight_sync_server.log",
                    args.out.parent / PID_FILE, None)  # fmt: skip
    try:
        t0 = time.monotonic()
        server.wait_ready(args.start_timeout_s)
        result["server_start_s"] = time.monotonic() - t0
        info = server.info()
        result["server_memory_gb"] = (info.get("internal_states") or [{}])[0].get("memory_usage")
        version = 0
        for source in sources:
            tensors = policy(hf, source)
            result.setdefault("policy", {"tensors": len(tensors), "bytes": sum(nbytes(t) for t in tensors.values())})
            for mb in args.bucket_mb:
                cfg = RLConfig(rollout_backend="sglang", sglang_urls=server.url, rollout_workers=1, mode="qat",
                               weight_sync="tensor", weight_sync_bucket_mb=mb,
                               weight_sync_timeout_s=args.timeout_s)  # fmt: skip
                workers = [SGLangWorker(server.url, cfg, hf["vocab_size"])]
                transport = TensorTransport(workers, int(mb * MIB))
                syncs = []
                for _ in range(args.syncs):
                    version += 1
                    syncs.append(sync_once(transport, workers, tensors, version, args.timeout_s))
                    server.check()
                    print(f"weight_sync: {source} {mb:g} MiB: {syncs[-1]['seconds']:.3f} s", flush=True)
                result.setdefault("results", {})[f"{source}-{mb:g}MiB"] = summary(syncs)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
            del tensors
            if source == "cuda":
                torch.cuda.empty_cache()
    finally:
        server.stop()
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
