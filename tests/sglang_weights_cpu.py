"""Run by tests/rl/test_weight_sync.py as a server process with `SGLANG_USE_CPU_ENGINE=1`: SGLang's real
`Qwen3MoeForCausalLM` (sglang 0.5.15.post1) on CPU with TRACE's plugin in emulate mode (its hook after the FusedMoE
weight loader quantize-dequantizes the routed experts), behind an HTTP stand-in of the weight-update endpoints
(`tests.sglang_weights.WeightReceiver`: SGLang's own parsing, deserialization and `ModelRunner` methods, whose model
is this real one; TP = 1, torch.distributed initialized as a server's is, so it can join a weight-update group).

    python -m tests.sglang_weights_cpu --port PORT

The served model starts with `checkpoint(seed 1)`. `GET /stand_in/compare` compares every parameter with a second
model loaded from `checkpoint(seed 0)` through SGLang's disk path (`DefaultModelLoader.load_weights_and_postprocess`,
what `/update_weights_from_disk` runs), bit for bit, and says whether that model's experts are fake-quantized;
`POST /stand_in/reset` reloads seed 1. `GET /model_info` and `/server_info` answer as a patched server does.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch

from tests.sglang_cpu import init_cpu_parallel_state, load_trace_plugin
from tests.sglang_model_cpu import HEAD_DIM, HEADS, INTER, KV_HEADS, LAYERS, VOCAB, E, H, checkpoint
from tests.sglang_weights import REQUESTS, WeightReceiver


def hf_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=E, num_experts_per_tok=2,
                          moe_intermediate_size=INTER, intermediate_size=2 * INTER, vocab_size=VOCAB,
                          norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])  # fmt: skip


def build_models():
    """(served model, disk-loaded reference) with TRACE emulate on."""
    import tempfile

    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    load_trace_plugin()
    init_cpu_parallel_state()
    args = ServerArgs(model_path="dummy", device="cpu", trace_mode="emulate", trace_store=tempfile.mkdtemp(),
                      trace_sites="moe_in")  # fmt: skip
    set_global_server_args_for_scheduler(args)
    cfg = hf_config()
    initialize_dp_attention(args, SimpleNamespace(hidden_size=H, dtype=torch.bfloat16, hf_config=cfg))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # SGLang's model loader builds the model under the checkpoint dtype
    try:
        served, disk = Qwen3MoeForCausalLM(cfg, quant_config=None), Qwen3MoeForCausalLM(cfg, quant_config=None)
    finally:
        torch.set_default_dtype(default)
    served.load_weights(checkpoint(torch.Generator().manual_seed(1)).items())
    weights = checkpoint(torch.Generator().manual_seed(0))
    DefaultModelLoader.load_weights_and_postprocess(disk, iter(weights.items()), torch.device("cpu"))
    return served, disk, weights


def compare(served, disk, weights) -> dict:
    """Parameters of `served` that differ from `disk`'s; whether `disk`'s experts hold fake-quantized values."""
    ref = dict(disk.named_parameters())
    differ = [n for n, p in served.named_parameters() if not torch.equal(p, ref[n])]
    raw = torch.cat([weights["model.layers.0.mlp.experts.0.gate_proj.weight"],
                     weights["model.layers.0.mlp.experts.0.up_proj.weight"]])  # fmt: skip
    w13 = disk.model.layers[0].mlp.experts.w13_weight[0]
    return {"differ": differ, "checked": len(ref), "experts_quantized": not torch.equal(w13, raw)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    served, disk, weights = build_models()
    state = {"weight_version": "0"}
    receiver = WeightReceiver(served.load_weights)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/model_info":
                self._send(200, {"model_path": "dummy", "weight_version": state["weight_version"]})
            elif self.path == "/server_info":
                self._send(200, {"tp_size": 1, "dp_size": 1, "pp_size": 1, "trace_mode": "emulate"})
            elif self.path == "/stand_in/compare":
                self._send(200, compare(served, disk, weights))
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/stand_in/reset":
                served.load_weights(checkpoint(torch.Generator().manual_seed(1)).items())
                state["weight_version"] = "0"
                self._send(200, {"success": True})
                return
            assert self.path in REQUESTS, self.path
            try:
                ok, msg, req = receiver.handle(self.path, raw)
            except Exception as e:
                ok, msg, req = False, f"{type(e).__name__}: {e}", None
            if ok and getattr(req, "weight_version", None) is not None:  # the tokenizer manager's step
                state["weight_version"] = req.weight_version
            self._send(200 if ok else 400, {"success": ok, "message": msg})

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"sglang weights server on {args.port}", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
