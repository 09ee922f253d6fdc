"""TRACE server arguments for SGLang (`--trace-*`), their validation, and the record spec they select for a model.

The patched `sglang.srt.server_args.ServerArgs` gains the fields in `SERVER_ARGS_FIELDS`, registers the flags
through `add_cli_args`, and calls `check_server_args` at the start of `__post_init__` and again after
`materialize_declarations` (SGLang's per-model and per-GPU defaults applied), so a bad setting fails when the
server starts, naming the flag. What needs the model (architecture, layer ids, widths) is checked by
`model_spec` when the model is loaded.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace

from trace_core.modes import ROLLOUT_MODES
from trace_core.numerics.formats import KV_FP4, NVFP4
from trace_core.numerics.recipe import DEFAULT_RECIPE, PrecisionRecipe, Role, Scale, get_recipe, recipe_names
from trace_core.records.spec import LAYER_PRESETS, CapturePolicy, RecordSpec, check_bits
from trace_core.sites import SITE_KINDS

logger = logging.getLogger(__name__)

MODES = ROLLOUT_MODES

# Field name -> default, added to ServerArgs by the patch (SGLang keeps every flag as a dataclass field).
SERVER_ARGS_FIELDS: dict[str, object] = {
    "trace_mode": "off",
    "trace_record_bits": 1,
    "trace_layers": "all",
    "trace_sites": "moe_in,k,v",
    "trace_store": None,
    "trace_step": 0,
    "trace_recipe": DEFAULT_RECIPE,
    "trace_debug_layer": -1,
    "trace_host_ring_gb": None,
}

# Weight-load formats whose loaders write routed experts through FusedMoE.weight_loader (where emulate
# quantizes them); every other format is refused by name.
HOOKED_LOAD_FORMATS = ("auto", "pt", "safetensors", "npcache", "dummy")
# MoE runner backends whose expert path carries the FC2-input hook (emulate); "auto" is checked again on
# every FusedMoE layer once the model is built (SGLang resolves it per model and GPU).
HOOKED_MOE_RUNNERS = ("auto", "triton")

# Architectures whose MoE block is one FusedMoE per layer fed by the standard dispatcher.
DENSE_ATTENTION_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# Hybrid linear-attention models: k/v sites on the full-attention layers only (their FP4 KV pool is patch 0010).
HYBRID_ARCHS = ("Qwen3NextForCausalLM",)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Register the `--trace-*` flags on SGLang's argument parser."""
    group = parser.add_argument_group("TRACE rollout records")
    group.add_argument(
        "--trace-mode",
        choices=MODES,
        default=SERVER_ARGS_FIELDS["trace_mode"],
        help="Record FP4 rounding outcomes for guided-rounding training. emulate: the --trace-recipe's routed "
        "experts emulated by quantize-dequantize (Hopper, CPU); native: reproduce the codes of a real NVFP4 MoE "
        "kernel (Blackwell, nvfp4 recipe only, not validated here); off: SGLang unchanged.",
    )
    group.add_argument(
        "--trace-record-bits",
        type=int,
        default=SERVER_ARGS_FIELDS["trace_record_bits"],
        help="Low code bits kept per element (1..4; 4 = the full code).",
    )
    group.add_argument(
        "--trace-layers",
        type=str,
        default=SERVER_ARGS_FIELDS["trace_layers"],
        help="Layers whose sites are recorded: 'latter-half' (of the MoE and of the attention layers), 'all', or "
        "layer ids and ranges such as '24-47' or '30,32,40-47'.",
    )
    group.add_argument(
        "--trace-sites",
        type=str,
        default=SERVER_ARGS_FIELDS["trace_sites"],
        help="Comma-separated site kinds to record: moe_in (routed-expert input), k, v (k and v need "
        "--kv-cache-dtype fp4_e2m1); or none: the --trace-recipe's FP4 numerics without records (a QAT-only "
        "rollout: no record store, no --trace-store; with --enable-return-routed-experts only the routes are kept, "
        "for R3's answer).",
    )
    group.add_argument(
        "--trace-store",
        type=str,
        default=SERVER_ARGS_FIELDS["trace_store"],
        help="Record store root directory (shared with the trainer); required unless --trace-mode off or "
        "--trace-sites none.",
    )
    group.add_argument(
        "--trace-step",
        type=int,
        default=SERVER_ARGS_FIELDS["trace_step"],
        help="RL step the first records are written under; afterwards every weight update must carry "
        "weight_version=<RL step> (after an update without one, records are refused until a versioned update).",
    )
    group.add_argument(
        "--trace-recipe",
        default=SERVER_ARGS_FIELDS["trace_recipe"],
        help="Precision recipe of the rollout's FP4 numerics (trace_core.numerics.recipe): one of "
        f"{', '.join(recipe_names())}.",
    )
    group.add_argument(
        "--trace-host-ring-gb",
        type=float,
        default=SERVER_ARGS_FIELDS["trace_host_ring_gb"],
        help="Pinned host ring of the finish path on each rank, in GiB: the records of requests finishing in one "
        "result batch wait there for the store writer, and the scheduler waits while it is full. Default: "
        "8 GiB, at least two requests of the context length, at most the KV pool's tokens.",
    )
    group.add_argument(
        "--trace-debug-layer",
        type=int,
        default=SERVER_ARGS_FIELDS["trace_debug_layer"],
        help="Debug (small models only): also keep the tensors the expert GEMMs and the attention consumed at this "
        "layer (MoE input, FC2 input, K/V pool bytes) and write them per request under <store>/debug; -1: off.",
    )


