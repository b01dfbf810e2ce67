"""GQA self-attention over packed varlen tokens with a paged KV cache (Qwen3, Llama, and their kin).

Projections follow the HF layout (`q_proj`, `k_proj`, `v_proj`, `o_proj`, optional per-head `q_norm`/`k_norm`)
so checkpoints load by name; `fuse_qkv()` then packs q/k/v into one `qkv_proj` GEMM. The rest is delegated to
an `AttentionBackend`: its `prologue` (q/k norm, RoPE, paged-KV write; fused into one kernel on the Triton
backend) and its `attend` (the causal read); this layer never sees pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata
from mstar_common.layers.linear import concat_linears
from mstar_common.layers.norm import RMSNorm
from mstar_common.layers.rotary import RopeInputs


@dataclass(slots=True)
class AttentionContext:
    """What every attention layer of one forward shares: RoPE of the packed positions and the batch."""

    rope: RopeInputs
    metadata: AttentionMetadata
    backend: AttentionBackend


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool,
        rms_norm_eps: float = 1e-6,
        qkv_bias: bool = False,
        o_bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qkv_proj: nn.Linear | None = None
        # Qwen3 normalises each head of q and k before RoPE; Llama does not.
        self.q_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, rms_norm_eps) if qk_norm else None

    def fuse_qkv(self) -> None:
        if self.qkv_proj is None:
            self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self, hidden: torch.Tensor | None, ctx: AttentionContext, kv: tuple[torch.Tensor, torch.Tensor],
        qkv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`hidden` `[T, hidden_size]` -> `[T, hidden_size]`; writes this step's K/V into `kv` (this layer's pool).
        `qkv` (with `hidden` None): the packed projection already taken (the decoder layer's norm + qkv launch)."""
        num_tokens = hidden.shape[0] if qkv is None else qkv.shape[0]
        if qkv is None and self.qkv_proj is not None:
            qkv = self.qkv_proj(hidden)
        elif qkv is None:
            qkv = torch.cat((self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)), dim=-1)
        out = ctx.backend.prologue_attend(qkv, self, ctx.rope, kv, ctx.metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
