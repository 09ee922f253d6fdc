"""The RL loop (trace_rl): config, data, the embedded engine, rollout workers and servers, weight sync, the CLI and
results drivers."""