def parse_layers(text: str) -> str | tuple[int, ...]:
    """A `--trace-layers` value as a preset name or sorted distinct layer ids; ValueError naming the flag."""
    text = text.strip()
    if text in LAYER_PRESETS:
        return text
    ids: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(
                f"--trace-layers {text!r}: {part.strip()!r} is not a layer id or range; use {LAYER_PRESETS} or "
                "ids and ranges like '24-47,50'"
            ) from None
        if a < 0 or b < a:
            raise ValueError(f"--trace-layers {text!r}: range {part.strip()!r} must be non-negative and ascending")
        ids.extend(range(a, b + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"--trace-layers {text!r} names a layer more than once")
    return tuple(sorted(ids))


NO_SITES = "none"  # `--trace-sites none`: FP4 numerics, no records


def parse_sites(text: str) -> tuple[str, ...]:
    """A `--trace-sites` value as site kinds (`none`: no kind, nothing recorded); ValueError naming unknown or
    repeated kinds."""
    if text.strip() == NO_SITES:
        return ()
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in SITE_KINDS]
    if not kinds or unknown or len(set(kinds)) != len(kinds):
        raise ValueError(
            f"--trace-sites {text!r}: use distinct kinds from {SITE_KINDS}, or {NO_SITES!r} alone (unknown: {unknown})"
        )
    return kinds


@dataclass(frozen=True)
class TraceArgs:
    """The validated `--trace-*` settings of one server."""

    mode: str
    bits: int
    layers: str | tuple[int, ...]
    sites: tuple[str, ...]
    store: str | None
    step: int
    recipe: PrecisionRecipe = get_recipe(DEFAULT_RECIPE)
    debug_layer: int | None = None  # --trace-debug-layer (None: off)
    host_ring_gb: float | None = None  # --trace-host-ring-gb (None: the capturer's default)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def records(self) -> bool:
        """Whether the server records anything (False with `--trace-sites none`: the recipe's numerics only)."""
        return self.enabled and bool(self.sites)

    @property
    def kv_sites(self) -> bool:
        return self.enabled and ("k" in self.sites or "v" in self.sites)

    @property
    def policy(self) -> CapturePolicy:
        """`--trace-record-bits` and `--trace-layers` as the capture policy the trainer's config also parses into."""
        return CapturePolicy(self.bits, self.layers)


