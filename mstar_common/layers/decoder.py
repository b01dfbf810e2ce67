"""Pre-norm transformer decoder layer, shared by Qwen3 and Llama.

The residual stream is carried beside the hidden states (`(hidden, residual)` in and out), so each norm can
fold in the preceding residual add: `residual += x; x = norm(residual)` is one op (one kernel on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar_common.layers.attention import AttentionContext, SelfAttention
from mstar_common.layers.mlp import GatedMLP
from mstar_common.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class DecoderLayerConfig:
    """The shape of one decoder layer; families fill it from their HF config."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderLayerConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            qk_norm=config.qk_norm, rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.qkv_bias, o_bias=config.o_bias,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: AttentionContext,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` None on the first layer. Returns the MLP output and the residual stream before it."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, ctx, kv)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
