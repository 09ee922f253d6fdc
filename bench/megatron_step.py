"""Trainer step time of a small Megatron MoE under bf16, qat and trace (H200 or any CUDA GPU; CPU for a smoke run).

One step = forward + backward over `--microbatches` micro-batches, then Adam on FP32 master weights and their copy
into the BF16 parameters (as the trainer does), with R3 replaying the emulated rollout's routes in every mode (so
routing cost is identical). With `--grouped`, qat and trace fake-quantize the expert weights in place after that copy
(`TraceConfig.expert_weights_in_place`, timed with the step). `trace` also fetches the records of the latter half of
the MoE and attention layers (b = `--bits`) per micro-batch; `--measure` adds the code-flip counting of the RL
trainer (`TraceConfig.measure`). Prints a table and writes JSON to `--out`.

    python bench/megatron_step.py --out megatron_step.json
    python bench/megatron_step.py --preset qwen3-4l --grouped --iters 30 --out step_qwen3.json

`--preset` sets the model and batch flags (explicit flags still override): `small` is `trace_rl.warmup`'s results
model at 8 x 256 positions per micro-batch, `qwen3-4l` four Qwen3-30B-A3B-shaped layers (one expert-parallel rank of
2: 64 local experts) at 2 x 2048. Spread: min, quartiles and max of the step times (all kept in the JSON); peak
memory: `max_memory_allocated` during a step above what was allocated before it.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import device_name, sync, write_json
from megatron_trace.config import TraceConfig
from megatron_trace.cpu import init_single_rank
from megatron_trace.emulate import emulate_rollout
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from trace_core.records.spec import RecordSpec
from trace_rl.warmup import PRESETS as MODEL_PRESETS

_DIMS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "topk", "expert_ffn", "vocab")
PRESETS = {
    "small": {k: getattr(MODEL_PRESETS["small"], k) for k in _DIMS} | {"seq": 256, "batch": 8},
    "qwen3-4l": dict(hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128, experts=64, topk=8, expert_ffn=768,
                     vocab=32000, seq=2048, batch=2),
}  # fmt: skip
"""Flag defaults per `--preset`."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="model and batch flag defaults")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="trajectories per micro-batch")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--bits", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--modes", default="bf16,qat,trace")
    p.add_argument("--grouped", action="store_true", help="TRACE grouped experts instead of SequentialMLP")
    p.add_argument("--measure", action="store_true", help="count code flips as the RL trainer does")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak for MFU (H200: 989)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    preset = p.parse_known_args()[0].preset
    if preset is not None:
        p.set_defaults(**PRESETS[preset])
    return p.parse_args()


