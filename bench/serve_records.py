"""The records a TRACE server of `bench/serve.py` writes: what its served spec should write per token, the record
store drained (read and deleted) as shards appear, and the finish path's counters over one point."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from bench.serve_server import Server

STORE_S_PER_TOKEN = 30e3 / 200e6  # wait for the records: ~30 KB per token at 200 MB/s at least


def expected_record_bytes(info: dict, hf_config: dict) -> dict:
    """What the served record spec should write per token (`trace_core.records.spec.bytes_per_token`) and the device
    bytes its record store adds to every KV slot (`sglang_trace.capturer.record_bytes_per_slot`)."""
    from sglang_trace.capturer import record_bytes_per_slot
    from sglang_trace.config import model_layout, parse_trace_args, served_spec
    from trace_core.records.spec import ModelShape, bytes_per_token

    hf = SimpleNamespace(**hf_config)
    spec = served_spec(info, hf)
    layout = model_layout(hf)
    shape = ModelShape(layout.hidden, layout.num_kv_heads, layout.head_dim)
    expected = bytes_per_token(shape, spec)
    return {
        "spec": {"bits": spec.bits, "moe_layers": len(spec.moe_layers), "attn_layers": len(spec.attn_layers)},
        "recipe": spec.recipe,
        "record_bytes_per_token": expected.total,
        "moe_in_bytes_per_token": expected.moe_in,
        "kv_bytes_per_token": expected.kv,
        "routes_bytes_per_token": len(layout.moe_layers) * layout.topk * 4,  # int32 ids, if stored
        "record_bytes_per_slot": record_bytes_per_slot(parse_trace_args(SimpleNamespace(**info)), layout),
    }


def store_step_dir(root: Path) -> Path:
    """The step directory the server writes its records into (`--trace-step` 0, no weight update)."""
    from trace_core.records.store import step_dir

    return step_dir(root, 0)


class StoreDrain(threading.Thread):
    """Reads and deletes, as they appear, the shards and failure marks the server writes into a record-store step
    directory (one shard per finished request): what the trajectories of `tokens` positions hold is summed in
    `usage` (others, e.g. of a warm-up, are only counted), and the disk holds only the shards not read yet. The step
    directory stays (the server's writer holds it)."""

    def __init__(self, directory: Path, tokens: int | None = None) -> None:
        super().__init__(name="serve-store-drain", daemon=True)
        self.directory, self.tokens = directory, tokens
        self.usage = {"trajectories": 0, "tokens": 0, "record_raw_bytes": 0, "routes_raw_bytes": 0, "disk_bytes": 0}
        self.others = 0
        self.failed: list[str] = []
        self._stop_event = threading.Event()

    def drain_once(self) -> None:
        from trace_core.records.store import FAILED_PREFIX, read_header, shard_paths

        if not self.directory.is_dir():
            return
        for path in shard_paths(self.directory):
            header, size = read_header(path), path.stat().st_size
            path.unlink()
            if any(self.tokens not in (None, e["num_tokens"]) for e in header["trajectories"].values()):
                self.others += len(header["trajectories"])
                continue
            self.usage["disk_bytes"] += size
            for entry in header["trajectories"].values():
                self.usage["trajectories"] += 1
                self.usage["tokens"] += entry["num_tokens"]
                for site in entry["sites"].values():
                    self.usage["record_raw_bytes"] += sum(f["raw"] for f in site["fields"].values())
                self.usage["routes_raw_bytes"] += entry.get("routes", {}).get("raw", 0)
        for path in self.directory.glob(f"{FAILED_PREFIX}*"):
            self.failed.append(json.loads(path.read_text()).get("message", ""))
            path.unlink()

    def run(self) -> None:
        while not self._stop_event.wait(0.5):
            self.drain_once()

    def finish(self, expected: int, timeout_s: float, server: Server) -> dict:
        """Wait until `expected` trajectories were written or marked failed, or `timeout_s`; stop; the totals."""
        deadline = time.monotonic() + timeout_s
        while self.usage["trajectories"] + len(self.failed) < expected and time.monotonic() < deadline:
            server.check()
            time.sleep(0.5)
        self._stop_event.set()
        self.join()
        self.drain_once()
        done = self.usage["trajectories"] + len(self.failed)
        return self.usage | {
            "failed": len(self.failed),
            "failures": self.failed[:3],
            "other_trajectories": self.others,
            "complete": done >= expected,
        }


def record_bytes(usage: dict, expected: dict) -> dict:
    tokens = max(1, usage["tokens"])
    return {
        "record_bytes_per_token": usage["record_raw_bytes"] / tokens,
        "expected_record_bytes_per_token": expected["record_bytes_per_token"],
        "routes_bytes_per_token": usage["routes_raw_bytes"] / tokens,
        "disk_bytes_per_token": usage["disk_bytes"] / tokens,
        "trajectories": usage["trajectories"],
        "failed_trajectories": usage["failed"],
        "failures": usage["failures"],
        "other_trajectories": usage["other_trajectories"],
        "store_complete": usage["complete"],
    }


def finish_path(before: dict, after: dict) -> dict:
    """The finish path over one point from the server's TRACE counters before and after it (QUANTITIES)."""

    def d(key: str) -> float:
        return after[key] - before[key]

    def fence(key: str) -> float | None:
        if after.get("fence") is None or before.get("fence") is None:
            return None
        return after["fence"][key] - before["fence"][key]

    requests, write_s = d("requests"), d("write_s")
    return {
        "finish_requests": requests,
        "finish_tokens_per_request": d("tokens") / requests if requests else None,
        "finish_ms_per_request": 1e3 * d("finish_s") / requests if requests else None,
        "finish_transfers": d("transfers"),
        "ring_wait_s": after["ring"]["stall_s"] - before["ring"]["stall_s"],
        "ring_stalls": after["ring"]["stalls"] - before["ring"]["stalls"],
        "writer_s": write_s,
        "writer_GBps": d("host_bytes") / write_s / 1e9 if write_s > 0 else None,
        "record_write_failures": d("write_failures"),
        # no slot fence on a server that stores no records (--trace-sites none)
        "fence_alloc_waits": fence("alloc_waits"),
        "fence_alloc_wait_s": fence("alloc_wait_s"),
    }
