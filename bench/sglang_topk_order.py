"""Where the top-k weight multiplies the expert output: SGLang's triton MoE runner against the trainer, one MoE
layer at Qwen3-30B-A3B shapes (hidden 2048, expert width 768, 128 experts, top-8), in torch.

- SGLang (`moe_runner/triton.py`, `invoke_fused_moe_kernel(..., mul_routed_weight=True)`): the second GEMM's FP32
  accumulator is multiplied by the token's top-k weight, then rounded to BF16 once; `moe_sum_reduce` sums the
  top-k rows in FP32 and rounds to BF16.
- Trainer (`megatron_trace.session._probs_after_fc2`): the FC2 output is rounded to BF16 first, then multiplied by
  the weight (FP32 product, rounded to BF16); the same FP32 top-k sum here, so only the multiply's place differs.

Both sides start from the same FP32 accumulator (FP32 matmul of the BF16 FC2 input, NVFP4 quantize-dequantized
under `trace_core.numerics.fc2`, and the BF16 expert weights; TF32 off), so the comparison isolates the rounding order,
not GEMM accumulation order. This is an emulation in torch of what SGLang's kernel computes (its Triton kernel needs
SGLang's module chain, which does not import without sgl_kernel), not a run of that kernel. Reported: the MoE
output's relative L2 difference and share of differing BF16 elements; the share of the next layer's NVFP4
MoE-input codes that change (residual add, RMSNorm, per-token NVFP4); and |delta log-prob| of the sampled token
when that one layer's output goes through a final RMSNorm and a random LM head of Qwen3's vocabulary (one layer's
difference, not a whole model's).

    python bench/sglang_topk_order.py --out topk_order.json            # GPU
    python bench/sglang_topk_order.py --small --device cpu             # smoke check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import device_name, write_json
from trace_core.numerics.fc2 import fc2_input_fake_quant
from trace_core.numerics.quant import quantize
from trace_core.numerics.recipe import NVFP4_W4A4_KV4


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    hidden, inter, experts, topk, vocab = (256, 64, 16, 4, 4096) if a.small else (2048, 768, 128, 8, 151936)
    tokens = 64 if a.small else a.tokens
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    x = randn(tokens, hidden).to(torch.bfloat16)  # residual stream
    logits = randn(tokens, experts)
    weights, ids = torch.softmax(logits, -1).topk(topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)  # Qwen3-MoE: norm_topk_prob
    w2 = randn(experts, hidden, inter, scale=inter**-0.5).to(torch.bfloat16)
    gate, up = randn(tokens * topk, inter), randn(tokens * topk, inter)
    h = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    h = fc2_input_fake_quant(h, NVFP4_W4A4_KV4.fc2_in)  # the FC2 input both sides feed the GEMM
    acc = torch.empty(tokens * topk, hidden, device=dev)
    flat_ids = ids.reshape(-1)
    for e in range(experts):
        rows = (flat_ids == e).nonzero().flatten()
        acc[rows] = h[rows].float() @ w2[e].float().t()
    acc = acc.view(tokens, topk, hidden)
    w = weights.float().unsqueeze(-1)
    sglang = (acc * w).to(torch.bfloat16).float().sum(1).to(torch.bfloat16)
    trainer = (acc.to(torch.bfloat16).float() * w).to(torch.bfloat16).float().sum(1).to(torch.bfloat16)
    diff = (sglang.float() - trainer.float()).norm() / sglang.float().norm()

    nxt = {}
    for name, out in (("sglang", sglang), ("trainer", trainer)):
        nxt[name] = (x + out).to(torch.bfloat16)
    codes = [quantize(rms_norm(nxt[n]), "nvfp4", per_token=True).codes for n in ("sglang", "trainer")]
    head = randn(vocab, hidden, scale=hidden**-0.5).to(torch.bfloat16)
    logp = {}
    for name, hs in nxt.items():
        chunks = [torch.log_softmax((rms_norm(c) @ head.t()).float(), -1) for c in hs.split(512)]
        logp[name] = torch.cat(chunks)
    sampled = torch.multinomial(logp["sglang"].exp(), 1, generator=torch.Generator(device=dev).manual_seed(1))
    dlogp = (logp["sglang"].gather(1, sampled) - logp["trainer"].gather(1, sampled)).abs()
    result = {
        "device": device_name(dev),
        "shapes": dict(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, vocab=vocab),
        "moe_out_rel_l2": float(diff),
        "moe_out_bf16_elements_differing": float((sglang != trainer).float().mean()),
        "next_layer_nvfp4_codes_differing": float((codes[0] != codes[1]).float().mean()),
        "sampled_token_abs_dlogp_mean": float(dlogp.mean()),
        "sampled_token_abs_dlogp_max": float(dlogp.max()),
    }
    print(json.dumps(result, indent=2))
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
