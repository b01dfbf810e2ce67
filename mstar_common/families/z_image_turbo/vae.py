"""The FLUX.1 VAE decoder (diffusers `AutoencoderKL` with 16 latent channels) that turns Z-Image latents into pixels.

    latents [B, 16, H/8, W/8] ─ / scaling_factor + shift_factor ─ (post_quant_conv) ─ conv_in ─ mid (ResNet,
        attention, ResNet) ─ up blocks (ResNet ×(L+1), nearest ×2 + conv) ─ GroupNorm·SiLU·conv_out
        ─▶ [B, 3, H, W] in [-1, 1] ─▶ uint8 RGB [B, H, W, 3]

The decoder network is the one FLUX.2's VAE uses too, so it is shared with `flux2_klein/vae.py`; only the latent
denormalisation differs (FLUX.1: a scalar scale and shift; FLUX.2: BatchNorm statistics over 2×2 patches).
Module names mirror diffusers' (`decoder.up_blocks.0.resnets.0.conv1`, ...), so `vae/` loads by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar_common.families.flux2_klein.vae import Decoder, Flux2VaeConfig, to_uint8


@dataclass(frozen=True, slots=True)
class Flux1VaeConfig:
    network: Flux2VaeConfig  # the encoder/decoder geometry (shared with FLUX.2)
    scaling_factor: float
    shift_factor: float

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> Flux1VaeConfig:
        name = config.get("_class_name", "AutoencoderKL")
        if name != "AutoencoderKL":
            raise ValueError(f"vae _class_name={name!r}: z_image_turbo decodes with an AutoencoderKL (FLUX.1 VAE)")
        for key in ("latents_mean", "latents_std"):
            if config.get(key) is not None:
                raise ValueError(f"vae {key} is set: per-channel latent statistics are not supported")
        for key, value in (("shift_factor", 0.1159), ("scaling_factor", 0.3611)):
            if config.get(key) is None:  # diffusers' AutoencoderKL would take its own default (scaling 0.18215)
                raise ValueError(f"vae {key} is missing: the FLUX.1 VAE config has one ({value})")
        return cls(network=Flux2VaeConfig.from_diffusers({**config, "patch_size": (2, 2)}),
                   scaling_factor=float(config["scaling_factor"]),
                   shift_factor=float(config["shift_factor"]))

    @property
    def scale_factor(self) -> int:
        """Pixels per latent pixel."""
        return self.network.scale_factor

    @property
    def latent_channels(self) -> int:
        return self.network.latent_channels


class VaeDecoder(nn.Module):
    def __init__(self, config: Flux1VaeConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = Decoder(config.network)
        channels = config.latent_channels
        self.post_quant_conv = nn.Conv2d(channels, channels, 1) if config.network.use_post_quant_conv else None

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `[B, C, h, w]` (the sampler's, unscaled) -> uint8 RGB `[B, 8h, 8w, 3]`."""
        latents = latents / self.config.scaling_factor + self.config.shift_factor
        if self.post_quant_conv is not None:
            latents = self.post_quant_conv(latents)
        return to_uint8(self.decoder(latents))
