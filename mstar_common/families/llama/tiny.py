"""A tiny random Llama checkpoint (plain or Llama-3 RoPE) with the Qwen3 tiny tokenizer, for tests and demos.

Built with transformers' own `LlamaForCausalLM`, so it is a real HF checkpoint. Deterministic for a seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from mstar_common.checkpoints import vary_norms_and_biases, write_once
from mstar_common.families.qwen3.tiny import VOCAB_MULTIPLE, build_tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # small enough that the tiny contexts cross every band


def build_tiny_llama(out_dir: str | Path, seed: int = 0, llama3_rope: bool = True) -> Path:
    return write_once(out_dir, lambda tmp: _build(tmp, seed, llama3_rope), ("model.safetensors", "tokenizer.json"))


def _build(out: Path, seed: int, llama3_rope: bool) -> None:
    tokenizer = build_tokenizer()
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    rope = {"rope_theta": 500_000.0, **(LLAMA3_ROPE if llama3_rope else {"rope_type": "default"})}
    config = LlamaConfig(
        vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, hidden_size=96, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=rope,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext, initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = vary_norms_and_biases(LlamaForCausalLM(config).eval())  # norm weights not all 1
    model.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext],
                                               pad_token_id=endoftext, do_sample=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
