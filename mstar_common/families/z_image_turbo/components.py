"""The three Z-Image-Turbo components as the Triton nodes run them: parse a request's tensors (refusing bad input
with a ValueError naming the field), then hand it to the component's engine, which batches across requests and
calls back with the output tensors on the CPU (activations in the model dtype, which the node sends in the
deployment's wire dtype; pixels as uint8).

The runtimes share the image families' interface and scaffolding (`mstar_common/diffusion/image_components.py`:
`engine`, `submit(request_id, inputs, on_done, is_cancelled)`), so `backends/stateless_node.py`,
`backends/denoise_node.py` and the in-process harness run them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar_common.diffusion import image_components
from mstar_common.diffusion import image_graph as g
from mstar_common.diffusion.batcher import BatchingEngine
from mstar_common.diffusion.denoise import DenoiseEngine, DenoiseJob
from mstar_common.diffusion.image_components import (
    BucketedStepper,
    Component,
    DenoiseLimits,
    Inputs,
    decode_slices,
    scalar,
)
from mstar_common.diffusion.step_graphs import StepShapes
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.z_image_turbo.options import TEXT_TOKENS
from mstar_common.families.z_image_turbo.scheduler import ZImageSchedulerConfig, z_image_schedule
from mstar_common.families.z_image_turbo.transformer import ZImageTransformer, padded_length, patchify, unpatchify
from mstar_common.families.z_image_turbo.vae import VaeDecoder
from mstar_common.images import check_geometry

__all__ = ["DenoiseComponent", "DenoiseLimits", "Layout", "TextEncoderComponent", "VaeDecodeComponent",
           "ZImageStepper", "euler_step"]


# text encoder


class TextEncoderComponent(image_components.TextEncoderComponent):
    """Qwen3 run to its second-to-last layer over the padded 512 ids; answers the real tokens' rows only."""

    def __init__(self, model: Qwen3TapEncoder, device: str, max_batch: int):
        super().__init__("z_image_turbo/text_encoder", model, device, max_batch, TEXT_TOKENS)

    def embeds(self, row: torch.Tensor, text_len: int) -> torch.Tensor:
        return row[:text_len]


# denoise


@dataclass(frozen=True, slots=True)
class Layout:
    """What rows of one batched step share: the output token grid and the padded caption length."""

    height: int  # tokens
    width: int
    caption_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.height * self.width


def euler_step(model: ZImageTransformer, rope: tuple[torch.Tensor, torch.Tensor], latents: torch.Tensor,
               caption: torch.Tensor, timesteps: torch.Tensor, dts: torch.Tensor) -> torch.Tensor:
    """One step of every row in the reference's arithmetic: the model sees t = (1000 - timestep) / 1000 and predicts
    the negated velocity; the float32 latents move by `(sigma' - sigma) * (-output)`."""
    t = (1000 - timesteps) / 1000
    output = model(latents.to(model.dtype), caption.to(model.dtype), t, rope).float()
    return latents + dts[:, None, None] * -output


