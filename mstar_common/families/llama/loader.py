"""Loads an HF Llama checkpoint (config.json + safetensors, single file or sharded) into `LlamaForCausalLM`.

The same loading rules as Qwen3 (`families/qwen3/loader.py`): built on meta, filled by HF names with coverage
checked both ways, a tied `lm_head.weight` optional but equal to the embedding, projections packed after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar_common.engine.attention import AttentionBackend
from mstar_common.families.llama.modeling import LlamaConfig, LlamaForCausalLM
from mstar_common.families.qwen3.loader import load_dense_lm, read_dense_config

MODEL_TYPES = ("llama",)


def load_llama(
    checkpoint_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | None = None,
    fuse_projections: bool = True,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Build the model on `device` in `dtype` from the checkpoint; returns it (in eval mode) and config.json."""
    return load_dense_lm(checkpoint_dir, LlamaConfig, LlamaForCausalLM, MODEL_TYPES, dtype, device, attn_backend,
                         fuse_projections)


def read_llama_config(hf_config: dict[str, Any]) -> LlamaConfig:
    return read_dense_config(hf_config, LlamaConfig, MODEL_TYPES)