def pool_role(role: Role) -> bool:
    """Whether SGLang's FP4 KV pool can hold K/V of `role`: its own kv_fp4 (E8M0 bytes), or NVFP4 with a static
    unit global scale (E4M3 bytes written and read by TRACE: `hooks.kv_pool_quantize`, the FP4-KV attention)."""
    return role.fmt is KV_FP4 or (role.fmt is NVFP4 and role.scale is Scale.STATIC)


def parse_trace_args(fields) -> TraceArgs:
    """The `--trace-*` fields of a ServerArgs (or any object carrying them) parsed and checked on their own;
    ValueError naming the flag. `check_server_args` adds the checks against the rest of the settings."""
    mode = fields.trace_mode
    if mode not in MODES:
        raise ValueError(f"--trace-mode {mode!r} is not one of {MODES}")
    try:
        bits = check_bits(fields.trace_record_bits)
        recipe = get_recipe(fields.trace_recipe)
    except ValueError as e:
        raise ValueError(f"--trace-record-bits / --trace-recipe: {e}") from None
    args = TraceArgs(
        mode=mode,
        bits=bits,
        layers=parse_layers(fields.trace_layers),
        sites=parse_sites(fields.trace_sites),
        store=fields.trace_store,
        step=fields.trace_step,
        recipe=recipe,
        debug_layer=None if fields.trace_debug_layer in (None, -1) else fields.trace_debug_layer,
        host_ring_gb=fields.trace_host_ring_gb,
    )
    ring = args.host_ring_gb
    if ring is not None and (isinstance(ring, bool) or not isinstance(ring, int | float) or not ring > 0):
        raise ValueError(f"--trace-host-ring-gb must be a positive number of GiB, got {ring!r}")
    if args.debug_layer is not None and (not isinstance(args.debug_layer, int) or args.debug_layer < 0):
        raise ValueError(f"--trace-debug-layer must be a layer id or -1 (off), got {args.debug_layer!r}")
    if args.debug_layer is not None and mode != "emulate":
        raise ValueError("--trace-debug-layer needs --trace-mode emulate")
    if isinstance(args.step, bool) or not isinstance(args.step, int) or args.step < 0:
        raise ValueError(f"--trace-step must be a non-negative integer, got {args.step!r}")
    return args


