"""Llama causal LM (Llama-3.2-3B is Orpheus' backbone) on the shared `DecoderOnlyLM`.

A stopgap until the shared Llama text model lands in `mstar_common/families/llama/` (TODO [#3]: switch to
it). What Llama adds to the shared decoder is Llama-3 RoPE frequency scaling (`rope_type: llama3`: long
wavelengths divided by `factor`, a smooth ramp between the two bands), which the shared rotary refuses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mstar_common.families.qwen3.loader import materialize_and_fill
from mstar_common.layers.causal_lm import DecoderOnlyLM
from mstar_common.layers.decoder import DecoderLayerConfig
from mstar_common.layers.rotary import RotaryEmbedding


class Llama3Rotary(RotaryEmbedding):
    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, float] | None) -> None:
        super().__init__(head_dim, theta)
        self.scaling = scaling
        self._scaled: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._scaled is None or self._scaled.device != device:
            inv_freq = super().inv_freq(device)
            self._scaled = inv_freq if self.scaling is None else llama3_scale(inv_freq, self.scaling)
        return self._scaled


def llama3_scale(inv_freq: torch.Tensor, s: Mapping[str, float]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _rope(config: Mapping[str, Any]) -> tuple[float, dict | None]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_type={rope_type!r} is not supported (default or llama3)")
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, rope if rope_type == "llama3" else None


def build_llama(config: Mapping[str, Any]) -> DecoderOnlyLM:
    """An HF Llama `config.json` -> the shared decoder (on the current default device) with Llama-3 RoPE."""
    if config.get("model_type") != "llama":
        raise ValueError(f"config.json model_type must be 'llama', got {config.get('model_type')!r}")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("only silu Llama models without attention/MLP biases are supported")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    layer = DecoderLayerConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-5), qk_norm=False,
    )
    theta, scaling = _rope(config)
    model = DecoderOnlyLM(layer, config["num_hidden_layers"], config["vocab_size"], theta,
                          config["max_position_embeddings"], bool(config.get("tie_word_embeddings", False)))
    model.model.rotary = Llama3Rotary(head_dim, theta, scaling)
    return model


def load_llama(path: str | Path, dtype: str = "float32", device: str = "cpu") -> tuple[DecoderOnlyLM, dict]:
    """Meta-built, materialised uninitialised, filled by HF names (coverage checked both ways)."""
    path = Path(path)
    hf_config = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        model = build_llama(hf_config)
    materialize_and_fill(model, path, dtype, device, fuse_projections=True)
    return model.eval(), hf_config
