"""TRACE on the SGLang 0.5.15.post1 rollout side: server arguments, record capture at the MoE-input and FP4 KV
sites, emulated FP4 routed experts, R3 routes and the record hand-off. SGLang's plugin hooks (`sglang_trace.plugin`)
and the small patch stack (`patches/sglang/v0.5.15.post1/`) call into `sglang_trace.hooks`; everything else lives
here.
"""
