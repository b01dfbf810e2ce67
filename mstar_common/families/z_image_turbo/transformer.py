"""The Z-Image single-stream DiT (6B in Z-Image-Turbo), as the denoise loop runs it.

    caption feats [L, cap_dim] ─ RMSNorm·Linear ─ pad to a multiple of 32 with `cap_pad_token` ─ context refiner
        (unmodulated blocks; no timestep) ─▶ caption [T, dim]          once per request (`encode_caption`)
    latent tokens [B, N, 2·2·C] ─ Linear ─ pad to a multiple of 32 with `x_pad_token` ─ noise refiner
        (timestep-modulated blocks) ─ [image ‖ caption] ─ main blocks ─ adaLN-scaled LayerNorm·Linear
        ─▶ velocity [B, N, 2·2·C] (the first N rows)                 every step (`forward`)

Every block: RMSNorm in front of and behind both the attention and the SwiGLU MLP; modulated blocks scale
the inputs by `1 + scale` and gate the residual by `tanh(gate)`. RoPE over three axes (frame, row, column):
caption token j sits at (1 + j, 0, 0), image token (h, w) at (T + 1, h, w), an image padding token at
(0, 0, 0). Padding tokens are attended like real ones (the checkpoint was trained that way).

The caption refiner depends on the prompt only, so it runs once per request instead of once per step. A
batch holds rows of one layout (token grid and padded caption length T), so no attention mask is needed.
Module names and the arithmetic order mirror diffusers' `ZImageTransformer2DModel`, so checkpoints load by
name and fp32 output matches it.

On a GPU, `use_fused_kernels()` (the loader turns it on; `MSTAR_DIFFUSION_KERNELS=0` keeps eager) runs the
modulated blocks' glue as Triton kernels (mstar_kernels/dit.py): RMSNorm x scale, the tanh-gated RMSNorm residual fused
with the next norm, q/k RMSNorm + RoPE, SiLU x up. They round where the eager ops round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_common.diffusion.attention import attention
from mstar_common.families.flux2_klein.transformer import sinusoid
from mstar_common.layers.norm import RMSNorm

SEQ_MULTIPLE = 32  # caption and image token runs are padded to a multiple of this
ADALN_MAX_DIM = 256  # the timestep embedding is min(dim, 256) wide
TIME_FREQ_CHANNELS = 256  # sinusoid channels fed to the timestep MLP
TIME_MLP_HIDDEN = 1024
QK_NORM_EPS = 1e-5
FINAL_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class ZImageTransformerConfig:
    in_channels: int
    dim: int
    n_layers: int
    n_refiner_layers: int
    n_heads: int
    norm_eps: float
    qk_norm: bool
    cap_feat_dim: int
    rope_theta: float
    t_scale: float
    axes_dims: tuple[int, ...]
    axes_lens: tuple[int, ...]
    patch_size: int

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> ZImageTransformerConfig:
        """Read `transformer/config.json`, refusing variants this port would silently get wrong."""
        patches = tuple(config.get("all_patch_size", (2,)))
        frames = tuple(config.get("all_f_patch_size", (1,)))
        if len(patches) != 1 or frames != (1,):
            raise ValueError(f"transformer all_patch_size={list(patches)}, all_f_patch_size={list(frames)}: only one "
                             "spatial patch size with a frame patch of 1 (text-to-image) is supported")
        if config.get("siglip_feat_dim") is not None:
            raise ValueError("transformer siglip_feat_dim is set: the Omni (image-conditioned) variant is not served")
        dim, heads = config.get("dim", 3840), config.get("n_heads", 30)
        if config.get("n_kv_heads", heads) != heads:
            raise ValueError(f"transformer n_kv_heads={config['n_kv_heads']} must equal n_heads={heads}")
        axes = tuple(config.get("axes_dims", (32, 48, 48)))
        lens = tuple(config.get("axes_lens", (1024, 512, 512)))
        if dim % heads or sum(axes) != dim // heads or len(axes) != 3 or len(lens) != 3:
            raise ValueError(f"transformer axes_dims {list(axes)} must be 3 axes summing to dim/n_heads="
                             f"{dim // heads} (dim={dim}, n_heads={heads}), with 3 axes_lens")
        return cls(
            in_channels=config.get("in_channels", 16), dim=dim, n_layers=config.get("n_layers", 30),
            n_refiner_layers=config.get("n_refiner_layers", 2), n_heads=heads,
            norm_eps=float(config.get("norm_eps", 1e-5)), qk_norm=bool(config.get("qk_norm", True)),
            cap_feat_dim=config.get("cap_feat_dim", 2560), rope_theta=float(config.get("rope_theta", 256.0)),
            t_scale=float(config.get("t_scale", 1000.0)), axes_dims=axes, axes_lens=lens, patch_size=patches[0],
        )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def token_channels(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def patch_key(self) -> str:
        return f"{self.patch_size}-1"


def padded_length(length: int) -> int:
    return length + (-length) % SEQ_MULTIPLE


# rotary embedding


def rope_freqs(positions: torch.Tensor, config: ZImageTransformerConfig) -> torch.Tensor:
    """Complex rotations `[S, head_dim / 2]` for integer positions `[S, 3]` (angles in fp64, then fp32)."""
    parts = []
    for axis, dim in enumerate(config.axes_dims):
        inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(positions[:, axis].to(torch.float64).cpu(), inv).float()
        parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts, dim=-1).to(positions.device)


def image_positions(height: int, width: int, caption_tokens: int) -> torch.Tensor:
    """`[padded(h·w), 3]`: (T + 1, row, column) in raster order, then (0, 0, 0) for the padding tokens."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    grid = torch.stack([torch.full_like(rows, caption_tokens + 1), rows, cols], dim=-1).reshape(-1, 3)
    pad = torch.zeros(padded_length(grid.shape[0]) - grid.shape[0], 3, dtype=grid.dtype)
    return torch.cat([grid, pad])


