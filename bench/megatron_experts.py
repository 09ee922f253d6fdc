"""MoE block forward + backward: TRACE grouped experts (`megatron_trace.grouped`) in bf16 / qat / trace against
today's SequentialMLP path, with Qwen3-30B-A3B layer shapes on one expert-parallel rank of 2 (H200, or CPU for a
smoke run with `--small`).

Grouped `qat` / `trace` fake-quantize the expert weights in place (`TraceConfig.expert_weights_in_place`): before
every iteration the FP32 masters are copied into the BF16 parameters (untimed, in every grouped run, as the
optimizer step does), and the in-place fake-quant is timed with the iteration. `grouped_*_copy` keep the per-step
fake-quantized copy instead.

A few Megatron MoE layers (router with R3 replay, MoE-input site, allgather dispatch, experts, combine) run as a
residual chain `h = h + moe(h)` on one micro-batch of `--batch` x `--seq` tokens; the loss is `mean(h^2)`. Routes
are replayed from a fixed, mildly skewed random routing (log-normal expert popularity), identical in every mode.
`trace` guides the MoE-input site of every layer (b = `--bits`) with records that an RTN pass of the same chain
wrote (the rollout's role). Modes interleave iteration by iteration; time is CUDA-event time of one fwd+bwd;
peak memory is `max_memory_allocated` during the iteration above what was allocated before it (gradients are
freed between iterations, so they count in every mode; the `_copy` runs' weight copy counts too).

    python bench/megatron_experts.py --out megatron_experts.json
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import device_name, sync, write_json
from megatron_trace.config import TraceConfig
from megatron_trace.cpu import init_single_rank
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from megatron_trace.source import TensorRolloutSource
from trace_core.numerics.quant import quantize
from trace_core.records.spec import Record, RecordSpec

RUNS = {  # run name -> (grouped experts, mode, expert weights fake-quantized in place)
    "grouped_bf16": (True, "bf16", False),
    "grouped_qat": (True, "qat", True),
    "grouped_trace": (True, "trace", True),
    "grouped_qat_copy": (True, "qat", False),
    "grouped_trace_copy": (True, "trace", False),
    "sequential_trace": (False, "trace", False),
    "sequential_qat": (False, "qat", False),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64, help="local experts (128 over EP = 2)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--bits", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run; numbers mean nothing)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="directory: one profiled iteration of each run (torch profiler)")
    return p.parse_args()


def profile(iteration: Callable[[str], tuple], runs: list[str], out: str) -> dict[str, dict]:
    """One more iteration of each run under the torch profiler: per run the kernel table (self CUDA time, top 40) in
    `{out}/{run}.txt`, the trace in `{out}/{run}.json.gz`, and the summary returned: CUDA-event ms of the iteration,
    the sum of its kernels' times (their gap to the event time is time the GPU waited on the host) and launches."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    Path(out).mkdir(parents=True, exist_ok=True)
    summary = {}
    for run in runs:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            elapsed, _, _ = iteration(run)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=70)
        Path(out, f"{run}.txt").write_text(f"{run}: {elapsed:.2f} ms (CUDA events, profiled)\n{table}\n")
        trace = Path(out, f"{run}.json")
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
            g.write(f.read())
        trace.unlink()
        summary[run] = {
            "ms_profiled": elapsed,
            "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3,
            "kernels": len(kernels),
        }
        print(f"profile {run}: {summary[run]}")
    return summary


