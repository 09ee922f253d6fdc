"""A tiny random HF Qwen3-MoE checkpoint built with transformers (no download): config, BF16 safetensors, a
character-level tokenizer with a ChatML chat template and `<|im_end|>` as EOS."""

from __future__ import annotations

import string
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIMS = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    intermediate_size=96,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    norm_topk_prob=True,
)


def tokenizer():
    """Characters of `string.printable` (less the rarer whitespace) as tokens, then the ChatML specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {c: i for i, c in enumerate(chars)} | {s: len(chars) + i for i, s in enumerate(SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIAL
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_hf_checkpoint(path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Save a random BF16 Qwen3-MoE (`DIMS` with `overrides`) and the tokenizer under `path`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = tokenizer()
    config = Qwen3MoeConfig(**(DIMS | overrides), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # norms and the router start at 1 / 0 otherwise: make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


if __name__ == "__main__":
    import sys

    print(make_hf_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "out/tiny-hf"))