def caption_positions(caption_tokens: int) -> torch.Tensor:
    """`[T, 3]`: (1 + j, 0, 0), padding tokens included."""
    frame = torch.arange(1, caption_tokens + 1)
    return torch.stack([frame, torch.zeros_like(frame), torch.zeros_like(frame)], dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`x` `[B, S, heads, D]` rotated pairwise by `freqs` `[S, D / 2]` (complex, fp32)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


# blocks


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.norm_q = RMSNorm(dim // heads, QK_NORM_EPS) if qk_norm else None
        self.norm_k = RMSNorm(dim // heads, QK_NORM_EPS) if qk_norm else None
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`freqs`: complex rotations `[S, D/2]`, or on the fused path their (cos, sin) tables."""
        query, key, value = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))
        if isinstance(freqs, tuple):
            from mstar_kernels.dit import qk_norm_rope

            query = qk_norm_rope(query, self.norm_q.weight, self.norm_q.eps, *freqs)
            key = qk_norm_rope(key, self.norm_k.weight, self.norm_k.eps, *freqs)
            return self.to_out[0](attention(query, key, value))
        if self.norm_q is not None:
            query, key = self.norm_q(query), self.norm_k(key)
        query, key = apply_rope(query, freqs), apply_rope(key, freqs)
        return self.to_out[0](attention(query, key, value))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from mstar_kernels.silu_mul import silu_mul_pair

            gate, up = self.w1(x), self.w3(x)
            act = silu_mul_pair(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1]))
            return self.w2(act.view(gate.shape))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Sandwich-normed attention + MLP; modulated by the timestep embedding when `modulation` is set."""

    def __init__(self, config: ZImageTransformerConfig, modulation: bool) -> None:
        super().__init__()
        dim, eps = config.dim, config.norm_eps
        self.attention = SelfAttention(dim, config.n_heads, config.qk_norm)
        self.feed_forward = SwiGLU(dim, int(dim / 3 * 8))
        self.attention_norm1, self.attention_norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.ffn_norm1, self.ffn_norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        adaln = min(dim, ADALN_MAX_DIM)
        self.adaLN_modulation = nn.Sequential(nn.Linear(adaln, 4 * dim)) if modulation else None  # noqa: N815

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), freqs))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        scale_attn, gate_attn, scale_mlp, gate_mlp = self.adaLN_modulation(temb).unsqueeze(1).chunk(4, dim=2)
        gate_attn, gate_mlp = gate_attn.tanh(), gate_mlp.tanh()
        scale_attn, scale_mlp = 1.0 + scale_attn, 1.0 + scale_mlp
        if isinstance(freqs, tuple):  # the fused path (`use_fused_kernels`, tables from `_rope_tables`)
            return self._fused_forward(x, freqs, scale_attn, gate_attn, scale_mlp, gate_mlp)
        x = x + gate_attn * self.attention_norm2(self.attention(self.attention_norm1(x) * scale_attn, freqs))
        return x + gate_mlp * self.ffn_norm2(self.feed_forward(self.ffn_norm1(x) * scale_mlp))

    def _fused_forward(self, x, tables, scale_attn, gate_attn, scale_mlp, gate_mlp):
        from mstar_kernels.dit import gated_rms_residual, gated_rms_residual_modulate, rms_modulate

        norm1, norm2, ffn1, ffn2 = self.attention_norm1, self.attention_norm2, self.ffn_norm1, self.ffn_norm2
        attn = self.attention(rms_modulate(x, norm1.weight, norm1.eps, scale_attn), tables)
        x, ffn_in = gated_rms_residual_modulate(x, attn, norm2.weight, norm2.eps, gate_attn, ffn1.weight, ffn1.eps,
                                                scale_mlp)
        return gated_rms_residual(x, self.feed_forward(ffn_in), ffn2.weight, ffn2.eps, gate_mlp)


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_MAX_DIM), dim))  # noqa: N815

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.adaLN_modulation(temb)
        return self.linear(F.layer_norm(x, (x.shape[-1],), eps=FINAL_NORM_EPS) * scale.unsqueeze(1))


