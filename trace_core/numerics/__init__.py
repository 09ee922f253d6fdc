"""Numerics shared by both engines: FP4/FP8 formats, the reference quantizer, guided rounding, recipes."""
