"""Typed RL configuration: defaults, a JSON, TOML or YAML file, then `key=value` command-line overrides, validated."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from trace_core.modes import MODES
from trace_core.numerics.recipe import DEFAULT_RECIPE, recipe_names
from trace_core.records.spec import CapturePolicy, check_bits
from trace_rl.algorithm import algorithm_errors
from trace_rl.server_command import launch_errors
from trace_rl.weight_sync import weight_sync_errors

ROLLOUT_BACKENDS = ("embedded", "sglang")
FP4_ATTENTION = ("off", "decode")
SECRET_REFS = ("env:", "file:")
CONFIG_SUFFIXES = (".json", ".toml", ".yaml", ".yml")
MIN_TEMPERATURE = 1e-3  # below it, logits / temperature leave the range of BF16 / FP32 sampling
MAX_TRAJECTORIES = 2**16  # prompts_per_step * group_size: the rollout engine allocates a step's batch up front
TRAINER_EXPERTS = ("grouped", "sequential")
LIST_KEYS = ("sglang_urls", "metadata_keys", "loggers")  # comma-separated strings; a TOML / YAML list is joined


def trainer_experts_errors(experts: str, in_place: bool) -> list[str]:
    """What is wrong with the trainer's expert settings `trainer_experts` / `expert_weights_in_place`: an unknown
    kind, grouped experts where torch has no `torch.nn.functional.grouped_mm`, in-place weights without them."""
    if experts not in TRAINER_EXPERTS:
        return [f"trainer_experts={experts!r} is not one of {TRAINER_EXPERTS}"]
    errors = []
    if experts == "grouped" and not hasattr(torch.nn.functional, "grouped_mm"):
        errors.append(
            f"trainer_experts='grouped' needs torch.nn.functional.grouped_mm, which torch {torch.__version__} lacks: "
            "set trainer_experts=sequential and expert_weights_in_place=false"
        )
    if in_place and experts != "grouped":
        errors.append("expert_weights_in_place=true needs trainer_experts='grouped' (set it false for sequential)")
    return errors


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def check_trainer_experts(experts: str, in_place: bool) -> None:
    """ConfigError for the errors of `trainer_experts_errors` (the trainers' own check of their arguments)."""
    errors = trainer_experts_errors(experts, in_place)
    if errors:
        raise ConfigError("invalid trainer experts: " + "; ".join(errors))


@dataclass(frozen=True)
class RLConfig:
    """One RL run on the embedded engine.

    mode: bf16 (BF16 rollout + BF16 trainer), qat (FP4 rollout + RTN QAT) or trace (FP4 rollout + guided QAT).
    recipe: the precision recipe of every FP4 site on both sides (`trace_core.numerics.recipe`; docs/design.md).
    prompts_per_step x group_size trajectories per step; GRPO normalizes rewards within each group.
    async_lag: rollout batches generated ahead of the trainer (0 = synchronous); each trained batch is at most
    `max_version_diff` policy versions old, enforced by the trainer. With async_lag > 0 the train / rollout
    log-prob metrics include the policy change since the rollout, not only the engine mismatch.
    record_bits / record_all_layers: the guidance spec: b code bits at every layer (the default, docs/results.md), or
    on the latter half of the layers (false: the paper's default, half the record bytes).
    measure_all_sites: the rollout records all 4 code bits at every layer, so per-site code-flip rates compare
    whole codes everywhere (the analyses of docs/results.md); the trainer still guides with the spec above.
    rollout_backend: embedded (`EmbeddedEngine` workers, in-process or Ray actors) or sglang (running patched SGLang
    servers at the comma-separated `sglang_urls`, one rollout worker each; docs/deploy.md); with sglang, `use_ray`
    moves only the trainer into a Ray actor; in bf16 mode the servers run `--trace-mode off` and return each
    trajectory's routes (`--enable-return-routed-experts`), which the worker stores for R3. fp4_attention: `decode`
    makes the embedded engine's decode attention read SGLang's FP4 paged KV pool
    (`trace_rl.rollout.fp4_kv_engine.FP4AttentionEngine`: the Triton kernel on CUDA, its pure-torch twin on CPU)
    instead of SDPA over the dequantized cache; `off` (default) keeps SDPA. It needs an FP4 mode and the embedded
    backend (an SGLang server selects it with TRACE_FP4_ATTENTION); every recipe's K/V fit
    the pool (kv_fp4, or NVFP4 under its static unit scale).
    sglang_api_key / sglang_admin_api_key: where the servers' --api-key / --admin-api-key are, `env:VARIABLE` or
    `file:PATH` (a key itself is refused: configs land in checkpoints).
    rollout_call_timeout_s / rollout_step_timeout_s: deadline of one rollout request (the worker is then restarted)
    and of a whole rollout step (the run then fails). weight_sync_timeout_s: deadline of one worker's weight sync (an
    embedded worker that misses it is replaced and synced again; an SGLang server that misses it fails the run,
    naming it), also of forming the distributed weight-update group. sglang_start_timeout_s: deadline of reaching
    every SGLang server at start.
    sglang_launch = "local": the launcher starts the servers itself on this host (`trace_rl.servers.ServerGroup`),
    one per `;`-separated entry of `sglang_gpus` (its GPU ids, TP = their number), on ports `sglang_port_base + i`,
    with the extra flags `sglang_args`; it then sets `sglang_urls` to them and tears them down at the end.
    sglang_launch = "ray": the same servers as Ray actors (`trace_rl.ray_servers.RayServerGroup`), `rollout_workers`
    of them, each in a placement-group bundle of `sglang_tp` GPUs and `sglang_cpus` CPUs. sglang_max_restarts:
    restarts of each launched server over the run (a server that dies is started again and its requests retried as
    new attempts; past the bound the run stops with its log tail). colocate: servers and trainer share the GPUs: the
    servers run with --enable-memory-saver and the loop releases their memory before each trainer step and resumes
    it (weights, the weight sync, then KV cache and CUDA graphs) after (`trace_rl.rollout.colocate`).
    weight_sync: how the trainer's weights reach the SGLang servers after each step (`trace_rl.weight_sync`): `disk`
    (an HF checkpoint under out_dir and /update_weights_from_disk), `tensor` (colocated: buckets of at most
    `weight_sync_bucket_mb` MiB of CUDA IPC handles through /update_weights_from_tensor) or `distributed`
    (disaggregated: broadcasts over a `weight_sync_backend` group, nccl or gloo, formed at start-up with every
    server, rendezvous at `weight_sync_master` = this host as the servers reach it, host[:port], default
    127.0.0.1 for local servers). weight_sync_disk_fallback: a failed tensor / distributed sync falls back to disk
    (counted, `weight_sync/disk_fallbacks`) instead of failing the run.
    sglang_timeout_s: wall-clock deadline of one SGLang HTTP call and of one wait for a request's records.
    force_resume: resume a checkpoint although settings that shape the data, pairing, reward or numerics differ
    (`trace_rl.controller.RESUME_FREE` lists the keys a resume may change; docs/reliability.md).
    tp / ep / pp / dp: the trainer's parallel layout (tensor with sequence parallelism, expert, pipeline, data
    parallel; tp * pp * dp ranks, EP carved out of dp * tp); more than one rank runs the trainer as a Ray group, one
    GPU per rank with device = "cuda" (at most gpus_per_node per node, TP within a node), gloo ranks on a CPU.
    trainer_dtype: the trainer's parameter dtype (bfloat16, or float32 to check a layout against one rank).
    trainer_experts: the trainer's routed experts, `grouped` (the TRACE grouped experts on torch's grouped_mm,
    `megatron_trace.grouped`) or `sequential` (Megatron's SequentialMLP, a loop over the experts); the same numerics
    forward, another rounding of two input gradients (docs/performance.md). expert_weights_in_place: the grouped
    expert weights hold their fake-quantized values after every master write instead of a fake-quantized copy per
    step (same results bit for bit, no copy; export, checkpoints and evaluation read the FP32 masters).
    train_micro_batch: trajectories per trainer micro-batch on each DP rank (gradient accumulation through Megatron's
    schedule; also with one rank); 0 = all of a rank's trajectories in one micro-batch.
    record_store: the record store's directory, where the rollout's records land and the trainer reads them
    (default `<out_dir>/records`): a fast local disk or a RAM disk such as /dev/shm takes the records' volume off
    the run directory's storage (they are read once and kept `keep_record_steps` steps; a resume needs the pending
    steps' records, so a RAM disk does not survive a reboot of the host). With SGLang servers on other hosts, a path
    they share. One run per directory: a start refuses a store that another run directory owns.
    data / eval_data and the fields after them: the prompt dataset (`addition` or a JSONL / Parquet file,
    `trace_rl.data`), the reward function (`trace_rl.rewards`), held-out evaluation and the loggers
    (`trace_rl.tracking`); docs/rl.md, "Bring your own model and data".
    """

    mode: str = "trace"
    recipe: str = DEFAULT_RECIPE
    model_dir: str = "out/tiny-model"
    out_dir: str = "out/rl"
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 6
    temperature: float = 1.0
    lr: float = 3e-4
    record_bits: int = 1
    record_all_layers: bool = True
    measure_all_sites: bool = False
    max_version_diff: int = 3
    async_lag: int = 0
    rollout_workers: int = 2
    use_ray: bool = False
    max_restarts: int = 3
    checkpoint_every: int = 5
    keep_record_steps: int = 4
    record_store: str = ""
    seed: int = 0
    device: str = "cpu"
    rollout_backend: str = "embedded"
    sglang_urls: str = ""
    sglang_timeout_s: float = 600.0
    fp4_attention: str = "off"
    data: str = "addition"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    metadata_keys: str = ""
    chat_template: bool = True
    system_prompt: str = ""
    max_prompt_len: int = 0
    shuffle: bool = True
    epochs: int = 0
    reward: str = "exact_match"
    reward_workers: int = 4
    reward_pool: str = "thread"
    eval_data: str = ""
    eval_every: int = 0
    eval_k: int = 4
    eval_prompts: int = 0
    loggers: str = "tensorboard"
    wandb_project: str = "trace"
    wandb_run: str = ""
    sglang_api_key: str = ""
    sglang_admin_api_key: str = ""
    rollout_call_timeout_s: float = 600.0
    rollout_step_timeout_s: float = 3600.0
    weight_sync_timeout_s: float = 600.0
    sglang_start_timeout_s: float = 600.0
    sglang_launch: str = "off"
    sglang_gpus: str = ""
    sglang_args: str = ""
    sglang_port_base: int = 30000
    sglang_max_restarts: int = 2
    sglang_tp: int = 1
    sglang_cpus: int = 1
    colocate: bool = False
    weight_sync: str = "disk"
    weight_sync_bucket_mb: float = 512.0
    weight_sync_disk_fallback: bool = False
    weight_sync_backend: str = "nccl"
    weight_sync_master: str = ""
    force_resume: bool = False
    tp: int = 1
    ep: int = 1
    pp: int = 1
    dp: int = 1
    gpus_per_node: int = 8
    trainer_dtype: str = "bfloat16"
    trainer_experts: str = "grouped"
    expert_weights_in_place: bool = True
    train_micro_batch: int = 0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    tis_cap: float = 5.0
    loss_agg_mode: str = "token-mean"
    policy_loss: str = "ppo"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    eval_before_train: bool = False
    samples_every: int = 1
    samples_per_step: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.sglang_launch, bool):  # `sglang_launch = true` in code, as in a config file
            object.__setattr__(self, "sglang_launch", "local" if self.sglang_launch else "off")
        errors = [f"{k}={v!r} must be finite" for k, v in self._floats().items() if not math.isfinite(v)]
        if self.mode not in MODES:
            errors.append(f"mode={self.mode!r} is not one of {MODES}")
        if self.recipe not in recipe_names():
            errors.append(f"recipe={self.recipe!r} is not one of {recipe_names()}")
        positive = ("steps", "prompts_per_step", "max_new_tokens", "rollout_workers", "checkpoint_every")
        errors += [f"{k}={getattr(self, k)} must be >= 1" for k in positive if getattr(self, k) < 1]
        if self.group_size < 2:
            errors.append(f"group_size={self.group_size} must be >= 2 (GRPO normalizes within a group)")
        try:
            check_bits(self.record_bits)
        except ValueError as e:
            errors.append(f"record_bits={self.record_bits}: {e}")
        if self.lr <= 0:
            errors.append(f"lr={self.lr} must be > 0 (AdamW's peak learning rate; 1e-6 is usual for a real model)")
        if self.temperature <= 0:
            errors.append(f"temperature={self.temperature} must be > 0 (1.0 samples the policy as it is)")
        elif self.temperature < MIN_TEMPERATURE:
            errors.append(
                f"temperature={self.temperature} must be >= {MIN_TEMPERATURE} (logits divided by a smaller one "
                "overflow to inf and the samples turn NaN)"
            )
        if not 0 <= self.seed < 2**32:
            errors.append(
                f"seed={self.seed} must be in [0, 2**32): rollout seeds (seed * 1000003 + step) * 64 + worker must fit "
                "a 64-bit generator seed"
            )
        if self.prompts_per_step * self.group_size > MAX_TRAJECTORIES:
            errors.append(
                f"prompts_per_step * group_size = {self.prompts_per_step * self.group_size} trajectories a step exceed "
                f"{MAX_TRAJECTORIES} (the rollout engine allocates a step's batch up front)"
            )
        if self.max_version_diff < 0 or self.async_lag < 0 or self.max_restarts < 0:
            errors.append("max_version_diff, async_lag and max_restarts must be >= 0")
        if self.async_lag > self.max_version_diff:
            errors.append(f"async_lag={self.async_lag} exceeds max_version_diff={self.max_version_diff}")
        if self.keep_record_steps < self.async_lag + 1:
            errors.append(f"keep_record_steps={self.keep_record_steps} must hold the async_lag + 1 pending steps")
        if self.rollout_call_timeout_s <= 0 or self.rollout_step_timeout_s < self.rollout_call_timeout_s:
            errors.append(
                f"rollout_call_timeout_s={self.rollout_call_timeout_s} must be > 0 and at most "
                f"rollout_step_timeout_s={self.rollout_step_timeout_s}"
            )
        for key in ("weight_sync_timeout_s", "sglang_start_timeout_s"):
            if getattr(self, key) <= 0:
                errors.append(f"{key}={getattr(self, key)} must be > 0")
        if self.device not in ("cpu", "cuda"):
            errors.append(f"device={self.device!r} must be cpu or cuda")
        errors += self._secret_errors()
        errors += self._sglang_errors()
        errors += launch_errors(self)
        errors += weight_sync_errors(self)
        errors += self._fp4_attention_errors()
        errors += self._layout_errors()
        errors += self._data_errors()
        errors += algorithm_errors(self)
        if errors:
            raise ConfigError("invalid RL config: " + "; ".join(errors))

    def _floats(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(f.default, float)}

    def record_store_dir(self) -> Path:
        """The record store's absolute directory: `record_store`, or `<out_dir>/records`."""
        return Path(self.record_store or Path(self.out_dir) / "records").resolve()

    def sglang_url_list(self) -> list[str]:
        return [u.strip() for u in self.sglang_urls.split(",") if u.strip()]

    def capture_policy(self) -> CapturePolicy:
        """The trainer's guidance policy: `record_bits` at every layer, or the latter half (`record_all_layers`
        false); the servers' `--trace-record-bits` / `--trace-layers` parse into the same `CapturePolicy`."""
        return CapturePolicy(self.record_bits, "all" if self.record_all_layers else "latter-half")

    def _sglang_errors(self) -> list[str]:
        if self.rollout_backend not in ROLLOUT_BACKENDS:
            return [f"rollout_backend={self.rollout_backend!r} is not one of {ROLLOUT_BACKENDS}"]
        urls = self.sglang_url_list()
        if self.rollout_backend == "embedded":
            return [f"sglang_urls={self.sglang_urls!r} needs rollout_backend='sglang'"] if urls else []
        errors = []
        if not urls and self.sglang_launch == "off":  # a launched group's URLs are set by the launcher
            errors.append("rollout_backend='sglang' needs sglang_urls (comma-separated http://host:port)")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            errors.append(f"sglang_urls {bad} must start with http:// or https://")
        if len(set(urls)) != len(urls):
            errors.append(f"sglang_urls {urls} name a server twice")
        if urls and self.rollout_workers != len(urls):
            errors.append(f"rollout_workers={self.rollout_workers} must equal the {len(urls)} sglang_urls")
        if self.mode == "bf16" and self.measure_all_sites:
            errors.append(
                "measure_all_sites=true needs an FP4 mode with rollout_backend='sglang' (mode='bf16': the "
                "server runs --trace-mode off and records no sites, only the routes it returns)"
            )
        if self.sglang_timeout_s <= 0:
            errors.append(f"sglang_timeout_s={self.sglang_timeout_s} must be > 0")
        return errors

    def _secret_errors(self) -> list[str]:
        """A literal key is refused on every backend: configs are written to checkpoints, metrics and logs."""
        return [
            f"{key} must name where the key is ('env:VARIABLE' or 'file:PATH'), never the key itself "
            "(configs are written to checkpoints and logs)"
            for key in ("sglang_api_key", "sglang_admin_api_key")
            if getattr(self, key) and not getattr(self, key).startswith(SECRET_REFS)
        ]

    def _fp4_attention_errors(self) -> list[str]:
        if self.fp4_attention not in FP4_ATTENTION:
            hint = (
                " (the embedded engine prefills every prompt from position 0: there is no cached prefix for an "
                "extend kernel to read)"
                if "extend" in self.fp4_attention
                else ""
            )
            return [f"fp4_attention={self.fp4_attention!r} is not one of {FP4_ATTENTION}{hint}"]
        if self.fp4_attention == "off":
            return []
        errors = []
        if self.rollout_backend != "embedded":
            errors.append(
                f"fp4_attention={self.fp4_attention!r} needs rollout_backend='embedded'; an SGLang server selects its "
                "FP4-KV attention itself (TRACE_FP4_ATTENTION=decode in the server's environment, docs/sglang.md)"
            )
        if self.mode == "bf16":
            errors.append(
                f"fp4_attention={self.fp4_attention!r} needs an FP4 rollout (mode qat or trace): mode='bf16' is the "
                "BF16 baseline, whose KV cache is not FP4"
            )
        return errors

    def trainer_world(self) -> int:
        """Trainer ranks of the layout."""
        return self.tp * self.pp * self.dp

    def parallel_trainer(self) -> bool:
        """Whether the trainer runs as a group of `trace_rl.parallel_trainer.RankTrainer`s (a layout of several
        ranks, or micro-batches): else the single-rank `MegatronTrainer`."""
        return self.trainer_world() > 1 or self.train_micro_batch > 0

    def _layout_errors(self) -> list[str]:
        sizes = {k: getattr(self, k) for k in ("tp", "ep", "pp", "dp", "gpus_per_node")}
        errors = [f"{k}={v} must be >= 1" for k, v in sizes.items() if v < 1]
        if errors:
            return errors
        if (self.dp * self.tp) % self.ep:
            errors.append(f"ep={self.ep} must divide dp * tp = {self.dp * self.tp} (EP is carved out of DP x TP)")
        if (self.prompts_per_step * self.group_size) % self.dp:
            errors.append(
                f"dp={self.dp} must divide the {self.prompts_per_step * self.group_size} trajectories of a step "
                "(prompts_per_step x group_size)"
            )
        world = self.trainer_world()
        if self.device == "cuda" and world > 1:
            if self.tp > self.gpus_per_node:
                errors.append(f"tp={self.tp} exceeds gpus_per_node={self.gpus_per_node} (TP stays within a node)")
            if world > self.gpus_per_node and world % self.gpus_per_node:
                errors.append(f"tp * pp * dp = {world} GPUs do not fill nodes of gpus_per_node={self.gpus_per_node}")
        per_rank = self.prompts_per_step * self.group_size // self.dp
        if self.train_micro_batch < 0 or (self.train_micro_batch and per_rank % self.train_micro_batch):
            errors.append(
                f"train_micro_batch={self.train_micro_batch} must be 0 or divide the {per_rank} trajectories of a "
                "DP rank"
            )
        if self.trainer_dtype not in ("bfloat16", "float32"):
            errors.append(f"trainer_dtype={self.trainer_dtype!r} must be bfloat16 or float32")
        errors += trainer_experts_errors(self.trainer_experts, self.expert_weights_in_place)
        return errors

    def logger_list(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.loggers.split(",") if x.strip() and x.strip() != "none")

    def metadata_key_list(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.metadata_keys.split(",") if x.strip())

    def _data_errors(self) -> list[str]:
        errors = []
        if self.data != "addition" and not self.data.endswith((".jsonl", ".parquet")):
            errors.append(f"data={self.data!r} must be 'addition' or a .jsonl / .parquet file")
        if self.eval_data and self.eval_data != "addition" and not self.eval_data.endswith((".jsonl", ".parquet")):
            errors.append(f"eval_data={self.eval_data!r} must be 'addition' or a .jsonl / .parquet file")
        negative = [
            k
            for k in ("max_prompt_len", "epochs", "reward_workers", "eval_every", "eval_prompts")
            if getattr(self, k) < 0
        ]
        errors += [f"{k}={getattr(self, k)} must be >= 0" for k in negative]
        if self.eval_k < 1:
            errors.append(f"eval_k={self.eval_k} must be >= 1")
        if self.reward_pool not in ("thread", "process"):
            errors.append(f"reward_pool={self.reward_pool!r} must be thread or process")
        if bool(self.eval_every) != bool(self.eval_data):
            errors.append(f"eval_every={self.eval_every} and eval_data={self.eval_data!r} go together")
        if self.eval_every and self.rollout_backend != "embedded":
            errors.append("eval_every needs rollout_backend='embedded' (SGLang servers would record the evaluation)")
        bad = [x for x in self.logger_list() if x not in ("tensorboard", "wandb")]
        if bad:
            errors.append(f"loggers {bad}: use tensorboard, wandb, both (comma-separated) or none")
        return errors

    def replace(self, **changes: Any) -> RLConfig:
        return dataclasses.replace(self, **changes)


