"""Training modes: what the trainer does at the FP4 sites. One definition for the trainer (`megatron_trace`), the
RL config and the demo (`trace_rl`)."""

from __future__ import annotations

import enum


class Mode(enum.Enum):
    """What the trainer does at the FP4 sites."""

    BF16 = "bf16"  # nothing: the unquantized baseline
    QAT = "qat"  # RTN fake-quant at every FP4 site (vanilla QAT)
    TRACE = "trace"  # guided rounding at the record spec's captured sites, RTN at the other FP4 sites


MODES = tuple(m.value for m in Mode)
"""The modes' names, as configs and command lines spell them."""

FP4_MODES = tuple(m.value for m in Mode if m is not Mode.BF16)
"""The modes whose rollout runs FP4 (all but the BF16 baseline)."""

ROLLOUT_MODES = ("off", "emulate", "native")
"""What an SGLang server does at the FP4 sites (`--trace-mode`): nothing; emulate the precision recipe's numerics by
quantize-dequantize around BF16 GEMMs (Hopper, CPU); or reproduce the codes of a real NVFP4 MoE kernel."""
