"""Loads an HF Llama checkpoint (config.json + safetensors, single file or sharded) into `LlamaForCausalLM`.

The same loading rules as Qwen3 (`families/qwen3/loader.py`): built on meta, filled by HF names with coverage
checked both ways, a tied `lm_head.weight` optional but equal to the embedding, projections packed after.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from mstar_common.engine.attention import AttentionBackend
from mstar_common.families.llama.modeling import LlamaConfig, LlamaForCausalLM
from mstar_common.families.qwen3.loader import materialize_and_fill

logger = logging.getLogger(__name__)

MODEL_TYPES = ("llama",)


def load_llama(
    checkpoint_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | None = None,
    fuse_projections: bool = True,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Build the model on `device` in `dtype` from the checkpoint; returns it (in eval mode) and config.json."""
    path = Path(checkpoint_dir)
    hf_config = json.loads((path / "config.json").read_text())
    if hf_config.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"config.json model_type must be one of {MODEL_TYPES}, got {hf_config.get('model_type')!r}")
    config = LlamaConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    materialize_and_fill(model, path, dtype, device, fuse_projections)
    logger.info("loaded Llama (%d layers, hidden %d, vocab %d%s) from %s", config.num_hidden_layers,
                config.hidden_size, config.vocab_size, ", llama3 RoPE" if config.rope_scaling else "", path.name)
    return model.eval(), hf_config
