"""Rotary position embedding (RoPE), rotate-half layout: default frequencies, and the static scalings: Llama-3's
bands, linear (position interpolation), and YaRN (NTK-by-parts frequencies, and an attention factor that
transformers multiplies into cos and sin; here it multiplies the attention's softmax scale, squared, since q and k
both carry it: the same scores, and the fused kernels' in-kernel angles need no change).

The variants that change the frequencies with the sequence's length (dynamic, longrope, ...) would give silently
wrong answers with these, so the config readers refuse them by name (`rope_theta_from_config` refuses every
scaling, `rope_from_config` all but these).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

_UNSCALED_ROPE_TYPES = ("default", None)
SCALING_KEYS = {  # rope_type -> the keys its frequencies need
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),  # and the original context (`_original_context`)
    "linear": ("factor",),
    "yarn": ("factor",),  # and `yarn_scaling`'s optional keys
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
    return _full_width_theta(config, key, section)


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
    theta = _full_width_theta(config, key, section)
    if rope_type == "yarn":
        return theta, yarn_scaling(config, key, section)
    factor = _number(key, "factor", section["factor"], "a number >= 1", lambda v: v >= 1.0)
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": factor}
    low = _number(key, "low_freq_factor", section["low_freq_factor"], "a number > 0", lambda v: v > 0)
    high = _number(key, "high_freq_factor", section["high_freq_factor"], f"a number > low_freq_factor ({low:g})",
                   lambda v: v > low)
    return theta, {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                   "original_max_position_embeddings": _original_context(config, key, section, "llama3")}


def _number(key: str | None, name: str, value: Any, rule: str, holds: Callable[[float], bool]) -> float:
    """A RoPE section's number, refused naming the key where it is none (a bool or a string included) or breaks
    `rule` (a factor of 0 would give infinite frequencies and NaN attention on every request)."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not holds(value):
        raise ValueError(f"{f'{key}.' if key else ''}{name} must be {rule}, got {value!r}")
    return float(value)


def _original_context(config: Mapping[str, Any], key: str, section: Mapping[str, Any], rope_type: str) -> float:
    """The context a llama3 or YaRN scaling was made from, where transformers takes it: the config's top level
    first (as Phi-3 stores it), then the section, then `max_position_embeddings`."""
    rule = f"a number > 0 (the context rope_type {rope_type!r} scales)"
    for where, source, name in ((None, config, "original_max_position_embeddings"),
                                (key, section, "original_max_position_embeddings"),
                                (None, config, "max_position_embeddings")):
        if source.get(name) is not None:  # named by the key it came from
            return _number(where, name, source[name], rule, lambda v: v > 0)
    return _number(key, "original_max_position_embeddings", None, rule, lambda v: v > 0)  # none: refused


def yarn_scaling(config: Mapping[str, Any], key: str, section: Mapping[str, Any]) -> dict[str, Any]:
    """A YaRN section read as transformers reads it: `original_max_position_embeddings` from the config's top level
    first (as Phi-3 stores it), then the section, then `max_position_embeddings`; `beta_fast` 32 and `beta_slow` 1
    unless given, `truncate` on unless false; `attention_factor` as given, else 0.1 ln(factor) + 1, or the ratio
    of that with `mscale` and with `mscale_all_dim` where both are given."""
    original = _original_context(config, key, section, "yarn")
    factor = section["factor"]
    if factor is None and config.get("max_position_embeddings"):  # transformers: the ratio of the two lengths
        factor = config["max_position_embeddings"] / original
    factor = _number(key, "factor", factor, "a number >= 1 for rope_type 'yarn'", lambda v: v >= 1.0)
    attention_factor = section.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = (None if section.get(name) is None else
                                  _number(key, name, section[name], "a number", lambda v: True)
                                  for name in ("mscale", "mscale_all_dim"))
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    attention_factor = _number(key, "attention_factor", attention_factor, "a number > 0", lambda v: v > 0)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            **{name: _number(key, name, section.get(name) or default, "a number > 0", lambda v: v > 0)
               for name, default in (("beta_fast", 32), ("beta_slow", 1))},
            "truncate": bool(section.get("truncate", True)), "attention_factor": attention_factor}


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What a scaling multiplies cos and sin by (YaRN's attention factor; 1 for the others)."""
    return float(scaling.get("attention_factor", 1.0)) if scaling else 1.0


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The longest context an HF config's positions serve: `max_position_embeddings`, or for YaRN the longer of
    that and `original_max_position_embeddings` x `factor`, the context the scaling was made for (Qwen3's configs
    keep 40,960 and scale 32,768 by 4 to 131,072); None where the config declares neither."""
    limit = config.get("max_position_embeddings")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"max_position_embeddings must be an integer >= 1 (the longest context the checkpoint's "
                         f"positions serve), got {limit!r}")
    try:
        _, scaling = rope_from_config(config)
    except ValueError:
        return limit
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaled = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return scaled if limit is None else max(int(limit), scaled)
    return limit


def _full_width_theta(config: Mapping[str, Any], key: str, section: Mapping[str, Any]) -> float:
    """The base from the RoPE section (v5) or the top level (v4), else transformers' default; refusing a rotation
    of part of each head (a null factor is transformers' full width)."""
    partial = section.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported: only full-width RoPE is")
    theta = section.get("rope_theta", config.get("rope_theta"))
    # (a base of 0 gave infinite frequencies: NaN attention on every request)
    return DEFAULT_THETA if theta is None else _number(key if "rope_theta" in section else None, "rope_theta",
                                                       theta, "a number > 0", lambda v: v > 0)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any], theta: float | None = None) -> torch.Tensor:
    """The frequencies of a scaling from `rope_from_config` (YaRN's needs the base, `theta`)."""
    if scaling["rope_type"] == "linear":  # position interpolation: every frequency slows down by `factor`
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        if theta is None:
            raise ValueError("yarn frequencies need the RoPE base (theta)")
        return yarn_inv_freq(2 * inv_freq.shape[0], theta, scaling)
    return llama3_inv_freq(inv_freq, scaling)


def yarn_inv_freq(dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN's NTK-by-parts frequencies, in transformers' fp32 arithmetic: the dimensions that turn more than
    `beta_fast` times over the original context keep their frequency, those that turn fewer than `beta_slow`
    times are interpolated (divided by `factor`), and a linear ramp blends the ones between."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over `original` positions
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling["beta_fast"]), dim_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


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
                inv_freq = scaled_inv_freq(inv_freq, self.scaling, self.theta)
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
