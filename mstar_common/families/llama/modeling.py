"""Llama dense causal LMs (LlamaForCausalLM: Llama-3.x, and backbones built on it such as Orpheus).

The same decoder as Qwen3 (`layers/causal_lm.py`) without the per-head q/k norm, with RoPE frequency scaling
when the config asks for it (`rope_type: llama3`, `linear` or `yarn`). Module names mirror HF, so checkpoints load
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_common.layers.causal_lm import DenseCausalLM, DenseLMConfig


class LlamaConfig(DenseLMConfig):
    __slots__ = ()

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        if config.get("pretraining_tp", 1) != 1:
            raise ValueError(f"pretraining_tp={config['pretraining_tp']} is not supported: only 1 is")
        return cls.read_hf(config, qk_norm=False, scaled_rope=True)


class LlamaForCausalLM(DenseCausalLM):
    """Llama on the shared decoder-only LM; implements the engine's `CausalLM` contract."""
