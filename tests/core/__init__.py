"""Engine-agnostic numerics and records (trace_core): formats, the reference quantizer, guided rounding, recipes,
records, capture, the record store."""
