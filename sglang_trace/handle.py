"""The record handle of a finished request in an SGLang response (`meta_info["trace"]`).

SGLang 0.5.15 carries per-request extras to `meta_info` through its `customized_info` channel, one value per output
token; TRACE puts its handle at the last output token (`hooks.on_request_finished`), so `meta_info["trace"]` is a
list whose last entry is the handle and whose other entries are None.
"""

from __future__ import annotations

TRACE_INFO_KEY = "trace"


def from_meta_info(meta_info: dict) -> dict | None:
    """The handle in a response's `meta_info` (None when the server sent none); ValueError for a `trace` entry
    that is neither a list ending in a handle dict nor a handle dict."""
    value = meta_info.get(TRACE_INFO_KEY)
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
        raise ValueError(f"meta_info[{TRACE_INFO_KEY!r}] is not a list ending in a record handle: {value!r:.200}")
    if any(v is not None for v in value[:-1]):
        raise ValueError(f"meta_info[{TRACE_INFO_KEY!r}] holds more than one record handle")
    return value[-1]
