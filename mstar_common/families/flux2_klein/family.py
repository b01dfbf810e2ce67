"""The FLUX.2 [klein] family (4B and 9B checkpoints in diffusers layout): the builders of
its walk and four components. The graph and the request path are drawn in `graph.py`;
the deployment checks are the image families' (`mstar_common/diffusion/image_family.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError
from mstar_common.diffusion import image_family
from mstar_common.diffusion.image_family import Builder, ImageFamily, tiny_builder
from mstar_common.families.flux2_klein.graph import GRAPH
from mstar_common.families.flux2_klein.options import Flux2KleinOptions


class Flux2KleinFamily(ImageFamily):
    name: ClassVar[str] = "flux2_klein"
    graph = GRAPH
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"flux2-klein-tiny": tiny_builder("flux2_klein")}

    def grid_multiple(self, checkpoint: Path) -> int:
        return _multiple(checkpoint)

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """The image rules, and the text encoder's taps: layers the checkpoint's text encoder has, as many as make
        the transformer's joint attention width."""
        from mstar_common.families.flux2_klein.loader import text_encoder_config, transformer_config
        from mstar_common.families.flux2_klein.text_encoder import check_taps

        super().check_checkpoint(dep, checkpoint, source)
        config = text_encoder_config(checkpoint)
        taps = self.options_from_kwargs(dep.model_kwargs, source).text_encoder_out_layers
        try:
            check_taps(taps, config.num_hidden_layers)
        except ValueError as exc:
            raise DeploymentError(f"{source}: model_kwargs.{exc}") from None
        joint = transformer_config(checkpoint).joint_attention_dim
        if len(taps) * config.hidden_size != joint:
            raise DeploymentError(f"{source}: model_kwargs.text_encoder_out_layers: {len(taps)} taps of width "
                                  f"{config.hidden_size} do not make the transformer's joint_attention_dim={joint}")

    def builders(self) -> dict[str, Builder]:
        return {"walk": _walk, "text_encoder": _text_encoder, "vae_encode": _vae_encode, "denoise": _denoise,
                "vae_decode": _vae_decode}


def _multiple(checkpoint: Path) -> int:
    """Pixels per DiT token side: the VAE's downscale times the DiT's 2x2 patches."""
    from mstar_common.families.flux2_klein.loader import vae_config

    return 2 * vae_config(checkpoint).scale_factor


def _walk(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from ensembles.flux2_klein import Flux2KleinWalk

    tokenizer = image_family.load_walk_tokenizer(checkpoint)
    return Flux2KleinWalk(tokenizer, options, multiple=_multiple(checkpoint))


def _text_encoder(dep: Deployment, options: Flux2KleinOptions, checkpoint: Path, device: str):
    from mstar_common.families.flux2_klein.components import TextEncoderComponent
    from mstar_common.families.flux2_klein.loader import load_text_encoder

    taps = options.text_encoder_out_layers  # checked against the checkpoint by check_checkpoint, before this
    model = load_text_encoder(checkpoint, taps, options.dtype_for(device), device)
    runtime = TextEncoderComponent(model, device, options.text_encoder_max_batch)
    if image_family.captures(dep, "text_encoder", device):
        runtime.capture_graphs()
    return runtime


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
    from mstar_common.families.flux2_klein.loader import load_transformer, scheduler_config

    limits = DenoiseLimits.from_options(options, multiple=_multiple(checkpoint))
    scheduler = scheduler_config(checkpoint)  # a refusal before the DiT's weights are read
    model = load_transformer(checkpoint, options.dtype_for(device), device, options.lora)  # folded before fp8
    if options.dit_fp8:  # the blocks' linears; the embedders, modulations and output projection stay
        image_family.quantize_dit_fp8([*model.transformer_blocks, *model.single_transformer_blocks], device)
    runtime = DenoiseComponent(model, scheduler, limits, device, options.max_batch_size)
    if image_family.captures(dep, "denoise", device):
        capture_denoise_graphs(runtime, options)
    if options.vae_in_denoise:
        runtime.attach_decoder(_vae_decode(dep, options, checkpoint, device))
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
