"""The Z-Image-Turbo family (diffusers layout: Qwen3-4B caption encoder, 6B single-stream DiT, FLUX.1 VAE):
the builders of its walk and three components. The graph is drawn in `graph.py`; the deployment checks are the
image families' (`mstar_common/diffusion/image_family.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError
from mstar_common.diffusion import image_family
from mstar_common.diffusion.image_family import Builder, ImageFamily, tiny_builder
from mstar_common.families.z_image_turbo.graph import GRAPH
from mstar_common.families.z_image_turbo.options import ZImageTurboOptions


class ZImageTurboFamily(ImageFamily):
    name: ClassVar[str] = "z_image_turbo"
    graph = GRAPH
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"z-image-turbo-tiny": tiny_builder("z_image_turbo")}

    def grid_multiple(self, checkpoint: Path) -> int:
        return _multiple(checkpoint)

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """The image rules, and the caption encoder's config as its component reads it at load (a scaled RoPE
        it does not build, a width the transformer does not take), known from the files before anything starts."""
        super().check_checkpoint(dep, checkpoint, source)
        try:
            _check_text_encoder(checkpoint)
        except (ValueError, DeploymentError) as exc:
            raise DeploymentError(f"{source}: {exc}") from None

    def max_sides(self, checkpoint: Path) -> tuple[int, int]:
        return rope_max_sides(checkpoint)

    def builders(self) -> dict[str, Builder]:
        return {"walk": _walk, "text_encoder": _text_encoder, "denoise": _denoise, "vae_decode": _vae_decode}


def _multiple(checkpoint: Path) -> int:
    """Pixels per DiT token side: the VAE's downscale times the DiT's patch."""
    from mstar_common.families.z_image_turbo.loader import transformer_config, vae_config

    return vae_config(checkpoint).scale_factor * transformer_config(checkpoint).patch_size


def rope_max_sides(checkpoint: Path) -> tuple[int, int]:
    """(width, height) in pixels the DiT's RoPE tables reach (`axes_lens`), as the denoise component holds them."""
    from mstar_common.families.z_image_turbo.loader import transformer_config

    _, rows, cols = transformer_config(checkpoint).axes_lens
    multiple = _multiple(checkpoint)
    return cols * multiple, rows * multiple


def _check_text_encoder(checkpoint: Path) -> None:
    from mstar_common.families.z_image_turbo.loader import text_encoder_config, transformer_config

    width, cap_dim = text_encoder_config(checkpoint).hidden_size, transformer_config(checkpoint).cap_feat_dim
    if width != cap_dim:
        raise DeploymentError(f"checkpoint: text_encoder hidden_size={width} does not match the transformer's "
                              f"cap_feat_dim={cap_dim}")


def _walk(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from ensembles.z_image_turbo import ZImageTurboWalk

    return ZImageTurboWalk(image_family.load_walk_tokenizer(checkpoint), options, multiple=_multiple(checkpoint),
                           max_sides=rope_max_sides(checkpoint))  # as the denoise component's rule


def _text_encoder(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import TextEncoderComponent
    from mstar_common.families.z_image_turbo.loader import load_text_encoder

    _check_text_encoder(checkpoint)
    model = load_text_encoder(checkpoint, options.dtype_for(device), device)
    runtime = TextEncoderComponent(model, device, options.text_encoder_max_batch)
    if image_family.captures(dep, "text_encoder", device):
        runtime.capture_graphs()
    return runtime


def _vae_decode(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import VaeDecodeComponent
    from mstar_common.families.z_image_turbo.loader import load_vae_decoder

    model = load_vae_decoder(checkpoint, options.dtype_for(device), device)
    return VaeDecodeComponent(model, device, options.vae_max_batch, options.max_image_area)


def _denoise(dep: Deployment, options: ZImageTurboOptions, checkpoint: Path, device: str):
    from mstar_common.families.z_image_turbo.components import DenoiseComponent, DenoiseLimits
    from mstar_common.families.z_image_turbo.loader import load_transformer, scheduler_config

    limits = DenoiseLimits.from_options(options, multiple=_multiple(checkpoint))
    scheduler = scheduler_config(checkpoint)  # a refusal before the DiT's weights are read
    model = load_transformer(checkpoint, options.dtype_for(device), device, options.lora)  # folded before fp8
    if options.dit_fp8:  # attention and MLP linears; the adaLN modulations and the embedders stay
        blocks = [*model.noise_refiner, *model.context_refiner, *model.layers]
        image_family.quantize_dit_fp8([part for block in blocks for part in (block.attention, block.feed_forward)],
                                      device)
    runtime = DenoiseComponent(model, scheduler, limits, device, options.max_batch_size)
    if image_family.captures(dep, "denoise", device):
        capture_denoise_graphs(runtime, options)
    if options.vae_in_denoise:
        runtime.attach_decoder(_vae_decode(dep, options, checkpoint, device))
    return runtime


def capture_denoise_graphs(runtime, options: ZImageTurboOptions, capture: bool = True) -> None:
    """Capture the denoise step per `capture_sizes` × `capture_caption_tokens` × `capture_batch_sizes`."""
    from mstar_common.families.z_image_turbo.components import Layout
    from mstar_common.images import parse_size

    multiple = runtime.limits.multiple
    layouts = [Layout(height // multiple, width // multiple, tokens)
               for width, height in map(parse_size, options.capture_sizes) for tokens in options.capture_caption_tokens]
    runtime.stepper.capture(layouts, options.capture_batch_sizes, capture=capture)
