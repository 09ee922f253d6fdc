"""The `trace-rl` and `trace-sglang-patches` commands (`[project.scripts]`).

trace-rl train   [--config FILE] [key=value ...]   one RL run in the config's mode
trace-rl demo    [--config FILE] [--modes M,..] [key=value ...]   bf16 / qat / trace side by side (`make demo`)
trace-rl results run OUT [options]                 the measurements of docs/results.md (GPU)
trace-rl report  RUN_DIR [OUT]                     the table and plots of a train, demo or results run directory
trace-rl make-model [options]                      the tiny addition model of the embedded default
trace-rl inspect MODEL_DIR                         what an HF checkpoint imports as (refusals by name)
trace-rl export  RUN_DIR OUT                       the latest checkpoint's policy as an HF checkpoint directory
trace-rl config  [--config FILE] [key=value ...]   the resolved, validated configuration as TOML
trace-sglang-patches apply|check|export|regenerate the SGLang patch stack (scripts/sglang_patches.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

from trace_core.numerics.recipe import recipe_names
from trace_rl.config import ConfigError, RLConfig, load_config

FIELD_HELP = {
    "mode": "bf16 (BF16 rollout and trainer), qat (FP4 rollout + RTN QAT) or trace (FP4 rollout + guided QAT)",
    "recipe": f"precision recipe of the FP4 sites, rollout and trainer alike: one of {', '.join(recipe_names())} "
    "(docs/design.md, Precision recipes)",
    "model_dir": "the tiny model (a directory with megatron.pt) or an HF Qwen3-MoE checkpoint directory",
    "out_dir": "the run directory: metrics.jsonl, checkpoint.pt, records/, tensorboard/",
    "steps": "RL steps (fewer when `epochs` runs out first)",
    "prompts_per_step": "GRPO prompts per step",
    "group_size": "samples per prompt (GRPO normalizes rewards within a group)",
    "max_new_tokens": "response tokens at most",
    "temperature": "sampling temperature",
    "lr": "AdamW learning rate",
    "record_bits": "guidance spec: low code bits recorded per element (1..4)",
    "record_all_layers": "record every layer (the default; false: the latter half)",
    "measure_all_sites": "the rollout records 4 bits at every layer, for whole-code flip rates (analyses)",
    "max_version_diff": "oldest policy version a trained batch may come from, behind the trainer",
    "async_lag": "rollout batches generated ahead of the trainer",
    "rollout_workers": "rollout workers (one request each per step)",
    "use_ray": "rollout workers and the trainer as Ray actors",
    "max_restarts": "rollout worker restarts allowed per step",
    "checkpoint_every": "checkpoint period in steps",
    "keep_record_steps": "record-store steps kept on disk",
    "record_store": "the record store's directory (default <out_dir>/records): a fast local disk or a RAM disk",
    "seed": "seed of the prompt order and sampling",
    "device": "cpu or cuda",
    "rollout_backend": "embedded (EmbeddedEngine workers) or sglang (patched SGLang servers)",
    "sglang_urls": "comma-separated http://host:port of the SGLang servers",
    "fp4_attention": "off, or decode: the embedded engine's decode attention reads SGLang's FP4 KV pool (Triton "
    "kernel on CUDA, its torch twin on CPU) instead of SDPA over the dequantized cache; FP4 modes only",
    "sglang_timeout_s": "wall-clock seconds per SGLang HTTP call and per wait for records",
    "sglang_api_key": "where the servers' --api-key is: env:VARIABLE or file:PATH (never the key itself)",
    "sglang_admin_api_key": "where the servers' --admin-api-key is: env:VARIABLE or file:PATH",
    "rollout_call_timeout_s": "deadline of one rollout request (the worker is then restarted)",
    "rollout_step_timeout_s": "deadline of a whole rollout step (the run then fails)",
    "weight_sync_timeout_s": "deadline of one worker's weight sync (a late embedded worker is replaced, synced again); "
    "also of forming the distributed weight-update group",
    "sglang_start_timeout_s": "deadline of reaching every SGLang server at start (/model_info)",
    "sglang_launch": "off, local (the launcher starts the SGLang servers itself on this host) or ray (as Ray actors "
    "in a placement group)",
    "sglang_gpus": "GPU ids of each launched server, ';'-separated (e.g. 0,1;2,3: two servers at TP 2)",
    "sglang_args": "extra flags of every launched server (string or list)",
    "sglang_port_base": "port of the first launched server (server i: port_base + i)",
    "sglang_max_restarts": "restarts of each launched server over the run (a dead one is started again, its requests "
    "retried; past it the run stops with its log tail)",
    "sglang_tp": "sglang_launch=ray: GPUs (TP size) of each server's placement-group bundle",
    "sglang_cpus": "sglang_launch=ray: CPUs of each server's placement-group bundle",
    "colocate": "servers and trainer share the GPUs: --enable-memory-saver, memory released for each trainer step",
    "weight_sync": "how weights reach the SGLang servers: disk (HF checkpoint + /update_weights_from_disk), tensor "
    "(colocated: CUDA IPC buckets, /update_weights_from_tensor) or distributed (NCCL group, "
    "/update_weights_from_distributed)",
    "weight_sync_bucket_mb": "MiB per weight-sync bucket (tensor, distributed); a larger tensor is a bucket alone",
    "weight_sync_disk_fallback": "a failed tensor / distributed sync falls back to disk (counted) instead of failing",
    "weight_sync_backend": "backend of the distributed weight-update group: nccl, or gloo (CPU)",
    "weight_sync_master": "this host as the servers reach it for the weight-update group: host or host:port "
    "(default 127.0.0.1 and a free port; needed for remote servers)",
    "force_resume": "resume a checkpoint although settings that shape data, pairing, reward or numerics differ",
    "tp": "trainer tensor parallelism (with sequence parallelism); tp * pp * dp > 1 runs the trainer as a Ray group",
    "ep": "trainer expert parallelism (divides dp * tp)",
    "pp": "trainer pipeline parallelism (stages of whole layers)",
    "dp": "trainer data parallelism (divides the trajectories of a step)",
    "gpus_per_node": "GPUs per node for the trainer group with device = cuda (TP stays within a node)",
    "trainer_dtype": "trainer parameter dtype: bfloat16, or float32 (to check a layout against one rank)",
    "trainer_experts": "trainer routed experts: grouped (one grouped GEMM per linear) or sequential (SequentialMLP)",
    "expert_weights_in_place": "grouped expert weights fake-quantized in place under the FP32 masters (no copy)",
    "train_micro_batch": "trajectories per trainer micro-batch on each DP rank (gradient accumulation); 0 = one",
    "clip_ratio_low": "PPO clip below: the ratio is clipped at 1 - this (verl clip_ratio_low)",
    "clip_ratio_high": "PPO clip above: 1 + this; raise it for clip-higher (DAPO 0.28; verl clip_ratio_high)",
    "tis_cap": "truncated importance sampling cap of the train / rollout ratio (0: TIS off)",
    "loss_agg_mode": "token-mean, seq-mean-token-sum or seq-mean-token-mean (verl loss_agg_mode)",
    "policy_loss": "ppo (token ratios) or gspo (GSPO's sequence ratio; verl policy_loss.loss_mode)",
    "kl_coef": "KL penalty to the initial policy in the loss (0: off, no reference model kept; verl kl_loss_coef)",
    "kl_estimator": "k1, k2 or k3 (verl kl_loss_type kl / mse / low_var_kl)",
    "entropy_coef": "entropy bonus subtracted from the loss (verl entropy_coeff)",
    "grad_clip": "global gradient-norm clip (verl grad_clip, slime clip-grad)",
    "weight_decay": "AdamW weight decay",
    "lr_warmup_steps": "linear learning-rate warm-up over this many steps",
    "lr_schedule": "constant, linear or cosine decay after the warm-up (verl warmup_style / lr_scheduler_type)",
    "min_lr_ratio": "the decay ends at this fraction of lr",
    "top_p": "nucleus sampling: keep the smallest set of tokens with this mass (1.0: off)",
    "top_k": "sample among the k most likely tokens (-1: off)",
    "eval_before_train": "evaluate on eval_data before the first step (verl val_before_train)",
    "samples_every": "write samples to samples.jsonl and TensorBoard text every this many steps (0: never)",
    "samples_per_step": "trajectories written per logged step, spread over the groups",
    "data": "prompt dataset: addition (the synthetic task) or a .jsonl / .parquet file",
    "prompt_key": "dataset field of the prompt: a string (the user turn) or a list of {role, content} messages",
    "answer_key": "dataset field of the reference answer given to the reward ('' for none); dots reach nested fields",
    "metadata_keys": "comma-separated dataset fields passed to the reward function as metadata",
    "chat_template": "apply the tokenizer's chat template to prompts",
    "system_prompt": "a system turn put before each prompt (chat template only)",
    "max_prompt_len": "drop prompts longer than this many tokens (0: the model's max_seq - max_new_tokens)",
    "shuffle": "visit the prompts of each epoch in a seeded random order",
    "epochs": "passes over a file dataset at most (0: as many as `steps` needs)",
    "reward": "reward function: math, exact_match, module:function or file.py:function",
    "reward_workers": "reward pool size (0: score in the controller's thread)",
    "reward_pool": "thread or process (process: Math-Verify's timeouts apply)",
    "eval_data": "held-out prompt dataset (same fields as data) for pass@1 / mean@k",
    "eval_every": "evaluate every this many steps and at the end (0: never)",
    "eval_k": "samples per held-out prompt",
    "eval_prompts": "held-out prompts used (0: all; 64 for addition)",
    "loggers": "tensorboard, wandb, both comma-separated, or none",
    "wandb_project": "W&B project",
    "wandb_run": "W&B run name (default: W&B's)",
}


def config_epilog() -> str:
    rows = [f"  {f.name} = {f.default!r}\n      {FIELD_HELP[f.name]}" for f in dataclasses.fields(RLConfig)]
    return "config keys (a JSON / TOML file and key=value overrides; docs/rl.md):\n" + "\n".join(rows)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="JSON or TOML file of config keys (below)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied after the file")


def _checked_config(args: argparse.Namespace) -> RLConfig:
    """The config of `--config` and the overrides, with `trace_rl.preflight`'s checks passed (else a ConfigError
    of one line per problem)."""
    from trace_rl.preflight import preflight

    cfg = load_config(args.config, args.overrides)
    errors = preflight(cfg)
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def _train(args: argparse.Namespace) -> None:
    from trace_rl.controller import Controller

    cfg = _checked_config(args)
    with Controller(cfg) as ctrl:
        history = ctrl.run()
    if history:
        last = history[-1]
        keys = [k for k in ("reward/mean", "train_rollout_logprob_abs_diff", "train_rollout_k3_kl") if k in last]
        print(json.dumps({"step": last["step"]} | {k: last[k] for k in keys} | _eval(last), indent=1))


def _eval(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("eval/")}


def _demo(args: argparse.Namespace) -> None:
    from trace_rl.launch import main as launch

    argv = ([] if args.config is None else ["--config", args.config]) + (["--modes", args.modes] if args.modes else [])
    launch(argv + args.overrides)


def _config(args: argparse.Namespace) -> None:
    cfg = _checked_config(args)
    for key, value in dataclasses.asdict(cfg).items():
        print(f"{key} = {json.dumps(value)}")


def _inspect(args: argparse.Namespace) -> None:
    from megatron_trace.hf_import import HFCheckpoint

    ckpt = HFCheckpoint(args.model_dir)
    print(json.dumps(dataclasses.asdict(ckpt.dims), indent=1))
    print(f"{len(ckpt.files)} tensors in {len(set(ckpt.files.values()))} safetensors file(s)")


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """The policy of `run_dir`'s latest checkpoint (saved at any trainer layout; loaded on one rank) as an HF
    checkpoint directory `out`: BF16 `model.safetensors` (`megatron_trace.export.export_hf` of the trainer state)
    with the source checkpoint's config, generation config and tokenizer files. A live run is read from a snapshot
    of its newest intact checkpoint (`trace_rl.snapshot`): consistent, untouched by the run's retention."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from trace_rl.snapshot import snapshot_latest

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".snapshot-") as tmp:
        try:
            state, path = snapshot_latest(Path(run_dir), Path(tmp))
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        trainer, policy = _trainer_of(state, path)
    save_file(trainer.hf_weights(), out / "model.safetensors")
    for f in policy.hf_dir.iterdir():
        if f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model") and not f.name.startswith("model."):
            shutil.copy(f, out / f.name)
    print(f"{Path(run_dir) / path.name} (policy version {trainer.policy_version()}) -> {out}")
    return out


