"""Rotary position embedding (RoPE), rotate-half layout, default (unscaled) frequencies only.

Scaled variants (linear, dynamic, yarn, llama3, longrope, ...) change the frequencies or the attention scale;
serving such a checkpoint with plain RoPE would give silently wrong answers, so `rope_theta_from_config`
refuses them by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_UNSCALED_ROPE_TYPES = ("default", None)


def rope_theta_from_config(config: Mapping[str, Any]) -> float:
    """The RoPE base from an HF config dict: `rope_parameters` (transformers v5) or `rope_theta`/`rope_scaling`."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    for key, section in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = section.get("rope_type", section.get("type"))
        if rope_type not in _UNSCALED_ROPE_TYPES:
            raise ValueError(f"{key}.rope_type={rope_type!r} is not supported: only unscaled ('default') RoPE is")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: only full-width RoPE is")
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError("config has no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) `[T, head_dim]` for packed positions; `apply_rotary` rotates q and k with them.

    The angles are computed from the positions every step (T x head_dim/2 multiplies) rather than gathered
    from a table: it is as cheap, needs no max length, and matches the reference's fp32 arithmetic exactly.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        # Not a buffer: it is derived from the config, so it must survive meta-device construction and
        # never appears in (or is expected from) a checkpoint.
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            self._inv_freq = (1.0 / (self.theta**exponent)).to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by `cos`/`sin` `[T, head_dim]` (rotate-half pairing)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
