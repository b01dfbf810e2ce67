"""The FLUX.2 VAE, split into its two serving halves: encode (reference images) and decode (outputs).

    encode: pixels [B, 3, H, W] in [-1, 1] ─ conv_in ─ down blocks (ResNet ×L, stride-2 conv) ─ mid (ResNet,
            attention, ResNet) ─ GroupNorm·SiLU·conv_out ─ quant_conv ─ mean half (the reference's argmax)
            ─ 2×2 patchify ─ BatchNorm-statistics normalise ─▶ latent tokens [B, H/16 · W/16, 4·latent_channels]
    decode: the inverse: denormalise ─ unpatchify ─ post_quant_conv ─ conv_in ─ mid ─ up blocks (ResNet ×(L+1),
            nearest ×2 + conv) ─ GroupNorm·SiLU·conv_out ─▶ [B, 3, H, W] ─ to uint8 RGB [B, H, W, 3]

Module names mirror diffusers' `AutoencoderKLFlux2` (`encoder.down_blocks.0.resnets.0.conv1`, `bn.running_var`,
...) so each half loads its part of `vae/` by name; the arithmetic order matches, so fp32 output is
bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_EPS = 1e-6  # GroupNorm eps of every ResNet, attention and output norm in the reference


@dataclass(frozen=True, slots=True)
class Flux2VaeConfig:
    in_channels: int
    out_channels: int
    block_out_channels: tuple[int, ...]
    decoder_block_out_channels: tuple[int, ...]
    layers_per_block: int
    latent_channels: int
    norm_num_groups: int
    mid_block_add_attention: bool
    use_quant_conv: bool
    use_post_quant_conv: bool
    batch_norm_eps: float
    patch_size: tuple[int, int]

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> Flux2VaeConfig:
        if config.get("act_fn", "silu") != "silu":
            raise ValueError(f"vae act_fn={config['act_fn']!r} is not supported: only 'silu' is")
        blocks = tuple(config.get("block_out_channels", (128, 256, 512, 512)))
        for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            types = tuple(config.get(key, (want,) * len(blocks)))
            if set(types) != {want} or len(types) != len(blocks):
                raise ValueError(f"vae {key}={list(types)} is not supported: {len(blocks)} × {want!r} only")
        patch = tuple(config.get("patch_size", (2, 2)))
        if patch != (2, 2):
            raise ValueError(f"vae patch_size={list(patch)} is not supported: only [2, 2] is")
        return cls(
            in_channels=config.get("in_channels", 3),
            out_channels=config.get("out_channels", 3),
            block_out_channels=blocks,
            decoder_block_out_channels=tuple(config.get("decoder_block_out_channels") or blocks),
            layers_per_block=config.get("layers_per_block", 2),
            latent_channels=config.get("latent_channels", 32),
            norm_num_groups=config.get("norm_num_groups", 32),
            mid_block_add_attention=bool(config.get("mid_block_add_attention", True)),
            use_quant_conv=bool(config.get("use_quant_conv", True)),
            use_post_quant_conv=bool(config.get("use_post_quant_conv", True)),
            batch_norm_eps=float(config.get("batch_norm_eps", 1e-4)),
            patch_size=patch,
        )

    @property
    def scale_factor(self) -> int:
        """Pixels per latent pixel (before the 2×2 patchify)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def token_channels(self) -> int:
        return self.latent_channels * math.prod(self.patch_size)


# building blocks


def _norm_silu(norm: nn.GroupNorm, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """`silu(norm(x))`; `fused` (a GPU): one mstar_kernels/group_norm.py call that splits each group over many
    programs."""
    if fused:
        from mstar_kernels.group_norm import group_norm

        return group_norm(x.contiguous(), norm.num_groups, norm.weight, norm.bias, norm.eps, silu=True)
    return F.silu(norm(x))


def use_fused_group_norm(model: nn.Module, enabled: bool = True) -> None:
    """Every GroupNorm+SiLU of an encoder or decoder through mstar_kernels/group_norm.py (CUDA only)."""
    for module in model.modules():
        if isinstance(module, (ResnetBlock, Encoder, Decoder)):
            module.fused = enabled


class ResnetBlock(nn.Module):
    fused = False

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=_EPS, affine=True)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=1, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=_EPS, affine=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1)
        self.conv_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.conv1(_norm_silu(self.norm1, x, self.fused))
        hidden = self.conv2(_norm_silu(self.norm2, hidden, self.fused))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return x + hidden


class SpatialAttention(nn.Module):
    """Single-head self-attention over the H·W positions, with a GroupNorm in front and a residual."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=_EPS, affine=True)
        self.to_q, self.to_k, self.to_v = (nn.Linear(channels, channels) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        hidden = x.view(batch, channels, height * width).transpose(1, 2)
        hidden = self.group_norm(hidden.transpose(1, 2)).transpose(1, 2)
        query, key, value = (proj(hidden).view(batch, -1, 1, channels).transpose(1, 2)
                             for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, channels).to(query.dtype)
        out = self.to_out[0](out).transpose(-1, -2).reshape(batch, channels, height, width)
        return out + x


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, add_attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups), ResnetBlock(channels, channels, groups)])
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)]) if add_attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class _Conv(nn.Module):
    """Holds a conv named `conv`, as the reference's Downsample2D/Upsample2D do."""

    def __init__(self, channels: int, stride: int, padding: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=stride, padding=padding)


