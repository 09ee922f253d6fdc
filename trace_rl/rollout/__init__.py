"""Rollout: the embedded FP4 engine, its FP4-KV variant, and the pools of rollout workers (in process, Ray, SGLang)."""
