"""Llama dense causal LMs (LlamaForCausalLM: Llama-3.x, and backbones built on it such as Orpheus).

The same decoder as Qwen3 (`layers/causal_lm.py`) without the per-head q/k norm, with Llama-3 RoPE frequency
scaling when the config asks for it (`rope_type: llama3`). Module names mirror HF, so checkpoints load by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_common.engine.attention import AttentionBackend
from mstar_common.layers.causal_lm import DecoderOnlyLM
from mstar_common.layers.decoder import DecoderLayerConfig
from mstar_common.layers.rotary import rope_from_config


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The fields of an HF Llama `config.json` this implementation reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, float] | None  # Llama-3 scaling, or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """Read an HF config dict, refusing features this implementation would silently get wrong."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported: only 'silu' is")
        if config.get("pretraining_tp", 1) != 1:
            raise ValueError(f"pretraining_tp={config['pretraining_tp']} is not supported: only 1 is")
        heads = config["num_attention_heads"]
        theta, scaling = rope_from_config(config)
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )

    def decoder_layer(self) -> DecoderLayerConfig:
        return DecoderLayerConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=False,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama on the shared decoder-only LM; implements the engine's `CausalLM` contract."""

    def __init__(self, config: LlamaConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__(config.decoder_layer(), config.num_hidden_layers, config.vocab_size, config.rope_theta,
                         config.max_position_embeddings, config.tie_word_embeddings, attn_backend,
                         rope_scaling=config.rope_scaling)
        self.config = config
