"""What the image families' tiny random checkpoints share: the Qwen3 text encoder over the offline tiny
tokenizer, and writing a pipeline to disk once, safely under concurrent callers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

REQUIRED = ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
            "tokenizer/tokenizer.json", "scheduler/scheduler_config.json")


def tiny_qwen3(model_class: type, tokenizer: Any, dims: dict[str, int]) -> Any:
    """A random transformers Qwen3 (`Qwen3Model` or `Qwen3ForCausalLM`) of `dims` over `tokenizer`, in eval mode.
    Draws from the global torch RNG: seed it first."""
    from transformers import Qwen3Config

    from mstar_common.checkpoints import vary_norms_and_biases
    from mstar_common.families.qwen3.tiny import VOCAB_MULTIPLE

    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return vary_norms_and_biases(model_class(Qwen3Config(
        vocab_size=-(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE, max_position_embeddings=1024,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=endoftext,
        initializer_range=0.2, **dims,
    )).eval())


def save_pipeline_once(out_dir: str | Path, build: Callable[[], Any]) -> Path:
    """Write `build()` (a diffusers pipeline) to `out_dir` in diffusers layout (if not there yet), return the path.

    Concurrent callers are safe (`checkpoints.write_once`)."""
    from mstar_common.checkpoints import write_once

    return write_once(out_dir, lambda tmp: build().save_pretrained(tmp, safe_serialization=True), REQUIRED)