class Downsample(_Conv):
    def __init__(self, channels: int) -> None:
        super().__init__(channels, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(_Conv):
    def __init__(self, channels: int) -> None:
        super().__init__(channels, stride=1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class ResampleBlock(nn.Module):
    """`num_layers` ResNets, then an optional down- or upsampler (DownEncoderBlock2D / UpDecoderBlock2D)."""

    def __init__(self, in_channels: int, out_channels: int, num_layers: int, groups: int,
                 resample: type[_Conv] | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, groups) for i in range(num_layers)
        )
        samplers = nn.ModuleList([resample(out_channels)]) if resample else None
        if resample is Upsample:
            self.upsamplers = samplers
        else:
            self.downsamplers = samplers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        samplers = getattr(self, "upsamplers", None) or getattr(self, "downsamplers", None)
        return samplers[0](x) if samplers is not None else x


class Encoder(nn.Module):
    fused = False

    def __init__(self, config: Flux2VaeConfig) -> None:
        super().__init__()
        channels, groups = config.block_out_channels, config.norm_num_groups
        self.conv_in = nn.Conv2d(config.in_channels, channels[0], 3, stride=1, padding=1)
        self.down_blocks = nn.ModuleList(
            ResampleBlock(channels[max(i - 1, 0)], channels[i], config.layers_per_block, groups,
                          Downsample if i < len(channels) - 1 else None)
            for i in range(len(channels))
        )
        self.mid_block = MidBlock(channels[-1], groups, config.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(groups, channels[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(channels[-1], 2 * config.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(_norm_silu(self.conv_norm_out, x, self.fused))


class Decoder(nn.Module):
    fused = False

    def __init__(self, config: Flux2VaeConfig) -> None:
        super().__init__()
        channels, groups = list(reversed(config.decoder_block_out_channels)), config.norm_num_groups
        self.conv_in = nn.Conv2d(config.latent_channels, channels[0], 3, stride=1, padding=1)
        self.mid_block = MidBlock(channels[0], groups, config.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            ResampleBlock(channels[max(i - 1, 0)], channels[i], config.layers_per_block + 1, groups,
                          Upsample if i < len(channels) - 1 else None)
            for i in range(len(channels))
        )
        self.conv_norm_out = nn.GroupNorm(groups, channels[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(channels[-1], config.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            z = block(z)
        return self.conv_out(_norm_silu(self.conv_norm_out, z, self.fused))


class _LatentStats(nn.Module):
    """The BatchNorm running statistics that (de)normalise patchified latents (named `bn` like the reference)."""

    def __init__(self, channels: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def std(self, like: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.running_var.view(1, -1, 1, 1) + self.eps).to(like.device, like.dtype)

    def mean(self, like: torch.Tensor) -> torch.Tensor:
        return self.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)


# the two serving halves


class VaeEncoder(nn.Module):
    def __init__(self, config: Flux2VaeConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        ch = 2 * config.latent_channels
        self.quant_conv = nn.Conv2d(ch, ch, 1) if config.use_quant_conv else None
        self.bn = _LatentStats(config.token_channels, config.batch_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """`[B, 3, H, W]` in [-1, 1] -> normalised latent tokens `[B, (H/16)·(W/16), token_channels]`."""
        moments = self.encoder(pixels)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        latents = patchify(torch.chunk(moments, 2, dim=1)[0])
        latents = (latents - self.bn.mean(latents)) / self.bn.std(latents)
        return pack(latents)


class VaeDecoder(nn.Module):
    def __init__(self, config: Flux2VaeConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = Decoder(config)
        lc = config.latent_channels
        self.post_quant_conv = nn.Conv2d(lc, lc, 1) if config.use_post_quant_conv else None
        self.bn = _LatentStats(config.token_channels, config.batch_norm_eps)

    def forward(self, tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latent tokens `[B, h·w, token_channels]` of a (height, width) image -> uint8 RGB `[B, height, width, 3]`."""
        factor = 2 * self.config.scale_factor
        latents = unpack(tokens, height // factor, width // factor)
        latents = unpatchify(latents * self.bn.std(latents) + self.bn.mean(latents))
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return to_uint8(self.decoder(latents))


def patchify(latents: torch.Tensor) -> torch.Tensor:
    batch, channels, height, width = latents.shape
    latents = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return latents.reshape(batch, channels * 4, height // 2, width // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    batch, channels, height, width = latents.shape
    latents = latents.reshape(batch, channels // 4, 2, 2, height, width).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(batch, channels // 4, height * 2, width * 2)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """`[B, C, h, w]` -> `[B, h·w, C]` (raster order, the order of the position ids)."""
    batch, channels, height, width = latents.shape
    return latents.reshape(batch, channels, height * width).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    batch, _, channels = tokens.shape
    return tokens.reshape(batch, height, width, channels).permute(0, 3, 1, 2)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """`[B, 3, H, W]` in [-1, 1] -> `[B, H, W, 3]` uint8 with the reference's rounding (half to even)."""
    images = (images * 0.5 + 0.5).clamp(0, 1)
    return (images.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8)
