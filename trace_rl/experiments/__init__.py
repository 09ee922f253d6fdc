"""Experiment code on top of the RL runtime: the demo's side-by-side report, the same-batch analyses and the
measurements of docs/results.md."""
