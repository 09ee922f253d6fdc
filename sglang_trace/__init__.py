"""TRACE on the SGLang 0.5.10.post1 rollout side: server arguments, record capture at the MoE-input and FP4 KV
sites, emulated NVFP4 W4A4 routed experts, R3 routes and the record hand-off. The SGLang patch stack
(`patches/sglang/v0.5.10.post1/`) calls into `sglang_trace.hooks`; everything else lives here.
"""
