"""Qwen3 dense causal LM over packed varlen tokens and a paged KV cache.

    input_ids [T] ─ embed_tokens ─▶ N × DecoderLayer(RMSNorm ▸ GQA attention with per-head q/k RMSNorm + RoPE
                                    ▸ residual ▸ RMSNorm ▸ gated SiLU MLP ▸ residual) ─ norm ─▶ hidden [T, H]
    hidden [B, H] (one row per sampled sequence) ─ lm_head (tied to embed_tokens when configured) ─▶ logits [B, V]

The shared dense decoder (`layers/causal_lm.py`) with per-head q/k norm; RoPE unscaled or with the static scalings
`layers/rotary.py` reads (YaRN, as Qwen3's long-context configs set it). Module names mirror HF
`Qwen3ForCausalLM`, so checkpoint tensors load by name (see `loader.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_common.layers.causal_lm import DenseCausalLM, DenseLMConfig


class Qwen3Config(DenseLMConfig):
    __slots__ = ()

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Qwen3Config:
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported: only full attention is")
        return cls.read_hf(config, qk_norm=True, scaled_rope=True)


class Qwen3ForCausalLM(DenseCausalLM):
    """Qwen3 on the shared decoder-only LM; implements the engine's `CausalLM` contract."""