def step_flops(cfg: MoEModelConfig, tokens: int, seq: int) -> float:
    """Model FLOPs of one training step over `tokens` positions (padding included: it is computed): 6 per active
    weight per token (QKV, output projection, router, the top-k experts' FC1 and FC2, the LM head) plus the
    attention products (4 * seq * heads * head_dim per token per layer forward, no causal halving, x3 for
    forward + backward)."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = cfg.hidden * (q + 2 * kv) + q * cfg.hidden + cfg.hidden * cfg.experts
    per_layer += cfg.topk * 3 * cfg.hidden * cfg.expert_ffn
    dense = 6 * (cfg.layers * per_layer + cfg.hidden * cfg.vocab)
    attention = 3 * cfg.layers * 4 * seq * q
    return float(tokens * (dense + attention))


def main() -> None:
    args = parse()
    init_single_rank()
    cfg = MoEModelConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        experts=args.experts,
        topk=args.topk,
        expert_ffn=args.expert_ffn,
        max_seq=args.seq,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_moe_model(cfg, dtype=torch.bfloat16, grouped=args.grouped)
    n = args.batch * args.microbatches
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.seq // 2, args.seq + 1, (n,), generator=g).tolist()
    trajs = [(i, torch.randint(0, cfg.vocab, (length,), generator=g)) for i, length in enumerate(lengths)]
    mbs = [pack_microbatch(trajs[i : i + args.batch], seq_len=args.seq).to(device) for i in range(0, n, args.batch)]
    layers = tuple(range(cfg.layers))
    spec = RecordSpec.latter_half(layers, layers, bits=args.bits)
    t0 = time.perf_counter()
    source = emulate_rollout(model, mbs, spec, num_trajectories=n, max_positions=args.seq)
    sync()
    emulate_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    optimizer = torch.optim.Adam(masters, lr=1e-6)

    modes = args.modes.split(",")
    times: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, list[int]] = {m: [] for m in modes}
    fallback: dict[str, float] = {}
    # Modes interleave step by step, so clock and thermal drift hit all of them alike.
    for it in range(args.warmup + args.iters):
        for mode in modes:
            in_place = args.grouped and mode != "bf16"
            session = TraceSession(
                model, TraceConfig(mode=mode, spec=spec, measure=args.measure, expert_weights_in_place=in_place)
            )
            sync()
            if device == "cuda":
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            if in_place:  # the parameters hold the masters' BF16 values here (the last step's copy)
                session.quantize_weights_in_place()
            for mb in mbs:
                session.begin_microbatch(mb.rows, source)
                logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
                loss = torch.log_softmax(logits.float(), -1)[..., 0][mb.valid].mean()
                loss.backward()
            for p, m in zip(params, masters, strict=True):
                m.grad, p.grad = p.grad.float(), None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
            metrics = session.end_step()
            sync()
            if it >= args.warmup:
                times[mode].append(time.perf_counter() - start)
                peaks[mode].append(torch.cuda.max_memory_allocated() - base if device == "cuda" else 0)
            fallback[mode] = metrics.get("trace/rtn_fallback", 0.0)
            session.remove()
    flops = step_flops(cfg, args.batch * args.seq * args.microbatches, args.seq)
    results = {}
    for m, t in times.items():
        q1, _, q3 = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else (t[0],) * 3
        results[m] = {
            "step_ms_median": 1e3 * statistics.median(t),
            "step_ms_min": 1e3 * min(t),
            "step_ms_q1": 1e3 * q1,
            "step_ms_q3": 1e3 * q3,
            "step_ms_max": 1e3 * max(t),
            "mfu": flops / statistics.median(t) / (args.peak_tflops * 1e12),
            "peak_extra_bytes": max(peaks[m]),
            "rtn_fallback_elements": fallback[m],
            "step_ms": [1e3 * x for x in t],
        }
    ref = results.get("qat", {}).get("step_ms_median")
    tokens = sum(int(mb.valid.sum()) for mb in mbs)
    print(f"device: {device_name() if device == 'cuda' else platform.processor() or 'cpu'}")
    print(f"model: {cfg}; {tokens} tokens / step in {len(mbs)} micro-batches; rollout emulation {emulate_s:.2f} s")
    print(f"{args.iters} steps per mode after {args.warmup} warm-up, modes interleaved")
    print(
        f"{'mode':<8}{'median ms':>11}{'min':>9}{'q1':>9}{'q3':>9}{'max':>9}{'vs qat':>8}{'tok/s':>9}{'MFU':>7}"
        f"{'peak GiB':>10}"
    )
    for mode, r in results.items():
        ratio = f"{r['step_ms_median'] / ref:.3f}" if ref else "-"
        tps = tokens / (r["step_ms_median"] / 1e3)
        print(
            f"{mode:<8}{r['step_ms_median']:>11.2f}{r['step_ms_min']:>9.2f}{r['step_ms_q1']:>9.2f}"
            f"{r['step_ms_q3']:>9.2f}{r['step_ms_max']:>9.2f}{ratio:>8}{tps:>9.0f}{r['mfu']:>7.3f}"
            f"{r['peak_extra_bytes'] / 2**30:>10.2f}"
        )
    if args.out:
        payload = {
            "device": device_name(),
            "torch": torch.__version__,
            "args": vars(args),
            "tokens_per_step": tokens,
            "model_flops_per_step": flops,
            "results": results,
        }
        write_json(args.out, payload, indent=2)


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()  # without it the H200 runs hung at exit, results printed