class TimestepEmbedder(nn.Module):
    def __init__(self, out_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIME_FREQ_CHANNELS, TIME_MLP_HIDDEN), nn.SiLU(),
                                 nn.Linear(TIME_MLP_HIDDEN, out_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoid(t, TIME_FREQ_CHANNELS).to(self.mlp[0].weight.dtype))


# the model


class ZImageTransformer(nn.Module):
    def __init__(self, config: ZImageTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim, key = config.dim, config.patch_key
        self.all_x_embedder = nn.ModuleDict({key: nn.Linear(config.token_channels, dim)})
        self.all_final_layer = nn.ModuleDict({key: FinalLayer(dim, config.token_channels)})
        self.noise_refiner = nn.ModuleList(Block(config, modulation=True) for _ in range(config.n_refiner_layers))
        self.context_refiner = nn.ModuleList(Block(config, modulation=False) for _ in range(config.n_refiner_layers))
        self.t_embedder = TimestepEmbedder(min(dim, ADALN_MAX_DIM))
        cap_dim = config.cap_feat_dim
        self.cap_embedder = nn.Sequential(RMSNorm(cap_dim, config.norm_eps), nn.Linear(cap_dim, dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.layers = nn.ModuleList(Block(config, modulation=True) for _ in range(config.n_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.cap_pad_token.dtype

    def lora_aliases(self) -> dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]]:
        """The original module names a LoRA file may use besides diffusers' (the same but for each attention's fused
        `attention.qkv`, a third of lora_B's rows for each of to_q, to_k, to_v as diffusers' Kohya conversion splits
        it, and its output projection `attention.out`) -> the weights each covers (`dit_lora.Layout`)."""
        aliases: dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]] = {}
        for stack in ("noise_refiner", "context_refiner", "layers"):
            for name in (f"{stack}.{i}" for i in range(len(getattr(self, stack)))):
                aliases[f"{name}.attention.out"] = ((f"{name}.attention.to_out.0.weight", 1, (0,)),)
                aliases[f"{name}.attention.qkv"] = tuple((f"{name}.attention.to_{x}.weight", 3, (i,))
                                                         for i, x in enumerate("qkv"))
        return aliases

    fused = False

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Run the modulated blocks' glue through the Triton kernels (CUDA only; see the module's docstring).
        Needs q/k norms (every released Z-Image has them)."""
        enabled = enabled and self.config.qk_norm
        self.fused = enabled
        for module in self.modules():
            if isinstance(module, SwiGLU):
                module.fused = enabled

    def _rope_tables(self, freqs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.fused:
            return freqs
        from mstar_kernels.dit import rope_tables_from_complex

        return rope_tables_from_complex(freqs)

    def rope(self, height: int, width: int, caption_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(image freqs `[padded(h·w), D/2]`, caption freqs `[T, D/2]`) of a layout: cache per layout."""
        device = self.cap_pad_token.device
        image = rope_freqs(image_positions(height, width, caption_tokens), self.config)
        caption = rope_freqs(caption_positions(caption_tokens), self.config)
        return image.to(device), caption.to(device)

    def encode_caption(self, feats: torch.Tensor) -> torch.Tensor:
        """Caption features `[L, cap_feat_dim]` -> refined caption `[padded(L), dim]` (timestep-independent)."""
        tokens = padded_length(feats.shape[0])
        embedded = self.cap_embedder(_pad_rows(feats, tokens))
        x = _fill_padding(embedded, feats.shape[0], self.cap_pad_token)[None]
        freqs = rope_freqs(caption_positions(tokens), self.config).to(x.device)
        for layer in self.context_refiner:
            x = layer(x, freqs)
        return x[0]

    def forward(self, tokens: torch.Tensor, caption: torch.Tensor, t: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`tokens` `[B, N, token_channels]` (patchified latents), `caption` `[B, T, dim]` from `encode_caption`,
        `t` `[B]` in [0, 1] (1 = clean), `rope` from `rope()` -> the model output `[B, N, token_channels]`."""
        num_tokens = tokens.shape[1]
        image_freqs, caption_freqs = rope
        temb = self.t_embedder(t * self.config.t_scale).type_as(tokens)
        x = self.all_x_embedder[self.config.patch_key](_pad_rows(tokens, image_freqs.shape[0]))
        x = _fill_padding(x, num_tokens, self.x_pad_token)
        image_rope = self._rope_tables(image_freqs)
        for layer in self.noise_refiner:
            x = layer(x, image_rope, temb)
        x = torch.cat([x, caption], dim=1)
        freqs = self._rope_tables(torch.cat([image_freqs, caption_freqs]))
        for layer in self.layers:
            x = layer(x, freqs, temb)
        return self.all_final_layer[self.config.patch_key](x, temb)[:, :num_tokens]


def _pad_rows(x: torch.Tensor, length: int) -> torch.Tensor:
    """Pad the token axis (-2) to `length` by repeating the last token (its value is replaced after embedding)."""
    extra = length - x.shape[-2]
    if extra == 0:
        return x
    return torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], extra, x.shape[-1])], dim=-2)


def _fill_padding(x: torch.Tensor, num_real: int, pad_token: torch.Tensor) -> torch.Tensor:
    if x.shape[-2] == num_real:
        return x
    pad = pad_token.to(x.dtype).expand(*x.shape[:-2], x.shape[-2] - num_real, x.shape[-1])
    return torch.cat([x[..., :num_real, :], pad], dim=-2)


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """`[B, C, H, W]` -> tokens `[B, (H/p)·(W/p), p·p·C]` (feature order: patch row, patch column, channel)."""
    batch, channels, height, width = latents.shape
    x = latents.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(batch, (height // patch) * (width // patch), patch * patch * channels)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """The inverse of `patchify` for a token grid of `height` × `width`."""
    batch, _, features = tokens.shape
    channels = features // (patch * patch)
    x = tokens.reshape(batch, height, width, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(batch, channels, height * patch, width * patch)
