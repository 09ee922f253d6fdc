"""Timing and reporting helpers the benches share: CUDA-graph kernel timing, copy bandwidth, wall time with the
device synchronised, the device's name, Markdown tables and JSON files.

Imported by the bench scripts as `bench.common`; a script run as `python bench/<name>.py` puts the checkout's root
on `sys.path` before its first `bench.` import."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait for `device` (the current CUDA device for None, where there is one); nothing on a CPU."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def mean_time(fn: Callable[[], object], iters: int, device: torch.device | str | None = None) -> float:
    """Mean seconds per call of `fn` over `iters` calls, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def bench_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` by `triton.testing.do_bench` (L2 flushed between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def capture_graph(
    fn: Callable[[], object],
    warmup: int = 1,
    after: Callable[[], object] | None = None,
    device: torch.device | str | None = None,
) -> Callable[[], None]:
    """`fn` captured in a CUDA graph; returns the graph's replay. `fn` runs `warmup` times first on a side stream,
    outside the capture (compilation, allocations), each call followed by `after` where given (work that runs
    outside the graph, as SGLang calls `on_forward_end` after a replay)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
            if after is not None:
                after()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` replayed from a CUDA graph (`capture_graph`, `bench_ms`): the kernels alone,
    without Python dispatch (as inside SGLang's and Megatron's CUDA graphs)."""
    return bench_ms(capture_graph(fn))


def copy_gbps(nbytes: int) -> float:
    """Device-to-device copy bandwidth (read + write counted) for a buffer of nbytes / 2, graph-timed: the baseline
    a memory-bound kernel moving `nbytes` is compared with."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_ms(lambda: dst.copy_(src)) / 1e6


def device_name(device: torch.device | str | None = None) -> str:
    """The CUDA device's name, or "cpu" (`device` None: the current CUDA device where there is one)."""
    if device is None:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def versions() -> str:
    """`GPU: <name>  torch <version>  triton <version>`, the first line of a kernel bench's report."""
    import triton

    return f"GPU: {device_name()}  torch {torch.__version__}  triton {triton.__version__}"


def markdown(rows: Iterable[dict], cols: list[tuple[str, str]]) -> str:
    """A Markdown table of `rows` with one column per (key, format) of `cols`; "-" where a row lacks the key."""
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in cols) + " |")
    return "\n".join(lines)


def write_json(path: str | Path | None, payload: object, indent: int = 1) -> None:
    """`payload` as JSON into `path` (nothing where `path` is None: the bench's `--out` not given)."""
    if path is not None:
        Path(path).write_text(json.dumps(payload, indent=indent))
