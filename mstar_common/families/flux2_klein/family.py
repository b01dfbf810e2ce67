"""The FLUX.2 [klein] family (4B and 9B checkpoints in diffusers layout): deployment checks and the builders of
its walk and four components. The graph and the request path are drawn in `graph.py`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError
from mstar_common.families.base import Family
from mstar_common.families.flux2_klein.graph import GRAPH
from mstar_common.families.flux2_klein.options import Flux2KleinOptions, options_from_kwargs

logger = logging.getLogger(__name__)


def _build_tiny(out_dir: Path) -> Path:
    from mstar_common.families.flux2_klein.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out_dir)


class Flux2KleinFamily(Family):
    name: ClassVar[str] = "flux2_klein"
    graph = GRAPH
    proxy_kind: ClassVar[str] = "image"
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"flux2-klein-tiny": _build_tiny}

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        options_from_kwargs(dep.model_kwargs, source)
        for name, comp in dep.components.items():
            if comp.cuda_graphs and name != "denoise":
                raise DeploymentError(f"{source}: components.{name}.cuda_graphs: only the denoise step is captured")
        if dep.components["walk"].placement.device != "cpu":
            raise DeploymentError(f"{source}: components.walk.placement: the walk router runs on the cpu")

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        options = options_from_kwargs(dep.model_kwargs, dep.name)
        builders = {"walk": _walk, "text_encoder": _text_encoder, "vae_encode": _vae_encode, "denoise": _denoise,
                    "vae_decode": _vae_decode}
        if component not in builders:
            raise KeyError(f"flux2_klein has no component {component!r}; it has {sorted(builders)}")
        from mstar_common.families.flux2_klein import loader

        loader.check_pipeline(checkpoint)
        runtime = builders[component](dep, options, checkpoint, device)
        logger.info("[flux2_klein/%s] loaded %s on %s (%s)", component, checkpoint.name, device,
                    options.dtype_for(device))
        return runtime


def _walk(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from transformers import AutoTokenizer

    from ensembles.flux2_klein import Flux2KleinWalk
    from mstar_common.families.flux2_klein.loader import vae_config

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"))
    if tokenizer.pad_token_id is None:
        raise DeploymentError("checkpoint tokenizer has no pad token; the text encoder input is padded to 512")
    if getattr(tokenizer, "padding_side", "right") != "right":
        tokenizer.padding_side = "right"  # the text encoder masks a right-padded tail (text_len)
    return Flux2KleinWalk(tokenizer, options, multiple=2 * vae_config(checkpoint).scale_factor)


def _text_encoder(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from mstar_common.families.flux2_klein.components import TextEncoderComponent
    from mstar_common.families.flux2_klein.loader import load_text_encoder, text_encoder_config, transformer_config
    from mstar_common.families.flux2_klein.text_encoder import check_taps

    config, taps = text_encoder_config(checkpoint), options.text_encoder_out_layers
    try:
        check_taps(taps, config.num_hidden_layers)
    except ValueError as exc:
        raise DeploymentError(f"model_kwargs.{exc}") from None
    joint = transformer_config(checkpoint).joint_attention_dim
    if len(taps) * config.hidden_size != joint:
        raise DeploymentError(f"model_kwargs.text_encoder_out_layers: {len(taps)} taps of width "
                              f"{config.hidden_size} do not make the transformer's joint_attention_dim={joint}")
    model = load_text_encoder(checkpoint, taps, options.dtype_for(device), device)
    return TextEncoderComponent(model, device, options.text_encoder_max_batch)


def _vae_encode(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from mstar_common.families.flux2_klein.components import VaeEncodeComponent
    from mstar_common.families.flux2_klein.loader import load_vae_encoder

    model = load_vae_encoder(checkpoint, options.dtype_for(device), device)
    return VaeEncodeComponent(model, device, options.vae_max_batch, options.max_reference_area)


def _vae_decode(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from mstar_common.families.flux2_klein.components import VaeDecodeComponent
    from mstar_common.families.flux2_klein.loader import load_vae_decoder

    model = load_vae_decoder(checkpoint, options.dtype_for(device), device)
    return VaeDecodeComponent(model, device, options.vae_max_batch, options.max_image_area)


def _denoise(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from mstar_common.families.flux2_klein.components import DenoiseComponent, DenoiseLimits
    from mstar_common.families.flux2_klein.loader import load_transformer, scheduler_config, vae_config

    limits = DenoiseLimits(multiple=2 * vae_config(checkpoint).scale_factor, max_area=options.max_image_area,
                           max_images=options.max_images_per_request, max_steps=options.max_inference_steps,
                           default_steps=options.default_num_inference_steps)
    model = load_transformer(checkpoint, options.dtype_for(device), device)
    runtime = DenoiseComponent(model, scheduler_config(checkpoint), limits, device, options.max_batch_size)
    if dep.components["denoise"].cuda_graphs and device.startswith("cuda"):
        capture_denoise_graphs(runtime, options)
    return runtime


def capture_denoise_graphs(runtime, options: Flux2KleinOptions, capture: bool = True) -> None:
    """Capture the denoise step per `capture_sizes` (text-to-image) and `capture_edit_sizes` (one reference of
    the output size) × `capture_batch_sizes`."""
    from mstar_common.images import parse_size

    layouts = [runtime.layout_for(*parse_size(size)) for size in options.capture_sizes]
    for size in options.edit_sizes:
        width, height = parse_size(size)
        grid = (height // runtime.limits.multiple, width // runtime.limits.multiple)
        layouts.append(runtime.layout_for(width, height, [grid]))
    runtime.stepper.capture(layouts, options.capture_batch_sizes, capture=capture)
