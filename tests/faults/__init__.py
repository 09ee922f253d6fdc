"""Fault injection (docs/reliability.md): config, HTTP transport, resume, SGLang boundary, record store, workers."""
