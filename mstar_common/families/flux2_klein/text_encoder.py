"""The FLUX.2 [klein] prompt encoder: a Qwen3 decoder run only as deep as its deepest tap.

    input_ids [B, 512] (right-padded) + text_lens [B]
      ─ embed_tokens ─▶ layer 1 ─▶ … ─▶ layer max(taps)            (deeper layers are never built)
                        tap k = the output of layer k (the final RMSNorm applies only when k is the last layer)
      ─ concat(tap_1, tap_2, tap_3) on the feature axis ─▶ prompt_embeds [B, 512, len(taps) * hidden]

The attention mask is the reference's: causal, and no query sees a padding key (padding rows still get
outputs, which the DiT reads: it attends to all 512 text tokens). Module names mirror HF
`Qwen3ForCausalLM` (`model.layers.N...`), so the checkpoint loads by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_common.families.qwen3.modeling import Qwen3Config
from mstar_common.layers.mlp import GatedMLP
from mstar_common.layers.norm import RMSNorm
from mstar_common.layers.rotary import RotaryEmbedding


class DenseSelfAttention(nn.Module):
    """GQA self-attention over a padded batch `[B, L, hidden]` with a boolean mask (HF sdpa arithmetic)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = hidden.shape
        shape = (batch, length, -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden).view(shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden).view(shape)).transpose(1, 2)
        value = self.v_proj(hidden).view(shape).transpose(1, 2)
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0, scale=self.scale,
                                             is_causal=mask is None)
        out = out.transpose(1, 2).contiguous().reshape(batch, length, -1)
        return self.o_proj(out)


class EncoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DenseSelfAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class _Trunk(nn.Module):
    def __init__(self, config: Qwen3Config, num_layers: int, has_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if has_norm else None


class Qwen3TapEncoder(nn.Module):
    """Runs layers 1..max(taps) of a Qwen3 decoder and concatenates the tapped hidden states."""

    def __init__(self, config: Qwen3Config, taps: tuple[int, ...]) -> None:
        super().__init__()
        check_taps(taps, config.num_hidden_layers)
        self.config = config
        self.taps = tuple(taps)
        self.num_layers_run = max(taps)
        # The reference's last hidden state is taken after the final norm; only that tap needs it.
        self.model = _Trunk(config, self.num_layers_run, has_norm=self.num_layers_run == config.num_hidden_layers)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def out_features(self) -> int:
        return len(self.taps) * self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, text_lens: torch.Tensor, static: bool = False) -> torch.Tensor:
        """`input_ids` `[B, L]` right-padded, `text_lens` `[B]` -> `[B, L, len(taps) * hidden]`. `static`: always
        build the padding mask (no host-side check of the lengths), so the forward can be captured."""
        batch, length = input_ids.shape
        hidden = self.model.embed_tokens(input_ids)
        positions = torch.arange(length, device=input_ids.device)
        cos, sin = self.rotary(positions, hidden.dtype)
        mask = padding_causal_mask(text_lens, length, always=static)
        tapped: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.model.layers, start=1):
            hidden = layer(hidden, cos, sin, mask)
            if index in self.taps:
                tapped[index] = hidden
        if self.model.norm is not None:
            tapped[self.num_layers_run] = self.model.norm(tapped[self.num_layers_run])
        out = torch.stack([tapped[k] for k in self.taps], dim=1)  # [B, taps, L, H]
        return out.permute(0, 2, 1, 3).reshape(batch, length, self.out_features)


def check_taps(taps: tuple[int, ...], num_hidden_layers: int) -> None:
    if not taps or any(not 1 <= k <= num_hidden_layers for k in taps) or len(set(taps)) != len(taps):
        raise ValueError(f"text_encoder_out_layers: taps must be distinct layer numbers in [1, {num_hidden_layers}] "
                         f"(the checkpoint's text encoder has {num_hidden_layers} layers), got {list(taps)}")


def padding_causal_mask(text_lens: torch.Tensor, length: int, always: bool = False) -> torch.Tensor | None:
    """`[B, 1, L, L]` bool: query q sees key k when k <= q and k is not padding; None when nothing is padded
    (then attention runs `is_causal`, as the reference does for an unpadded batch), unless `always`."""
    if not always and bool((text_lens >= length).all()):
        return None
    keys = torch.arange(length, device=text_lens.device)
    causal = keys[None, :] <= keys[:, None]  # [L, L]
    valid = keys[None, :] < text_lens[:, None]  # [B, L]
    return (causal[None, :, :] & valid[:, None, :])[:, None, :, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[B, heads, L, D]` with `cos`/`sin` `[L, D]` (rotate-half pairing)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    batch, kv_heads, length, head_dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, length, head_dim).reshape(batch, -1, length, head_dim)
