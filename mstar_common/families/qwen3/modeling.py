"""Qwen3 dense causal LM over packed varlen tokens and a paged KV cache.

    input_ids [T] ─ embed_tokens ─▶ N × DecoderLayer(RMSNorm ▸ GQA attention with per-head q/k RMSNorm + RoPE
                                    ▸ residual ▸ RMSNorm ▸ gated SiLU MLP ▸ residual) ─ norm ─▶ hidden [T, H]
    hidden [B, H] (one row per sampled sequence) ─ lm_head (tied to embed_tokens when configured) ─▶ logits [B, V]

Module names mirror HF `Qwen3ForCausalLM`, so checkpoint tensors load by name (see `loader.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_common.engine.attention import AttentionBackend
from mstar_common.layers.causal_lm import DecoderOnlyLM
from mstar_common.layers.decoder import DecoderLayerConfig
from mstar_common.layers.rotary import rope_theta_from_config


@dataclass(frozen=True, slots=True)
class Qwen3Config:
    """The fields of an HF Qwen3 `config.json` this implementation reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> Qwen3Config:
        """Read an HF config dict, refusing features this implementation would silently get wrong."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported: only 'silu' is")
        if config.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported: only full attention is")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_from_config(config),
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
        )

    def decoder_layer(self) -> DecoderLayerConfig:
        return DecoderLayerConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=True,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
        )


class Qwen3ForCausalLM(DecoderOnlyLM):
    """Qwen3 on the shared decoder-only LM (`mstar_common/layers/causal_lm.py`)."""

    def __init__(self, config: Qwen3Config, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__(config.decoder_layer(), config.num_hidden_layers, config.vocab_size, config.rope_theta,
                         config.max_position_embeddings, config.tie_word_embeddings, attn_backend)
        self.config = config
