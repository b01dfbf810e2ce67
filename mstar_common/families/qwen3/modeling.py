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

import torch
from torch import nn

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.layers.attention import AttentionContext
from mstar_common.layers.decoder import DecoderLayer, DecoderLayerConfig
from mstar_common.layers.norm import RMSNorm
from mstar_common.layers.rotary import RotaryEmbedding, rope_theta_from_config


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


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_config = config.decoder_layer()
        self.layers = nn.ModuleList(DecoderLayer(layer_config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, kv_cache: KVCache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, ctx, kv_cache.layer(index))
        return self.norm(hidden)


class Qwen3ForCausalLM(nn.Module):
    """Implements the engine's `CausalLM` contract (`mstar_common/engine/model_runner.py`)."""

    def __init__(self, config: Qwen3Config, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.kv_spec = KVSpec(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
        self.max_position_embeddings = config.max_position_embeddings
        self.attn_backend = attn_backend or TorchPagedAttention()
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share `lm_head.weight` with the input embedding when the config ties them (call again after
        `to_empty`, which gives every module its own new tensor)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` (packed rows) -> final-norm hidden states `[T, hidden_size]`."""
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.model.rotary(positions, dtype)
        ctx = AttentionContext(cos=cos, sin=sin, metadata=attn_metadata, backend=self.attn_backend)
        return self.model(input_ids, ctx, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden_size]` -> `[B, vocab_size]` in the model dtype (the runner upcasts to fp32)."""
        return self.lm_head(hidden)