def check_server_args(server_args) -> TraceArgs:
    """Validate the `--trace-*` fields of a ServerArgs against the rest of its settings; return them parsed.

    Raises ValueError naming the flag and the problem. Settings TRACE does not handle (DP attention, expert
    parallelism, speculative decoding, ...) are refused rather than recorded wrongly. The patched ServerArgs calls
    this twice: on the flags as given, and at the end of `__post_init__` on the final settings (after SGLang's
    per-model and per-GPU defaults, e.g. its switch to `flashinfer_trtllm` for Qwen3-MoE on SM100). The one setting
    it changes: a server that records gets `sleep_on_idle` (the record writer thread needs the GIL, see below).
    """
    args = parse_trace_args(server_args)
    if not args.enabled:
        return args
    from sglang_trace.plugin import check_registered

    check_registered()
    mode, recipe = args.mode, args.recipe
    problems = []
    if args.records and not args.store:
        problems.append("--trace-store is required (the record store root the trainer reads)")
    if args.debug_layer is not None and not args.store:
        problems.append("--trace-debug-layer writes under --trace-store <root>/debug: pass --trace-store")
    if args.kv_sites and server_args.kv_cache_dtype != "fp4_e2m1":
        problems.append(
            f"k/v sites need --kv-cache-dtype fp4_e2m1 (got {server_args.kv_cache_dtype!r}); "
            "or pass --trace-sites moe_in"
        )
    if server_args.enable_dp_attention:
        problems.append("--enable-dp-attention is not supported (MoE rows would mix DP ranks' tokens)")
    if server_args.ep_size != 1 or server_args.moe_a2a_backend not in (None, "none"):
        problems.append("expert parallelism (--ep-size > 1 or --moe-a2a-backend) is not supported")
    if server_args.speculative_algorithm is not None:
        problems.append("speculative decoding is not supported (draft forwards would write records)")
    if server_args.pp_size != 1:
        problems.append("pipeline parallelism is not supported")
    if server_args.kv_cache_dtype == "fp4_e2m1" and not pool_role(recipe.k):
        problems.append(
            f"--trace-recipe {recipe.name} quantizes K / V as {recipe.k.fmt.name} ({recipe.k.scale.value} scale); "
            f"the fp4_e2m1 KV pool holds {KV_FP4.name} or NVFP4 with a static unit global scale"
        )
    if "moe_in" in args.sites and not recipe.recorded("moe_in"):
        problems.append(
            f"--trace-recipe {recipe.name} does not record moe_in ({recipe.moe_in.fmt.name} inputs are rounded to "
            "nearest on both sides); pass --trace-sites k,v"
        )
    if mode == "native" and recipe.name != DEFAULT_RECIPE:
        problems.append(
            f"--trace-mode native with --trace-recipe {recipe.name}: SGLang 0.5.15.post1 has no MXFP4 W4A4 MoE kernel "
            "for Qwen3-MoE (its mxfp4 method runs W4A16, or MXFP8 activations with GPT-OSS's clamped SwiGLU on "
            f"SM100); use --trace-mode emulate or --trace-recipe {DEFAULT_RECIPE}"
        )
    if mode == "emulate" and server_args.quantization not in (None, "bf16"):
        problems.append(
            f"--trace-mode emulate needs a BF16 checkpoint (it quantizes the experts itself); got "
            f"--quantization {server_args.quantization}"
        )
    problems += _untraceable_settings(server_args, mode)
    if mode == "native" and server_args.quantization not in ("modelopt_fp4",):
        problems.append(f"--trace-mode native needs --quantization modelopt_fp4, got {server_args.quantization!r}")
    if mode == "native" and server_args.moe_runner_backend != "flashinfer_cutlass":
        problems.append(
            "--trace-mode native needs --moe-runner-backend flashinfer_cutlass (one static input scale per layer and "
            f"standard top-k, so codes and routes are observable); got {server_args.moe_runner_backend!r}"
        )
    if problems:
        raise ValueError("TRACE server arguments: " + "; ".join(problems))
    if args.records and not server_args.sleep_on_idle:
        # The record writer is a thread of the scheduler's process: an idle scheduler that spins in Python holds the
        # GIL the writer needs at every torch op and file write (106 ms a 66 KB shard on the H200, measured). Sleeping
        # in SGLang's zmq poll while idle releases it; requests still wake the scheduler at once.
        server_args.sleep_on_idle = True
        logger.info("TRACE: --sleep-on-idle set (the record writer needs the GIL while the scheduler is idle)")
    return args


