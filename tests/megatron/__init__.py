"""The trainer side (megatron_trace): sites, grouped experts, R3, loss, parallel layouts, checkpoints, HF import and
export."""