def _coerce(name: str, value: Any, kind: type) -> Any:
    if name == "sglang_launch" and (isinstance(value, bool) or str(value).lower() in ("true", "false", "on", "1", "0")):
        return "local" if value is True or str(value).lower() in ("true", "on", "1") else "off"
    if name in ("sglang_args", "sglang_gpus") and isinstance(value, list | tuple):
        if not all(isinstance(x, str | int) and not isinstance(x, bool) for x in value):
            raise ConfigError(f"{name}={value!r} must be a list of strings (or one string)")
        return shlex.join(map(str, value)) if name == "sglang_args" else ";".join(map(str, value))
    if name in LIST_KEYS and isinstance(value, list | tuple):
        if not all(isinstance(x, str) for x in value):
            raise ConfigError(f"{name}={value!r} must be a list of strings (or one comma-separated string)")
        return ",".join(value)
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"{name}={value!r} is not a boolean")
            return value.lower() in ("true", "1")
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not a {kind.__name__}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{name}={value!r} must be a {kind.__name__}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The key/value table of a `.json`, `.toml` or `.yaml` / `.yml` config file; a syntax error names the file and
    line, any other suffix is refused."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ConfigError(f"config file {path}: unknown suffix {path.suffix!r}; use one of {CONFIG_SUFFIXES}")
    text = path.read_text()
    try:
        if suffix == ".json":
            values = json.loads(text)
        elif suffix == ".toml":
            values = tomllib.loads(text)
        else:
            values = yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: JSON syntax error: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None  # the message ends "(at line L, column C)"
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {getattr(e, 'problem', None) or e}") from None
    if values is None and suffix in (".yaml", ".yml"):
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a table of key = value, got a {type(values).__name__}")
    return values


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RLConfig:
    """Defaults, then the file (`.json`, `.toml`, `.yaml`), then `key=value` overrides."""
    values: dict[str, Any] = {} if path is None else read_config_file(path)
    from_file = set(values)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must be key=value")
        values[key.strip()] = value.strip()
    types = {f.name: type(f.default) for f in dataclasses.fields(RLConfig)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        hints = [
            f"{k!r} ({'in ' + str(path) if k in from_file else 'an override'}"
            + (f"; did you mean {close[0]!r}?)" if close else ")")
            for k in unknown
            for close in [difflib.get_close_matches(k, types, n=1)]
        ]
        raise ConfigError(f"unknown config key {', '.join(hints)}; `trace-rl train --help` lists every key")
    return RLConfig(**{k: _coerce(k, v, types[k]) for k, v in values.items()})
