"""Loads a FLUX.2 [klein] checkpoint in diffusers layout into this family's modules, one component at a time.

    <checkpoint>/model_index.json            Flux2KleinPipeline, is_distilled
                 transformer/  config.json + diffusion_pytorch_model[-0000N-of-0000M].safetensors (+ index)
                 vae/          config.json + diffusion_pytorch_model.safetensors
                 text_encoder/ config.json (Qwen3) + model[-…].safetensors (+ index)
                 tokenizer/    tokenizer.json, tokenizer_config.json, chat template
                 scheduler/    scheduler_config.json

Coverage is checked both ways: a parameter or buffer the checkpoint does not fill fails the load, and so
does a checkpoint tensor that nothing reads, except the tensors a component knowingly skips (the text
encoder's layers past its deepest tap and its LM head; the VAE half a component does not serve).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar_common.families.flux2_klein.scheduler import FlowSchedulerConfig
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.flux2_klein.transformer import Flux2Transformer, Flux2TransformerConfig
from mstar_common.families.flux2_klein.vae import Flux2VaeConfig, VaeDecoder, VaeEncoder
from mstar_common.families.qwen3.modeling import Qwen3Config
from mstar_common.safetensors_io import format_names, iter_tensors

logger = logging.getLogger(__name__)

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path.parent.name}/{path.name}")
    return json.loads(path.read_text())


def check_pipeline(root: Path) -> dict[str, Any]:
    """model_index.json must name a distilled klein pipeline (the step-distilled sampler runs without CFG)."""
    index = read_json(root / "model_index.json")
    if index.get("_class_name") not in PIPELINE_CLASSES:
        raise ValueError(f"model_index.json _class_name={index.get('_class_name')!r}: flux2_klein serves "
                         f"{list(PIPELINE_CLASSES)}")
    if not index.get("is_distilled", False):
        raise ValueError("model_index.json is_distilled=false: the base (CFG) klein models are not served; "
                         "use a step-distilled klein checkpoint")
    return index


def text_encoder_config(root: Path) -> Qwen3Config:
    raw = read_json(root / "text_encoder" / "config.json")
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"text_encoder/config.json model_type={raw.get('model_type')!r}: only 'qwen3' is supported")
    return Qwen3Config.from_hf(raw)


def transformer_config(root: Path) -> Flux2TransformerConfig:
    return Flux2TransformerConfig.from_diffusers(read_json(root / "transformer" / "config.json"))


def vae_config(root: Path) -> Flux2VaeConfig:
    return Flux2VaeConfig.from_diffusers(read_json(root / "vae" / "config.json"))


def scheduler_config(root: Path) -> FlowSchedulerConfig:
    return FlowSchedulerConfig.from_diffusers(read_json(root / "scheduler" / "scheduler_config.json"))


def load_text_encoder(root: Path, taps: tuple[int, ...], dtype: str, device: str) -> Qwen3TapEncoder:
    config = text_encoder_config(root)
    deepest = max(taps) if taps else 0

    def skipped(name: str) -> bool:
        layer = _LAYER.match(name)
        if layer:
            return int(layer.group(1)) >= deepest
        return name == "lm_head.weight" or (name == "model.norm.weight" and deepest < config.num_hidden_layers)

    return load_module(lambda: Qwen3TapEncoder(config, taps), root / "text_encoder", "model", skipped, dtype, device)


def load_transformer(root: Path, dtype: str, device: str) -> Flux2Transformer:
    config = transformer_config(root)
    return load_module(lambda: Flux2Transformer(config), root / "transformer", "diffusion_pytorch_model",
                 lambda _: False, dtype, device)


def load_vae_encoder(root: Path, dtype: str, device: str) -> VaeEncoder:
    config = vae_config(root)
    return load_module(lambda: VaeEncoder(config), root / "vae", "diffusion_pytorch_model",
                 lambda name: name.startswith(("decoder.", "post_quant_conv.")), dtype, device)


def load_vae_decoder(root: Path, dtype: str, device: str) -> VaeDecoder:
    config = vae_config(root)
    return load_module(lambda: VaeDecoder(config), root / "vae", "diffusion_pytorch_model",
                 lambda name: name.startswith(("encoder.", "quant_conv.")), dtype, device)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@torch.no_grad()
def load_module(build: Callable[[], nn.Module], folder: Path, stem: str, skipped: Callable[[str], bool],
                dtype: str, device: str, rename: Callable[[str], str] | None = None) -> Any:
    """Build a module and fill it from a diffusers/HF safetensors folder (checkpoint names, after `rename`,
    are module names), checking coverage both ways."""
    # Build on meta and materialise uninitialised: random init of a multi-billion-parameter model costs seconds.
    with torch.device("meta"):
        module = build()
    module = module.to(dtype=resolve_dtype(dtype)).to_empty(device=device)
    targets = module.state_dict(keep_vars=True)
    filled: set[str] = set()
    unused: list[str] = []
    for name, tensor in iter_tensors(folder, stem):
        name = rename(name) if rename is not None else name
        if name in targets:
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{folder.name}/{name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.data.copy_(tensor)
            filled.add(name)
        elif not skipped(name):
            unused.append(name)
    missing = sorted(set(targets) - filled)
    if missing or unused:
        raise ValueError(f"checkpoint folder {folder.name} does not match {type(module).__name__}: missing "
                         f"{format_names(missing)}; unused checkpoint tensors {format_names(sorted(unused))}")
    logger.info("loaded %s from %s (%d tensors)", type(module).__name__, folder.name, len(filled))
    return module.eval()


