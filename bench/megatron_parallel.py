"""RL trainer steps of the `small` preset in `trace` mode under a parallel layout, against the single-GPU run.

    torchrun --nproc_per_node 1 bench/megatron_parallel.py --layout single --work W --out single.json
    torchrun --nproc_per_node 2 bench/megatron_parallel.py --layout tp=2 --work W --out tp2.json   # ep=2, pp=2, dp=2

The single run writes the shared inputs (initial BF16 weights, the emulated FP4 rollout's records and routes of
every micro-batch); every layout loads them into its shards. Each step is an RL update as the trainer does it:
a forward-only pass for `logp_old` (through the same schedule: it must leave no state behind), then GRPO with
token-level TIS (C = 5) over all micro-batches (per-token loss over the step and DP), Adam through Megatron's
distributed optimizer with FP32 masters, gradient clipping at 1. Per rank: loss and grad norm per step, median step
time, peak memory. `--repeat 2` runs the steps a second time with the micro-batches in reverse order: the same
math with the sums in another order, whose difference to the first run is the noise floor the layouts are judged
against (BF16 steps amplify any rounding difference once the first update differs); `--repeat N` alternates the two
orders N times (a run in the first order again measures one GPU's run-to-run nondeterminism alone). On a CPU
(gloo; a dry run of the script) the optimizer runs with `patches/megatron` applied.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import device_name, sync, write_json


def parse_layout(text: str):
    from megatron_trace.parallel import Layout

    if text == "single":
        return Layout()
    kw = {}
    for part in text.split(","):
        key, value = part.split("=")
        kw[key] = value if key == "dispatcher" else int(value)
    dp = kw.pop("dp", None)
    layout = Layout(**kw)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if dp is not None and layout.dp(world) != dp:
        raise ValueError(f"--layout {text}: {world} ranks give dp={layout.dp(world)}")
    return layout


def summary(out_dir: Path) -> str:
    """Markdown table of every layout's `*.rank*.json` under `out_dir` against `single`: largest relative loss and
    gradient-norm differences over the steps, median step time (slowest rank) and peak memory per rank."""
    runs: dict[str, list[dict]] = {}
    for f in sorted(out_dir.glob("*.rank*.json")):
        r = json.loads(f.read_text())
        runs.setdefault(r["layout"], []).append(r)
    ref = next(r for r in runs["single"] if r["loss"])
    lines = [
        "| layout | ranks | loss per step | max rel. loss diff vs 1 GPU | max rel. grad-norm diff | step s (median) "
        "| peak GiB per rank |",
        "|---|---|---|---|---|---|---|",
    ]

    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))

    for name, ranks in runs.items():
        run = next(r for r in ranks if r["loss"])
        mem = ", ".join(f"{r['peak_mem_gib']:.2f}" for r in sorted(ranks, key=lambda r: r["rank"]))
        step = max(r["step_s_median"] for r in ranks)
        losses = ", ".join(f"{x:.5f}" for x in run["loss"])
        loss_diff, norm_diff = rel(run["loss"], ref["loss"]), rel(run["grad_norm"], ref["grad_norm"])
        lines.append(f"| {name} | {len(ranks)} | {losses} | {loss_diff:.1e} | {norm_diff:.1e} | {step:.3f} | {mem} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="single", help="single, or tp=2 / ep=2 / pp=2 / dp=2 (comma-separated)")
    ap.add_argument("--work", help="directory of the shared inputs (written by the single run)")
    ap.add_argument("--out", help="result path prefix (one JSON per rank)")
    ap.add_argument("--summary", type=Path, help="print the table of the results under this directory and exit")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--preset", default="small", help="trace_rl.warmup preset (tiny for a CPU dry run)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="trajectories per micro-batch")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs in one process: the 2nd, 4th, ... with the micro-batches reversed, the 3rd, 5th, ... as the 1st "
        "(the noise floor: run to run and sum order)",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms (warn_only: ops without a deterministic kernel warn, named in the "
        "log): whether one GPU's run-to-run noise comes from nondeterministic kernels such as Megatron's MoE "
        "unpermute (scatter_add_ unless deterministic algorithms are on)",
    )
    args = ap.parse_args()
    if args.summary:
        print(summary(args.summary))
        return
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.use_deterministic_algorithms(True, warn_only=True)

    from megatron.core import parallel_state

    from megatron_trace.config import TraceConfig
    from megatron_trace.emulate import emulate_rollout
    from megatron_trace.loss import grpo_loss_terms, token_logprobs
    from megatron_trace.model import build_moe_model
    from megatron_trace.parallel import (
        MicroBatchInput,
        build_chunks,
        forward_backward,
        load_full_state,
        make_optimizer,
        step_optimizer,
        unwrap,
        wrap_ddp,
    )
    from megatron_trace.rows import pack_microbatch
    from megatron_trace.session import TraceSession
    from trace_core.records.spec import RecordSpec
    from trace_rl.warmup import PRESETS

    layout = parse_layout(args.layout)
    layout.init()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = PRESETS[args.preset]
    captured = tuple(range(cfg.layers // 2, cfg.layers))  # the latter half, as the RL runs' default spec
    spec = RecordSpec(bits=1, moe_layers=captured, attn_layers=captured)
    n_traj = args.micro_batches * args.batch
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(cfg.max_seq // 2, cfg.max_seq + 1, (n_traj,), generator=g).tolist()
    trajs = [(i, torch.randint(1, cfg.vocab, (n,), generator=g)) for i, n in enumerate(lengths)]
    mbs = [
        pack_microbatch(trajs[i : i + args.batch], seq_len=cfg.max_seq).to(device) for i in range(0, n_traj, args.batch)
    ]
    adv = (torch.rand(n_traj, generator=g) * 2 - 1).to(device)
    work = Path(args.work)
    if world == 1 and not (work / "inputs.pt").exists():
        work.mkdir(parents=True, exist_ok=True)
        model = build_moe_model(cfg, dtype=torch.bfloat16, **layout.config_overrides())
        full = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        source = emulate_rollout(model, mbs, spec, num_trajectories=n_traj, max_positions=cfg.max_seq)
        torch.save({"full": full, "source": source}, work / "inputs.pt")
        del model
    inputs = torch.load(work / "inputs.pt", map_location=device, weights_only=False)

    def run(reverse: bool) -> dict:
        """The steps from the loaded inputs; `reverse` runs the micro-batches in reverse order (the same math with
        the gradient sums in another order: a noise floor for the layouts)."""
        chunks = build_chunks(
            lambda v: build_moe_model(cfg, dtype=torch.bfloat16, vp_stage=v, **layout.config_overrides()), layout
        )
        for c in chunks:
            load_full_state(c, inputs["full"])
            TraceSession(c, TraceConfig(mode="trace", spec=spec, measure=False))
        chunks = wrap_ddp(chunks)
        optimizer = make_optimizer(chunks, lr=args.lr, clip_grad=1.0)
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        per = len(mbs) // dp
        mine = list(range(dp_rank * per, (dp_rank + 1) * per))
        tp_group = parallel_state.get_tensor_model_parallel_group() if layout.tp > 1 else None
        logp_old: dict[int, torch.Tensor] = {}

        def old_terms(logits, item):
            ids = item.mb.input_ids
            logp_old[item.extra["index"]] = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group).detach()
            return logits.new_zeros(()), torch.zeros((), dtype=torch.int, device=device), {}

        def loss_terms(logits, item):
            i, ids, mb = item.extra["index"], item.mb.input_ids, item.mb
            logp = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group)
            rollout = logp_old[i] - 0.02 * torch.sin(logp_old[i] * 7.0)  # a deterministic rollout/trainer mismatch
            a = adv[i * args.batch : (i + 1) * args.batch]
            total, n, _ = grpo_loss_terms(logp, logp_old[i], rollout, a, mb.valid[:, 1:], tis_cap=5.0)
            return total, n, {"sum": total.detach(), "tokens": n}

        items = [MicroBatchInput(mbs[i], inputs["source"], {"index": i}) for i in mine]
        if reverse:
            items.reverse()
        losses, norms, times = [], [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            with torch.no_grad():
                forward_backward(chunks, items, old_terms, forward_only=True)
            for c in chunks:
                c.zero_grad_buffer()
            reports = forward_backward(chunks, items, loss_terms)
            grad_norm = step_optimizer(optimizer)  # the trainers' step: refused on a non-finite norm
            for c in chunks:
                unwrap(c)._trace_session.end_step()
            sync()
            times.append(time.perf_counter() - start)
            norms.append(grad_norm)
            if reports:
                sums = torch.stack([torch.stack([r["sum"].float(), r["tokens"].float()]) for r in reports]).sum(0)
                torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
                losses.append(float(sums[0] / sums[1]))
        return {
            "layout": args.layout + (" reversed" if reverse else ""),
            "rank": rank,
            "world": world,
            "device": device_name(),
            "deterministic": args.deterministic,
            "loss": losses,
            "grad_norm": norms,
            "step_s_median": statistics.median(times[1:] if len(times) > 1 else times),
            "step_s": times,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        }

    for r in range(args.repeat):
        out = run(reverse=r % 2 == 1)
        if r > 1:
            out["layout"] = f"{args.layout} repeat {r}" + (" reversed" if r % 2 else "")
        print(json.dumps(out), flush=True)
        suffix = "" if r == 0 else "_reversed" if r == 1 else f"_repeat{r}"
        write_json(f"{args.out}{suffix}.rank{rank}.json", out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
