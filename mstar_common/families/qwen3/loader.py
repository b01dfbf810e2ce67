"""Loads an HF Qwen3 checkpoint (config.json + safetensors, single file or sharded) into `Qwen3ForCausalLM`.

Coverage is checked both ways: a parameter the checkpoint does not fill, or a checkpoint tensor nothing
reads, fails the load with the names. With tied embeddings the checkpoint may omit `lm_head.weight` (HF
`save_pretrained` does) or carry a copy, which must then equal the embedding.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from mstar_common.engine.attention import AttentionBackend
from mstar_common.families.qwen3.modeling import Qwen3Config, Qwen3ForCausalLM
from mstar_common.safetensors_io import copy_checked, format_names, iter_tensors

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL_TYPES = ("qwen3",)
_TIED_HEAD = "lm_head.weight"
# RoPE tables that checkpoints saved by older transformers (and some trainers) carry as buffers; they are derived
# from config.json, which the model computes them from, so they are skipped as transformers skips them.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq", ".rotary_emb.cos_cached", ".rotary_emb.sin_cached")


def load_qwen3(
    checkpoint_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | None = None,
    fuse_projections: bool = True,
) -> tuple[Qwen3ForCausalLM, dict[str, Any]]:
    """Build the model on `device` in `dtype` from the checkpoint; returns it (in eval mode) and config.json.

    With `fuse_projections` (the default) q/k/v and gate/up are packed into single GEMMs after loading."""
    return load_dense_lm(checkpoint_dir, Qwen3Config, Qwen3ForCausalLM, _MODEL_TYPES, dtype, device, attn_backend,
                         fuse_projections)


def read_qwen3_config(hf_config: dict[str, Any]) -> Qwen3Config:
    return read_dense_config(hf_config, Qwen3Config, _MODEL_TYPES)


def load_dense_lm(checkpoint_dir: str | Path, config_cls: type, model_cls: type, model_types: tuple[str, ...],
                  dtype: str | torch.dtype, device: str | torch.device, attn_backend: AttentionBackend | None,
                  fuse_projections: bool) -> tuple[Any, dict[str, Any]]:
    """The dense families' loader: check `model_type`, read the config with `config_cls.from_hf`, build
    `model_cls` on meta, fill it (`materialize_and_fill`)."""
    path = Path(checkpoint_dir)
    hf_config = json.loads((path / "config.json").read_text())
    config = read_dense_config(hf_config, config_cls, model_types)
    with torch.device("meta"):
        model = model_cls(config, attn_backend)
    materialize_and_fill(model, path, dtype, device, fuse_projections)
    rope = f", {config.rope_scaling['rope_type']} RoPE" if config.rope_scaling else ""
    logger.info("loaded %s (%d layers, hidden %d, vocab %d%s) from %s", model_cls.__name__, config.num_hidden_layers,
                config.hidden_size, config.vocab_size, rope, path.name)
    return model.eval(), hf_config


def read_dense_config(hf_config: dict[str, Any], config_cls: type, model_types: tuple[str, ...]) -> Any:
    """`config.json` as `config_cls.from_hf` reads it, after refusing what no dense loader builds: another
    `model_type` (a MoE such as qwen3_moe, another architecture), a head other than a causal LM's (a classifier),
    quantized weights. Each refusal is a ValueError naming the config key; `mstar check` runs this too."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if model_type not in model_types:
        raise ValueError(f"model_type={model_type!r} (architectures {architectures}) is not supported: only "
                         f"{list(model_types)}, the dense *ForCausalLM checkpoints")
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        raise ValueError(f"architectures={architectures} is not supported: only a causal LM's head "
                         f"(*ForCausalLM) generates text")
    if quantization := hf_config.get("quantization_config"):
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: only unquantized "
                         f"float32/bfloat16/float16 weights are")
    return config_cls.from_hf(hf_config)


def read_eos_token_ids(checkpoint_dir: str | Path, hf_config: dict[str, Any] | None = None) -> list[int]:
    """EOS ids from generation_config.json, else config.json (`eos_token_id` may be an int or a list)."""
    path = Path(checkpoint_dir)
    generation = path / "generation_config.json"
    sources = [json.loads(generation.read_text())] if generation.exists() else []
    sources.append(hf_config if hf_config is not None else json.loads((path / "config.json").read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def materialize_and_fill(model: torch.nn.Module, path: Path, dtype: str | torch.dtype, device: str | torch.device,
                         fuse_projections: bool) -> None:
    """Give a meta-built `DecoderOnlyLM` real storage on `device`, fill it from `path` by HF names (coverage
    checked both ways), then optionally pack its projections."""
    # Built on meta and materialised uninitialised: random init of a real-size model would cost seconds.
    model.to(dtype=resolve_dtype(dtype)).to_empty(device=device)
    model.tie_weights()
    _fill(model, path)
    if fuse_projections:
        model.fuse_projections()


@torch.no_grad()
def _fill(model: torch.nn.Module, path: Path) -> None:
    params = dict(model.named_parameters())  # a tied lm_head is deduplicated away here
    is_tied = model.tie_word_embeddings
    filled: set[str] = set()
    unused: list[str] = []
    tied_copy: torch.Tensor | None = None
    for name, tensor in iter_tensors(path):
        if name in params:
            copy_checked(params[name], tensor, name)
            filled.add(name)
        elif is_tied and name == _TIED_HEAD:
            tied_copy = tensor
        elif name.endswith(_DERIVED_SUFFIXES):
            continue
        else:
            unused.append(name)
    missing = sorted(set(params) - filled)
    if missing or unused:
        raise ValueError(f"checkpoint {path.name} does not match {type(model).__name__}: missing parameters "
                         f"{format_names(missing)}; unused checkpoint tensors {format_names(sorted(unused))}")
    if tied_copy is not None and not torch.equal(tied_copy.to(params["model.embed_tokens.weight"]),
                                                 params["model.embed_tokens.weight"]):
        raise ValueError("tie_word_embeddings is true but the checkpoint's lm_head.weight differs from "
                         "model.embed_tokens.weight")



