"""The Z-Image-Turbo family (diffusers layout: Qwen3-4B caption encoder, 6B single-stream DiT, FLUX.1 VAE):
deployment checks and the builders of its walk and three components. The graph is drawn in `graph.py`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError
from mstar_common.families.base import Family
from mstar_common.families.z_image_turbo.graph import GRAPH
from mstar_common.families.z_image_turbo.options import ZImageTurboOptions, options_from_kwargs

logger = logging.getLogger(__name__)


def _build_tiny(out_dir: Path) -> Path:
    from mstar_common.families.z_image_turbo.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out_dir)


class ZImageTurboFamily(Family):
    name: ClassVar[str] = "z_image_turbo"
    graph = GRAPH
    proxy_kind: ClassVar[str] = "image"
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"z-image-turbo-tiny": _build_tiny}

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        options_from_kwargs(dep.model_kwargs, source)
        for name, comp in dep.components.items():
            if comp.cuda_graphs and name != "denoise":
                raise DeploymentError(f"{source}: components.{name}.cuda_graphs: only the denoise step is captured")
        if dep.components["walk"].placement.device != "cpu":
            raise DeploymentError(f"{source}: components.walk.placement: the walk router runs on the cpu")

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        options = options_from_kwargs(dep.model_kwargs, dep.name)
        builders = {"walk": _walk, "text_encoder": _text_encoder, "denoise": _denoise, "vae_decode": _vae_decode}
        if component not in builders:
            raise KeyError(f"z_image_turbo has no component {component!r}; it has {sorted(builders)}")
        from mstar_common.families.z_image_turbo import loader

        loader.check_pipeline(checkpoint)
        runtime = builders[component](dep, options, checkpoint, device)
        logger.info("[z_image_turbo/%s] loaded %s on %s (%s)", component, checkpoint.name, device,
                    options.dtype_for(device))
        return runtime


def _multiple(checkpoint: Path) -> int:
    """Pixels per DiT token side: the VAE's downscale times the DiT's patch."""
    from mstar_common.families.z_image_turbo.loader import transformer_config, vae_config

    return vae_config(checkpoint).scale_factor * transformer_config(checkpoint).patch_size


def _walk(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from transformers import AutoTokenizer

    from ensembles.z_image_turbo import ZImageTurboWalk

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"))
    if tokenizer.pad_token_id is None:
        raise DeploymentError("checkpoint tokenizer has no pad token; the text encoder input is padded to 512")
    if getattr(tokenizer, "padding_side", "right") != "right":
        tokenizer.padding_side = "right"  # the text encoder keeps the first text_len rows
    return ZImageTurboWalk(tokenizer, options, multiple=_multiple(checkpoint))


def _text_encoder(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import TextEncoderComponent
    from mstar_common.families.z_image_turbo.loader import load_text_encoder, text_encoder_config, transformer_config

    width, cap_dim = text_encoder_config(checkpoint).hidden_size, transformer_config(checkpoint).cap_feat_dim
    if width != cap_dim:
        raise DeploymentError(f"checkpoint: text_encoder hidden_size={width} does not match the transformer's "
                              f"cap_feat_dim={cap_dim}")
    model = load_text_encoder(checkpoint, options.dtype_for(device), device)
    return TextEncoderComponent(model, device, options.text_encoder_max_batch)


def _vae_decode(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import VaeDecodeComponent
    from mstar_common.families.z_image_turbo.loader import load_vae_decoder

    model = load_vae_decoder(checkpoint, options.dtype_for(device), device)
    return VaeDecodeComponent(model, device, options.vae_max_batch, options.max_image_area)


def _denoise(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import DenoiseComponent, DenoiseLimits
    from mstar_common.families.z_image_turbo.loader import load_transformer, scheduler_config

    limits = DenoiseLimits(multiple=_multiple(checkpoint), max_area=options.max_image_area,
                           max_images=options.max_images_per_request, max_steps=options.max_inference_steps,
                           default_steps=options.default_num_inference_steps)
    model = load_transformer(checkpoint, options.dtype_for(device), device)
    runtime = DenoiseComponent(model, scheduler_config(checkpoint), limits, device, options.max_batch_size)
    if dep.components["denoise"].cuda_graphs and device.startswith("cuda"):
        capture_denoise_graphs(runtime, options)
    return runtime


def capture_denoise_graphs(runtime, options: ZImageTurboOptions, capture: bool = True) -> None:
    """Capture the denoise step per `capture_sizes` × `capture_caption_tokens` × `capture_batch_sizes`."""
    from mstar_common.families.z_image_turbo.components import Layout
    from mstar_common.images import parse_size

    multiple = runtime.limits.multiple
    layouts = [Layout(height // multiple, width // multiple, tokens)
               for width, height in map(parse_size, options.capture_sizes) for tokens in options.capture_caption_tokens]
    runtime.stepper.capture(layouts, options.capture_batch_sizes, capture=capture)