def _untraceable_settings(server_args, mode: str) -> list[str]:
    """Settings under which records would be lost, stale or describe other numerics, each named."""
    problems = []
    if server_args.enable_hierarchical_cache or getattr(server_args, "enable_lmcache", False):
        problems.append(
            "--enable-hierarchical-cache / --enable-lmcache is not supported (KV moved back from the host tier "
            "lands in slots whose records were not captured)"
        )
    if server_args.disaggregation_mode != "null":
        problems.append(
            f"--disaggregation-mode {server_args.disaggregation_mode} is not supported (prefill records stay on the "
            "prefill server)"
        )
    if server_args.enable_pdmux:
        problems.append("--enable-pdmux is not supported (prefill and decode run on split streams)")
    if server_args.enable_two_batch_overlap or server_args.enable_single_batch_overlap:
        problems.append(
            "--enable-two-batch-overlap / --enable-single-batch-overlap are not supported (a forward runs the MoE "
            "layers per micro-batch; staging rows are per forward)"
        )
    problems += _untraceable_parallelism(server_args)
    if getattr(server_args, "enable_unified_memory", False):
        problems.append(
            "--enable-unified-memory is not supported (req_to_token holds virtual KV ids; the record store is keyed by "
            "physical slot)"
        )
    if getattr(server_args, "enable_page_major_kv_layout", False):
        problems.append("--enable-page-major-kv-layout is not supported (the K/V sites read the token-major FP4 pool)")
    if getattr(server_args, "enable_hisparse", False):
        problems.append("--enable-hisparse is not supported (sparse attention reads KV the records do not describe)")
    if getattr(server_args, "elastic_ep_backend", None):
        problems.append(f"--elastic-ep-backend {server_args.elastic_ep_backend} is not supported (expert parallelism)")
    if getattr(server_args, "enable_fused_moe_sum_all_reduce", False):
        problems.append(
            "--enable-fused-moe-sum-all-reduce is not supported (it changes the expert output sum the trainer follows)"
        )
    if server_args.load_format not in HOOKED_LOAD_FORMATS:
        problems.append(
            f"--load-format {server_args.load_format} is not supported (it does not load routed experts through "
            f"FusedMoE.weight_loader; supported: {HOOKED_LOAD_FORMATS})"
        )
    if mode == "emulate":
        if server_args.moe_runner_backend not in HOOKED_MOE_RUNNERS:
            problems.append(
                f"--trace-mode emulate needs the triton MoE runner (its expert path carries the FC2-input "
                f"site); got --moe-runner-backend {server_args.moe_runner_backend}"
            )
        if server_args.enable_torch_compile:
            problems.append(
                "--enable-torch-compile is not supported in emulate (batch-1 graphs run "
                "fused_moe_forward_native, which has no FC2-input site)"
            )
        if server_args.custom_weight_loader:
            problems.append(
                f"--custom-weight-loader {server_args.custom_weight_loader} is not supported in emulate "
                "(custom loaders write experts without FusedMoE.weight_loader)"
            )
    return problems


def _untraceable_parallelism(server_args) -> list[str]:
    """Parallel layouts added in SGLang 0.5.15 under which a rank's forward rows or KV slots are not whole tokens of
    its requests, each named; read from the final settings (after `materialize_declarations`)."""
    problems = []
    for field_name, flag in (
        ("dcp_size", "--dcp-size"),
        ("attn_cp_size", "--attn-cp-size"),
        ("moe_dp_size", "--moe-dp-size"),
    ):
        value = getattr(server_args, field_name, 1)
        if value not in (None, 1):
            problems.append(f"{flag} {value} is not supported (context / MoE data parallelism splits a request's rows)")
    if getattr(server_args, "enable_prefill_cp", False):
        problems.append("--enable-prefill-cp is not supported (prefill context parallelism splits a prompt's rows)")
    if getattr(server_args, "enable_flashinfer_allreduce_fusion", False) and server_args.tp_size > 1:
        problems.append(
            "FlashInfer all-reduce fusion at TP > 1 is not supported (it fuses the residual add and RMSNorm into the "
            "all-reduce, numerics the trainer does not follow); pass --enforce-disable-flashinfer-allreduce-fusion"
        )
    return problems


@dataclass(frozen=True)
class ModelLayout:
    """What the records of one model depend on."""

    arch: str
    num_layers: int
    moe_layers: tuple[int, ...]
    attn_layers: tuple[int, ...]
    hidden: int
    num_kv_heads: int
    head_dim: int
    topk: int
    num_experts: int | None = None  # routed experts (None: unknown, routes kept as int32 in the record rows)


