"""Loads a FLUX.2 [klein] checkpoint in diffusers layout into this family's modules, one component at a time.

    <checkpoint>/model_index.json            Flux2KleinPipeline, is_distilled
                 transformer/  config.json + diffusion_pytorch_model[-0000N-of-0000M].safetensors (+ index)
                 vae/          config.json + diffusion_pytorch_model.safetensors
                 text_encoder/ config.json (Qwen3) + model[-…].safetensors (+ index)
                 tokenizer/    tokenizer.json, tokenizer_config.json, chat template
                 scheduler/    scheduler_config.json

Coverage is checked both ways (`mstar_common/diffusion/diffusers_checkpoint.load_module`): a parameter or buffer
the checkpoint does not fill fails the load, and so does a checkpoint tensor that nothing reads, except the tensors
a component knowingly skips (the text encoder's layers past its deepest tap and its LM head; the VAE half a
component does not serve).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mstar_common.diffusion import diffusers_checkpoint, dit_lora
from mstar_common.diffusion.diffusers_checkpoint import check_pipeline_class, load_module, read_json
from mstar_common.diffusion.image_options import LoraAdapter
from mstar_common.families.flux2_klein.scheduler import FlowSchedulerConfig
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.flux2_klein.transformer import Flux2Transformer, Flux2TransformerConfig
from mstar_common.families.flux2_klein.vae import Flux2VaeConfig, VaeDecoder, VaeEncoder, use_fused_group_norm
from mstar_common.families.qwen3.modeling import Qwen3Config

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_pipeline(root: Path) -> dict[str, Any]:
    """model_index.json must name a distilled klein pipeline (the step-distilled sampler runs without CFG)."""
    index = check_pipeline_class(root, PIPELINE_CLASSES, "flux2_klein")
    if not index.get("is_distilled", False):
        raise ValueError("model_index.json is_distilled=false: the base (CFG) klein models are not served; "
                         "use a step-distilled klein checkpoint")
    return index


def text_encoder_config(root: Path) -> Qwen3Config:
    return diffusers_checkpoint.qwen3_text_encoder_config(root)


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


def load_transformer(root: Path, dtype: str, device: str, lora: Sequence[LoraAdapter] = ()) -> Flux2Transformer:
    """The DiT, with the `lora` adapters folded into its weights (fp32 sums, rounded once to `dtype`)."""
    config = transformer_config(root)
    return dit_lora.load_dit(lambda: Flux2Transformer(config), root, dtype, device, lora)


def check_lora(root: Path, lora: Sequence[LoraAdapter]) -> None:
    """The `lora` adapters against this checkpoint's DiT, from their headers (a ValueError names the file and rule)."""
    config = transformer_config(root)
    dit_lora.check_adapters(lora, lambda: Flux2Transformer(config))


def load_vae_encoder(root: Path, dtype: str, device: str) -> VaeEncoder:
    config = vae_config(root)
    model = load_module(lambda: VaeEncoder(config), root / "vae", "diffusion_pytorch_model",
                        lambda name: name.startswith(("decoder.", "post_quant_conv.")), dtype, device)
    use_fused_group_norm(model, diffusers_checkpoint.kernels_enabled(device))
    return model


def load_vae_decoder(root: Path, dtype: str, device: str) -> VaeDecoder:
    config = vae_config(root)
    model = diffusers_checkpoint.load_vae_decoder(lambda: VaeDecoder(config), root, dtype, device)
    use_fused_group_norm(model, diffusers_checkpoint.kernels_enabled(device))
    return model