def skewed_routes(tokens: int, experts: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct top-k experts per token, expert popularity log-normal (sigma 0.5)."""
    popularity = torch.exp(0.5 * torch.randn(experts, generator=gen))
    return torch.multinomial(popularity.expand(tokens, experts), topk, replacement=False, generator=gen)


def chain(model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    for layer in model.decoder.layers:
        h = h + layer.mlp(h)[0]
    return h


def main() -> None:
    args = parse()
    init_single_rank()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        args.hidden, args.experts, args.topk, args.expert_ffn, args.seq = 64, 8, 2, 32, 64
    cfg = MoEModelConfig(
        vocab=128, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, head_dim=16,
        experts=args.experts, topk=args.topk, expert_ffn=args.expert_ffn, max_seq=args.seq,
    )  # fmt: skip
    runs = args.runs.split(",")
    dtype = torch.bfloat16
    models = {g: build_moe_model(cfg, dtype=dtype, grouped=g) for g in {RUNS[r][0] for r in runs}}
    if len(models) == 2:  # same expert weights in both
        with torch.no_grad():
            for lg, ls in zip(models[True].decoder.layers, models[False].decoder.layers, strict=True):
                ls.mlp.router.weight.copy_(lg.mlp.router.weight)
                for name in ("linear_fc1", "linear_fc2"):
                    w = getattr(lg.mlp.experts, name).weight
                    for e, expert in enumerate(ls.mlp.experts.local_experts):
                        getattr(expert, name).weight.copy_(w[e])
    # FP32 masters of the grouped experts (the optimizer's): copied into the parameters before every grouped run.
    masters = {}
    if True in models:
        masters = {p: p.detach().float() for n, p in models[True].named_parameters() if ".experts." in n}

    def open_run(grouped: bool, mode: str, in_place: bool) -> TraceSession:
        """The run's session on its model, the grouped parameters reset to the masters first (untimed)."""
        if grouped:
            with torch.no_grad():
                for p, m in masters.items():
                    p.copy_(m)
        cfg = TraceConfig(mode=mode, spec=spec, measure=False, expert_weights_in_place=in_place)
        return TraceSession(models[grouped], cfg)

    gen = torch.Generator().manual_seed(0)
    b, s = args.batch, args.seq
    mb = pack_microbatch([(i, torch.zeros(s, dtype=torch.int64)) for i in range(b)]).to(device)
    layers = tuple(range(args.layers))
    has_route = (torch.arange(s) < s - 1).expand(b, s).to(device)  # no route for a trajectory's last token
    routes = {i: (skewed_routes(b * s, args.experts, args.topk, gen).view(b, s, -1), has_route) for i in layers}
    routes = {i: (r.to(device), has) for i, (r, has) in routes.items()}
    x0 = (torch.randn(s, b, args.hidden, generator=gen) * 0.5).to(device, dtype)

    # Rollout role: RTN at the MoE-input sites of the same chain, recorded per (trajectory, position).
    spec = RecordSpec(bits=args.bits, moe_layers=layers, attn_layers=())
    tables: dict = {}

    def tap(site, rows, x, y):
        q = quantize(x.detach(), "nvfp4", per_token=True)
        rec = Record.from_quantized(q, args.bits)
        order = (rows.traj * s + rows.pos).argsort()
        shape = (b, s)
        tables[site] = (
            Record(rec.fmt, rec.bits, rec.n, rec.low_bits[order].view(*shape, -1), rec.scales[order].view(*shape, -1),
                   rec.global_scale[order].view(*shape, 1)),
            torch.ones(shape, dtype=torch.bool, device=x.device),
        )  # fmt: skip

    first = models[RUNS[runs[0]][0]]
    open_run(RUNS[runs[0]][0], "qat", False).remove()  # the masters into the grouped parameters
    session = TraceSession(first, TraceConfig(mode="qat", spec=spec, measure=False), tap=tap)
    with torch.no_grad():
        session.begin_microbatch(mb.rows, TensorRolloutSource({}, routes))
        chain(first, x0)
    session.remove()
    source = TensorRolloutSource(tables, routes)

    # Bit-exactness at these shapes: grouped and sequential chains give the same output in each mode.
    same = {}
    if len(models) == 2:
        for mode in ("bf16", "qat", "trace"):
            outs = []
            for grouped in (True, False):
                in_place = grouped and mode != "bf16"
                session = open_run(grouped, mode, in_place)
                if in_place:
                    session.quantize_weights_in_place()
                with torch.no_grad():
                    session.begin_microbatch(mb.rows, source)
                    outs.append(chain(models[grouped], x0))
                session.remove()
            same[mode] = bool(torch.equal(*outs))
        print(f"grouped == sequential output (bit-exact): {same}")

    def iteration(run: str) -> tuple[float, int, dict]:
        """One timed forward + backward of `run` (the in-place fake-quant included): ms, peak bytes, metrics."""
        grouped, mode, in_place = RUNS[run]
        model = models[grouped]
        session = open_run(grouped, mode, in_place)
        session.begin_microbatch(mb.rows, source)
        x = x0.detach().requires_grad_()
        sync()
        base = torch.cuda.memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        if in_place:  # once per optimizer step, after the masters' copy
            session.quantize_weights_in_place()
        chain(model, x).float().square().mean().backward()
        if device == "cuda":
            end.record()
            sync()
            elapsed = start.elapsed_time(end)
            peak = torch.cuda.max_memory_allocated() - base
        else:
            elapsed, peak = 1e3 * (time.perf_counter() - t0), 0
        metrics = session.end_step()
        session.remove()
        model.zero_grad(set_to_none=True)
        return elapsed, peak, metrics

    times: dict[str, list[float]] = {r: [] for r in runs}
    peaks: dict[str, list[int]] = {r: [] for r in runs}
    metrics: dict[str, dict] = {}
    for it in range(args.warmup + args.iters):
        for run in runs:
            elapsed, peak, metrics[run] = iteration(run)
            if it >= args.warmup:
                times[run].append(elapsed)
                peaks[run].append(peak)
    profiles = profile(iteration, runs, args.profile) if args.profile else {}
    results = {
        r: {
            "ms_median": statistics.median(t),
            "ms_min": min(t),
            "ms_max": max(t),
            "peak_extra_bytes": max(peaks[r]),
            "rtn_fallback": metrics[r].get("trace/rtn_fallback", 0.0),
        }
        for r, t in times.items()
    }

    def ratio(a: str, b_: str, key: str = "ms_median"):
        if a in results and b_ in results and results[b_][key]:
            return results[a][key] / results[b_][key]
        return None

    copy_bytes = sum(p.numel() * p.element_size() for n, p in first.named_parameters() if ".experts." in n)

    ratios = {
        "qat_vs_bf16_grouped": ratio("grouped_qat", "grouped_bf16"),
        "trace_vs_qat_grouped": ratio("grouped_trace", "grouped_qat"),
        "sequential_vs_grouped_trace": ratio("sequential_trace", "grouped_trace"),
        "peak_qat_vs_bf16": ratio("grouped_qat", "grouped_bf16", "peak_extra_bytes"),
        "peak_trace_vs_bf16": ratio("grouped_trace", "grouped_bf16", "peak_extra_bytes"),
        "qat_copy_vs_bf16_grouped": ratio("grouped_qat_copy", "grouped_bf16"),
        "trace_copy_vs_qat_copy_grouped": ratio("grouped_trace_copy", "grouped_qat_copy"),
        "peak_qat_copy_vs_bf16": ratio("grouped_qat_copy", "grouped_bf16", "peak_extra_bytes"),
        "peak_trace_copy_vs_bf16": ratio("grouped_trace_copy", "grouped_bf16", "peak_extra_bytes"),
    }
    routed = b * s * args.topk
    flops = 3 * 2 * routed * args.hidden * 3 * args.expert_ffn * args.layers  # fwd + 2x bwd of FC1 (2I) and FC2 (I)
    print(f"device: {device_name()}, torch {torch.__version__}")
    print(f"{args.layers} MoE layers, hidden {args.hidden}, {args.experts} local experts top-{args.topk}, "
          f"FFN {args.expert_ffn}, {b * s} tokens ({routed} routed rows), {args.iters} iterations")  # fmt: skip
    print(f"{'run':<20}{'ms median':>11}{'min':>9}{'max':>9}{'expert TFLOP/s':>16}{'peak extra GiB':>16}")
    for r, v in results.items():
        print(f"{r:<20}{v['ms_median']:>11.2f}{v['ms_min']:>9.2f}{v['ms_max']:>9.2f}"
              f"{flops / v['ms_median'] / 1e9:>16.1f}{v['peak_extra_bytes'] / 2**30:>16.3f}")  # fmt: skip
    print(f"expert weight copy of the _copy runs (fake-quantized, once per step): {copy_bytes / 2**30:.3f} GiB")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}" if v is not None else f"{k}: -")
    if args.out:
        payload = {"device": device_name(), "torch": torch.__version__}
        payload |= {"args": vars(args), "results": results, "ratios": ratios, "grouped_equals_sequential": same}
        payload["expert_weight_copy_bytes"] = copy_bytes
        payload["profiles"] = profiles
        write_json(args.out, payload, indent=2)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # without it the H200 runs hung at exit, results printed
