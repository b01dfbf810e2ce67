"""The Llama text family: the Qwen3 text-LM component with the Llama loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from mstar_common.families.llama.graph import GRAPH
from mstar_common.families.qwen3.family import Qwen3Family


def _build_tiny(out_dir: Path) -> Path:
    from mstar_common.families.llama.tiny import build_tiny_llama

    return build_tiny_llama(out_dir)


class LlamaFamily(Qwen3Family):
    name: ClassVar[str] = "llama"
    graph = GRAPH
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"llama-tiny": _build_tiny}

    def load_model(self, checkpoint: Path, dtype: str, device: str) -> tuple[Any, dict]:
        from mstar_common.families.llama.loader import load_llama

        return load_llama(checkpoint, dtype=dtype, device=device)

    def read_config(self, hf_config: dict) -> Any:
        from mstar_common.families.llama.loader import read_llama_config

        return read_llama_config(hf_config)
