"""Loads a Z-Image-Turbo checkpoint in diffusers layout into this family's modules, one component at a time.

    <checkpoint>/model_index.json            ZImagePipeline
                 transformer/  config.json + diffusion_pytorch_model[-0000N-of-0000M].safetensors (+ index)
                 vae/          config.json + diffusion_pytorch_model.safetensors  (AutoencoderKL, FLUX.1)
                 text_encoder/ config.json (Qwen3) + model[-…].safetensors (+ index)
                 tokenizer/    tokenizer.json, tokenizer_config.json, chat template
                 scheduler/    scheduler_config.json

Coverage is checked both ways (see `mstar_common/diffusion/diffusers_checkpoint.load_module`), except for the
tensors a component knowingly skips: the text encoder's last layer, final norm and LM head (the pipeline reads the
second-to-last hidden state) and the VAE encoder. The text encoder may be saved as `Qwen3Model` (`layers.N...`) or
`Qwen3ForCausalLM` (`model.layers.N...`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mstar_common.diffusion import diffusers_checkpoint, dit_lora
from mstar_common.diffusion.diffusers_checkpoint import check_pipeline_class, load_module, read_json
from mstar_common.diffusion.image_options import LoraAdapter
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.flux2_klein.vae import use_fused_group_norm
from mstar_common.families.qwen3.modeling import Qwen3Config
from mstar_common.families.z_image_turbo.scheduler import ZImageSchedulerConfig
from mstar_common.families.z_image_turbo.transformer import ZImageTransformer, ZImageTransformerConfig
from mstar_common.families.z_image_turbo.vae import Flux1VaeConfig, VaeDecoder

PIPELINE_CLASSES = ("ZImagePipeline",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_pipeline(root: Path) -> dict[str, Any]:
    return check_pipeline_class(root, PIPELINE_CLASSES, "z_image_turbo")


def text_encoder_config(root: Path) -> Qwen3Config:
    return diffusers_checkpoint.qwen3_text_encoder_config(root)


def caption_layer(config: Qwen3Config) -> int:
    """The layer whose output the pipeline feeds the DiT: `hidden_states[-2]`, the second-to-last layer's."""
    if config.num_hidden_layers < 2:
        raise ValueError("text_encoder has fewer than 2 layers: the caption is its second-to-last hidden state")
    return config.num_hidden_layers - 1


def transformer_config(root: Path) -> ZImageTransformerConfig:
    return ZImageTransformerConfig.from_diffusers(read_json(root / "transformer" / "config.json"))


def vae_config(root: Path) -> Flux1VaeConfig:
    return Flux1VaeConfig.from_diffusers(read_json(root / "vae" / "config.json"))


def scheduler_config(root: Path) -> ZImageSchedulerConfig:
    return ZImageSchedulerConfig.from_diffusers(read_json(root / "scheduler" / "scheduler_config.json"))


def load_text_encoder(root: Path, dtype: str, device: str) -> Qwen3TapEncoder:
    config = text_encoder_config(root)
    tap = caption_layer(config)

    def skipped(name: str) -> bool:
        layer = _LAYER.match(name)
        if layer:
            return int(layer.group(1)) >= tap
        return name in ("lm_head.weight", "model.norm.weight")

    def rename(name: str) -> str:  # Qwen3Model checkpoints carry no `model.` prefix
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"

    return load_module(lambda: Qwen3TapEncoder(config, (tap,)), root / "text_encoder", "model", skipped, dtype,
                       device, rename=rename)


def load_transformer(root: Path, dtype: str, device: str, lora: Sequence[LoraAdapter] = ()) -> ZImageTransformer:
    """The DiT, with the `lora` adapters folded into its weights (fp32 sums, rounded once to `dtype`)."""
    config = transformer_config(root)
    return dit_lora.load_dit(lambda: ZImageTransformer(config), root, dtype, device, lora)


def check_lora(root: Path, lora: Sequence[LoraAdapter]) -> None:
    """The `lora` adapters against this checkpoint's DiT, from their headers (a ValueError names the file and rule)."""
    config = transformer_config(root)
    dit_lora.check_adapters(lora, lambda: ZImageTransformer(config))


def load_vae_decoder(root: Path, dtype: str, device: str) -> VaeDecoder:
    config = vae_config(root)
    model = diffusers_checkpoint.load_vae_decoder(lambda: VaeDecoder(config), root, dtype, device)
    use_fused_group_norm(model, diffusers_checkpoint.kernels_enabled(device))
    return model