def _trainer_of(state: dict, path: Path):
    """A single-rank trainer holding the checkpoint `state` (file `path`, its trainer directory beside it) and the
    policy it was trained from."""
    import torch

    from trace_rl.controller import record_spec
    from trace_rl.policy import load_policy
    from trace_rl.trainer import MegatronTrainer

    cfg = RLConfig(**state["config"])
    policy = load_policy(cfg.model_dir)
    trainer = MegatronTrainer(
        policy.dims,
        policy.state,
        mode=cfg.mode,
        spec=record_spec(policy.dims.layers, cfg),
        lr=cfg.lr,
        max_version_diff=cfg.max_version_diff,
        dtype=getattr(torch, cfg.trainer_dtype),
        experts=cfg.trainer_experts,
        expert_weights_in_place=cfg.expert_weights_in_place,
    )
    trainer.load_sharded(str(path.parent / state["sharded"]["dir"]))  # saved at any layout
    return trainer, policy


def _make_model(args: argparse.Namespace) -> None:
    from trace_rl.warmup import make_tiny_model

    summary = make_tiny_model(
        args.out,
        digits=args.digits,
        steps=args.steps,
        seed=args.seed,
        preset=args.preset,
        batch=args.batch,
        lr=args.lr,
        target_accuracy=args.target_accuracy,
    )
    print(json.dumps(summary, indent=1))