def model_layout(hf_config) -> ModelLayout:
    """MoE and softmax-attention layer ids and widths of a supported model config; ValueError otherwise."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((a for a in archs if a in DENSE_ATTENTION_ARCHS + HYBRID_ARCHS), None)
    if arch is None:
        raise ValueError(
            f"TRACE does not support architecture {archs}; supported: {DENSE_ATTENTION_ARCHS + HYBRID_ARCHS}"
        )
    n = hf_config.num_hidden_layers
    skip = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    moe = tuple(i for i in range(n) if i not in skip and (i + 1) % step == 0)
    if arch in HYBRID_ARCHS:
        attn = tuple(hf_config.full_attention_layer_ids)
    else:
        attn = tuple(range(n))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return ModelLayout(
        arch=arch,
        num_layers=n,
        moe_layers=moe,
        attn_layers=attn,
        hidden=hf_config.hidden_size,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        topk=hf_config.num_experts_per_tok,
        num_experts=getattr(hf_config, "num_experts", None),
    )


def model_spec(args: TraceArgs, layout: ModelLayout) -> RecordSpec:
    """The record spec `args` select on a model: sites, layers and bits; ValueError for layers or sites the model
    does not have."""
    if isinstance(args.layers, tuple):
        known = set(layout.moe_layers) | set(layout.attn_layers)
        unknown = [i for i in args.layers if i not in known]
        if unknown:
            raise ValueError(
                f"--trace-layers names layers {unknown} that {layout.arch} does not have (0..{layout.num_layers - 1})"
            )
    moe, attn = args.policy.select(layout.moe_layers), args.policy.select(layout.attn_layers)
    for name, width, role in (
        ("hidden size", layout.hidden, args.recipe.moe_in),
        ("head dim", layout.head_dim, args.recipe.k),
    ):
        if width % role.fmt.block:
            raise ValueError(
                f"{layout.arch}: {name} {width} is not a multiple of the {role.fmt.name} block {role.fmt.block}"
            )
    return RecordSpec(
        bits=args.bits,
        moe_layers=moe if "moe_in" in args.sites else (),
        attn_layers=attn if args.kv_sites else (),
        recipe=args.recipe.name,
    )


def served_spec(server_info: Mapping, hf_config) -> RecordSpec:
    """The record spec a running server captures, from its `/server_info` answer (its `--trace-*` fields) and the
    model's HF config: what a trainer compares with its own before guiding with the server's records. ValueError
    naming the field when TRACE is off there, when it records nothing (`--trace-sites none`: no records, routes or
    bindings reach the store), or a field is missing or invalid."""
    missing = [name for name in SERVER_ARGS_FIELDS if name not in server_info]
    if missing:
        raise ValueError(f"/server_info has no {missing} (not a TRACE-patched SGLang server)")
    args = parse_trace_args(SimpleNamespace(**{name: server_info[name] for name in SERVER_ARGS_FIELDS}))
    if not args.enabled:
        raise ValueError("trace_mode='off': the server records nothing (start it with --trace-mode emulate)")
    if not args.records:
        raise ValueError(
            f"trace_sites={server_info['trace_sites']!r}: the server runs the FP4 numerics of {args.recipe.name} but "
            "records nothing (no records, routes or bindings reach the store); start it with --trace-sites naming "
            "the sites the trainer reads"
        )
    return model_spec(args, model_layout(hf_config))


def served_counters(server_info: Mapping) -> dict | None:
    """TRACE's counters in a `/server_info` answer (`internal_states[0]["trace"]`, written by
    `hooks.add_internal_state`: `TraceCapturer.counters`); None for a server without a TRACE capturer."""
    states = server_info.get("internal_states") or [{}]
    return states[0].get("trace")


def layout_fields(layout: ModelLayout) -> dict:
    """`layout` as the plain JSON a server reports (`TraceCapturer.counters()["model"]`)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(layout).items()}


def served_layout_mismatch(server_info: Mapping, hf_config) -> list[str]:
    """The fields in which the model a TRACE server runs (its counters' `model`, `layout_fields`) differs from the
    layout of `hf_config` (the trainer's model), each as "field: server X, trainer Y"; ValueError when the server
    reports no layout (TRACE off there, or not a TRACE-patched server of this version)."""
    served = (served_counters(server_info) or {}).get("model")
    if not isinstance(served, dict):
        raise ValueError("/server_info reports no TRACE model layout (internal_states[0]['trace']['model'])")
    mine = layout_fields(model_layout(hf_config))
    return [f"{k}: server {served.get(k)!r}, trainer {v!r}" for k, v in mine.items() if served.get(k) != v]


def kv_kinds(args: TraceArgs) -> tuple[str, ...]:
    """The KV site kinds recorded (a RecordSpec always pairs k and v; this narrows to the selected ones)."""
    return tuple(k for k in ("k", "v") if k in args.sites)