class ZImageStepper(BucketedStepper):
    """The Euler step over the DiT's per-layout RoPE; captured buffers in float32 (the sampler's latents are float32
    whatever the model dtype)."""

    model: ZImageTransformer
    buffer_dtype = torch.float32

    def make_rope(self, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rope(layout.height, layout.width, layout.caption_tokens)

    def step(self, rope, latents, prompt_embeds, ref_tokens, timesteps, dts) -> torch.Tensor:
        return euler_step(self.model, rope, latents, prompt_embeds, timesteps, dts)

    def shapes(self, layout: Layout) -> StepShapes:
        config = self.model.config
        return StepShapes(layout.num_tokens, config.token_channels, layout.caption_tokens, config.dim)


class DenoiseComponent(image_components.DenoiseComponent):
    def __init__(self, model: ZImageTransformer, scheduler: ZImageSchedulerConfig, limits: DenoiseLimits,
                 device: str, max_batch: int):
        self.model, self.scheduler, self.limits = model, scheduler, limits
        self.device = torch.device(device)
        self.stepper = ZImageStepper(model, self.device)
        self.engine = DenoiseEngine("z_image_turbo/denoise", self.stepper, max_rows=max_batch, device=self.device)

    def layout_for(self, width: int, height: int, text_len: int) -> Layout:
        return Layout(height // self.limits.multiple, width // self.limits.multiple, padded_length(text_len))

    def parse(self, inputs: Inputs) -> DenoiseJob:
        req = image_components.parse_denoise_scalars(inputs, self.limits)
        prompt = self._prompt(inputs)
        layout = self.layout_for(req.width, req.height, prompt.shape[0])
        self._check_rope_range(layout, req.width, req.height)
        with torch.inference_mode():  # the caption refiner has no timestep input: run it once, not every step
            caption = self.model.encode_caption(prompt.to(self.device, self.model.dtype))
        timesteps, sigmas = z_image_schedule(self.scheduler, req.num_steps, layout.num_tokens)
        return DenoiseJob(
            request_id="", layout=layout, latents=self._noise(req.seed, req.num_images, layout),
            prompt_embeds=caption[None].expand(req.num_images, -1, -1), ref_tokens=None,
            timesteps=timesteps.tolist(), sigmas=sigmas.tolist(), on_done=lambda *_: None,
        )

    def _prompt(self, inputs: Inputs) -> torch.Tensor:
        prompt = inputs.get(g.PROMPT_EMBEDS)
        width = self.model.config.cap_feat_dim
        if prompt is None or prompt.dim() != 2 or prompt.shape[1] != width or not 1 <= prompt.shape[0] <= TEXT_TOKENS:
            raise ValueError(f"{g.PROMPT_EMBEDS}: expected shape [L, {width}] with 1 <= L <= {TEXT_TOKENS}")
        return prompt

    def _check_rope_range(self, layout: Layout, width: int, height: int) -> None:
        """Positions past the checkpoint's RoPE tables (`axes_lens`) were never trained; refuse them."""
        frames, rows, cols = self.model.config.axes_lens
        if layout.caption_tokens + 1 >= frames:
            raise ValueError(f"prompt: {layout.caption_tokens} caption tokens exceed this checkpoint's RoPE range "
                             f"({frames - 2}); shorten the prompt")
        if layout.height > rows or layout.width > cols:  # an image token's row and column index the tables from 0
            raise ValueError(f"size: {width}x{height} exceeds this checkpoint's RoPE range of "
                             f"{cols * self.limits.multiple}x{rows * self.limits.multiple}")

    def _noise(self, seed: int, num_images: int, layout: Layout) -> torch.Tensor:
        """The reference's initial noise: one CPU generator per request, float32, then patchified."""
        generator = torch.Generator("cpu").manual_seed(seed)
        patch = self.model.config.patch_size
        shape = (num_images, self.model.config.in_channels, layout.height * patch, layout.width * patch)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        return patchify(noise, patch).to(self.device)

    def finish(self, layout: Layout, latents: torch.Tensor) -> Inputs:
        patch = self.model.config.patch_size
        return {g.LATENTS: unpatchify(latents.cpu(), layout.height, layout.width, patch)}

    def decode_payload(self, layout: Layout, latents: torch.Tensor, png_rows: bool) -> tuple[torch.Tensor, bool]:
        patch = self.model.config.patch_size
        latents = unpatchify(latents.to(torch.float32, copy=True), layout.height, layout.width, patch).contiguous()
        return latents, png_rows


# VAE decode


class VaeDecodeComponent(Component):
    def __init__(self, model: VaeDecoder, device: str, max_batch: int, max_area: int):
        self.model, self.device, self.max_area = model, torch.device(device), max_area
        self.multiple = 2 * model.config.scale_factor  # the DiT's 2×2 patches over the VAE's ×8
        self.engine = BatchingEngine("z_image_turbo/vae_decode", self.run_batch, max_rows=max_batch,
                                     key_of=lambda p: tuple(p[0].shape[1:]), rows_of=lambda p: p[0].shape[0])

    def parse(self, inputs: Inputs) -> tuple[torch.Tensor, bool]:
        width, height = scalar(inputs, g.WIDTH), scalar(inputs, g.HEIGHT)
        check_geometry(width, height, self.multiple, self.max_area)
        latents = inputs.get(g.LATENTS)
        factor = self.model.config.scale_factor
        want = (self.model.config.latent_channels, height // factor, width // factor)
        if latents is None or latents.dim() != 4 or tuple(latents.shape[1:]) != want:
            raise ValueError(f"{g.LATENTS}: expected [n, {', '.join(map(str, want))}] for {width}x{height}")
        return latents, image_components.wants_png_rows(inputs)

    @torch.inference_mode()
    def run_batch(self, payloads: list[tuple[torch.Tensor, bool]]) -> list[Inputs]:
        latents = torch.cat([p[0] for p in payloads]).to(self.device, self.model.dtype)
        pixels = torch.cat([self.model(rows) for rows in decode_slices(latents, self.device)])
        return [image_components.host_image(part, p[1])
                for part, p in zip(pixels.split([p[0].shape[0] for p in payloads]), payloads, strict=True)]