def parser() -> argparse.ArgumentParser:
    from trace_rl.config import MODES
    from trace_rl.warmup import PRESETS

    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="trace-rl", description=__doc__, formatter_class=raw)
    sub = ap.add_subparsers(dest="command", required=True)

    train = "One RL run in the config's mode."
    p = sub.add_parser("train", help="one RL run", description=train, epilog=config_epilog(), formatter_class=raw)
    _config_args(p)
    p.set_defaults(run=_train)

    p = sub.add_parser(
        "demo",
        help="bf16 / qat / trace side by side (make demo)",
        description="The RL loop in each mode, then the side-by-side table, metrics.csv and plots under out_dir.",
        epilog=config_epilog(),
        formatter_class=raw,
    )
    _config_args(p)
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (default: all; sglang: the config's)")
    p.set_defaults(run=_demo)

    p = sub.add_parser("config", help="print the resolved configuration", epilog=config_epilog(), formatter_class=raw)
    _config_args(p)
    p.set_defaults(run=_config)

    p = sub.add_parser("inspect", help="what an HF checkpoint imports as")
    p.add_argument("model_dir", help="HF Qwen3-MoE checkpoint directory (config.json + safetensors)")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("export", help="the latest checkpoint's policy as an HF checkpoint directory")
    p.add_argument("run_dir", help="a run directory (out_dir of one mode) holding checkpoint-<step>.pt")
    p.add_argument("out", help="where model.safetensors, config.json and the tokenizer files go")
    p.set_defaults(run=lambda a: export_run(a.run_dir, a.out))

    p = sub.add_parser("make-model", help="build the tiny addition model (warm-up included)")
    p.add_argument("--out", default="out/tiny-model", help="output directory (default out/tiny-model)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default tiny)")
    p.add_argument("--digits", type=int, default=1, help="operand digits of the addition task (default 1)")
    p.add_argument("--steps", type=int, default=60, help="supervised warm-up steps (default 60)")
    p.add_argument("--batch", type=int, default=128, help="problems per warm-up step (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak warm-up learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--target-accuracy", type=float, default=None, help="stop once teacher-forced accuracy reaches it")
    p.set_defaults(run=_make_model)

    p = sub.add_parser("results", help="the measurements of docs/results.md (see `results run --help`)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(run=lambda a: _module_main("trace_rl.experiments.results", a.args))

    from trace_rl import run_report

    p = sub.add_parser(
        "report",
        help="the table and plots of a run directory (train, demo or results)",
        description=run_report.__doc__,
        formatter_class=raw,
    )
    p.add_argument("run_dir", help="a train or demo out_dir, or the raw/ directory of `trace-rl results run`")
    p.add_argument("out", nargs="?", help="where the table and plots go (default: RUN_DIR; results: RUN_DIR/../docs)")
    p.set_defaults(run=lambda a: [print(f"wrote {path}") for path in run_report.report(a.run_dir, a.out)])
    return ap


def _module_main(module: str, argv: list[str]) -> None:
    import importlib

    importlib.import_module(module).main(argv)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors a user's config, data or reward causes: `main` prints them as lines, without a traceback."""
    from trace_rl.controller import RewardError
    from trace_rl.data import DatasetError
    from trace_rl.run_report import ReportError

    return ConfigError, DatasetError, RewardError, ReportError


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except user_errors() as e:
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"trace-rl {args.command}: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def sglang_patches(argv: list[str] | None = None) -> int:
    """`trace-sglang-patches`: `scripts/sglang_patches.py` of the source checkout this package is installed from."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "sglang_patches.py"
    if not script.exists():
        raise SystemExit(f"trace-sglang-patches needs the TRACE source checkout (editable install): no {script}")
    spec = importlib.util.spec_from_file_location("trace_sglang_patches", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
