"""Rotary position embedding (RoPE), rotate-half layout: default frequencies, and the scalings that change only
the frequencies: Llama-3's bands and linear (position interpolation).

Other scaled variants (dynamic, yarn, longrope, ...) change the frequencies with the sequence's length or scale
the attention; serving such a checkpoint with these frequencies would give silently wrong answers, so the config
readers refuse them by name (`rope_theta_from_config` refuses every scaling, `rope_from_config` all but these).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

_UNSCALED_ROPE_TYPES = ("default", None)
SCALING_KEYS = {  # rope_type -> the keys its frequencies need
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


DEFAULT_THETA = 10000.0  # transformers' base where a config names none (Llama 2's configs carry no rope_theta)


def _rope_section(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the key, the contents) of the config's RoPE section: `rope_parameters` (transformers v5) or `rope_scaling`
    (v4). A config with both is read as one where they agree (transformers takes `rope_scaling` over the other; a
    silent pick where they differ would give other frequencies than it), refused where they do not."""
    params = dict(config.get("rope_parameters") or {})
    scaling = {("rope_type" if k == "type" else k): v for k, v in (config.get("rope_scaling") or {}).items()}
    if params and scaling:
        if clash := sorted(k for k in params.keys() & scaling.keys() if params[k] != scaling[k]):
            raise ValueError(f"rope_scaling and rope_parameters disagree on {clash} ({scaling} against {params}): "
                             "keep one section")
        return "rope_parameters", {**params, **scaling}
    return ("rope_parameters", params) if params else ("rope_scaling", scaling)


def rope_theta_from_config(config: Mapping[str, Any]) -> float:
    """The RoPE base from an HF config dict: `rope_parameters` (transformers v5) or `rope_theta`/`rope_scaling`."""
    key, section = _rope_section(config)
    rope_type = section.get("rope_type", section.get("type"))
    if rope_type not in _UNSCALED_ROPE_TYPES:
        raise ValueError(f"{key}.rope_type={rope_type!r} is not supported: only unscaled ('default') RoPE is")
    return _full_width_theta(config, section)


def rope_from_config(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from an HF config dict; the scaling is `{"rope_type": ..., <its keys>}` for the
    types in `SCALING_KEYS`, and any other scaled type is refused, naming the key it came from."""
    key, section = _rope_section(config)
    rope_type = section.get("rope_type", section.get("type"))
    if rope_type in _UNSCALED_ROPE_TYPES:
        return rope_theta_from_config(config), None
    if rope_type not in SCALING_KEYS:
        raise ValueError(f"{key}.rope_type={rope_type!r} is not supported: only 'default', "
                         f"{', '.join(repr(t) for t in SCALING_KEYS)} RoPE are")
    if missing := [k for k in SCALING_KEYS[rope_type] if k not in section]:
        raise ValueError(f"{key}: rope_type={rope_type!r} needs {missing}")
    theta = _full_width_theta(config, section)
    return theta, {"rope_type": rope_type, **{k: float(section[k]) for k in SCALING_KEYS[rope_type]}}


def _full_width_theta(config: Mapping[str, Any], section: Mapping[str, Any]) -> float:
    """The base from the RoPE section (v5) or the top level (v4), else transformers' default; refusing a rotation
    of part of each head (a null factor is transformers' full width)."""
    partial = section.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: only full-width RoPE is")
    theta = section.get("rope_theta", config.get("rope_theta"))
    return DEFAULT_THETA if theta is None else float(theta)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """The frequencies of a scaling from `rope_from_config`."""
    if scaling["rope_type"] == "linear":  # position interpolation: every frequency slows down by `factor`
        return inv_freq / scaling["factor"]
    return llama3_inv_freq(inv_freq, scaling)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, float]) -> torch.Tensor:
    """Llama-3 scaling: wavelengths above `original / low_freq_factor` slow down by `factor`, those below
    `original / high_freq_factor` stay, and the band between is interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    is_between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_between, blended, out)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) `[T, head_dim]` for packed positions; `apply_rotary` rotates q and k with them.

    The angles are computed from the positions every step (T x head_dim/2 multiplies) rather than gathered
    from a table: it is as cheap, needs no max length, and matches the reference's fp32 arithmetic exactly.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling  # from rope_from_config, or None
        # Not a buffer: it is derived from the config, so it must survive meta-device construction and
        # never appears in (or is expected from) a checkpoint.
        self._inv_freq: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            inv_freq = 1.0 / (self.theta**exponent)
            if self.scaling is not None:
                inv_freq = scaled_inv_freq(inv_freq, self.scaling)
            self._inv_freq = inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        scaled = f", {self.scaling['rope_type']} scaling" if self.scaling is not None else ""
        return f"head_dim={self.head_dim}, theta={self.theta}{scaled}"


class RopeInputs:
    """One forward's RoPE inputs, shared by its layers: the packed positions and the frequencies. `tables()`
    computes (cos, sin) `[T, head_dim]` on first use, for the eager prologue; the fused Triton prologue takes the
    angles in-kernel from `positions` and `inv_freq()` instead, so its steps launch none of the table ops."""

    __slots__ = ("positions", "rotary", "dtype", "_tables")

    def __init__(self, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        self.positions, self.rotary, self.dtype = positions, rotary, dtype
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq(self.positions.device)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary(self.positions, self.dtype)
        return self._tables


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` by `cos`/`sin` `[T, head_dim]` (rotate-half pairing)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
