"""TRACE trainer side for megatron-core 0.19.2: guided FP4 QAT at the captured sites, R3 routing replay,
GRPO + TIS loss with mismatch metrics, and Megatron → HF Qwen3-MoE weight export."""
