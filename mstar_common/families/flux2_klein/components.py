"""The four FLUX.2 [klein] components as the Triton nodes run them: parse a request's tensors (refusing bad
input with a ValueError naming the field), then hand it to the component's engine, which batches across
requests and calls back with the output tensors on the CPU (activations in the model dtype, which the node
sends in the deployment's wire dtype; pixels as uint8).

The scaffolding (`submit`, the text encoder, the denoise scalars, the bucketed stepper) is the image families'
(`mstar_common/diffusion/image_components.py`); this module supplies klein's layouts, RoPE, noise and VAE halves.
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
from mstar_common.families.flux2_klein.options import TEXT_TOKENS
from mstar_common.families.flux2_klein.scheduler import FlowSchedulerConfig, flow_schedule
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.flux2_klein.transformer import Flux2Transformer
from mstar_common.families.flux2_klein.vae import VaeDecoder, VaeEncoder
from mstar_common.images import check_geometry

__all__ = ["DenoiseComponent", "DenoiseLimits", "Flux2Stepper", "Layout", "TextEncoderComponent", "VaeDecodeComponent",
           "VaeEncodeComponent", "euler_step", "position_ids"]

REF_TIME_SCALE = 10  # reference image i sits at time coordinate 10 + 10 * i


# text encoder


class TextEncoderComponent(image_components.TextEncoderComponent):
    """The tapped Qwen3 over the padded 512 ids; answers the whole padded rows (the DiT masks nothing)."""

    def __init__(self, model: Qwen3TapEncoder, device: str, max_batch: int):
        super().__init__("flux2_klein/text_encoder", model, device, max_batch, TEXT_TOKENS)


# VAE encode (reference images)


class VaeEncodeComponent(Component):
    def __init__(self, model: VaeEncoder, device: str, max_batch: int, max_area: int):
        self.model, self.device, self.max_area = model, torch.device(device), max_area
        self.multiple = 2 * model.config.scale_factor
        self.engine = BatchingEngine("flux2_klein/vae_encode", self.run_batch, max_rows=max_batch,
                                     key_of=lambda pixels: tuple(pixels.shape))

    def parse(self, inputs: Inputs) -> torch.Tensor:
        pixels = inputs.get(g.PIXELS)
        if pixels is None or pixels.dim() != 3 or pixels.shape[-1] != 3 or pixels.dtype != torch.uint8:
            raise ValueError(f"{g.PIXELS}: expected one uint8 RGB image [H, W, 3]")
        height, width = pixels.shape[:2]
        check_geometry(width, height, self.multiple, self.max_area, field=g.PIXELS)
        return pixels

    @torch.inference_mode()
    def run_batch(self, payloads: list[torch.Tensor]) -> list[Inputs]:
        # The reference's preprocessing: uint8 -> [0, 1] in float32 -> [-1, 1], then the VAE dtype.
        pixels = torch.stack(payloads).permute(0, 3, 1, 2).float() / 255.0
        pixels = (2.0 * pixels - 1.0).to(self.device, self.model.bn.running_var.dtype)
        tokens = self.model(pixels).cpu()
        height, width = payloads[0].shape[:2]
        grid = torch.tensor([height // self.multiple, width // self.multiple], dtype=torch.int32)
        return [{g.REF_TOKENS: row, g.REF_GRID: grid} for row in tokens]


# denoise


@dataclass(frozen=True, slots=True)
class Layout:
    """The token layout of a step: output token grid and the reference grids, in order."""

    height: int  # output tokens
    width: int
    refs: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.height * self.width

    @property
    def num_ref_tokens(self) -> int:
        return sum(h * w for h, w in self.refs)


def position_ids(layout: Layout, num_text: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(txt_ids `[T, 4]`, img_ids `[N + N_ref, 4]`) as (t, h, w, l) coordinates, the reference's layout."""
    zero = torch.arange(1)
    txt = torch.cartesian_prod(zero, zero, zero, torch.arange(num_text))
    parts = [torch.cartesian_prod(zero, torch.arange(layout.height), torch.arange(layout.width), zero)]
    for i, (h, w) in enumerate(layout.refs):
        t = torch.tensor([REF_TIME_SCALE + REF_TIME_SCALE * i])
        parts.append(torch.cartesian_prod(t, torch.arange(h), torch.arange(w), zero))
    return txt.to(device), torch.cat(parts).to(device)


def euler_step(model: Flux2Transformer, rope: tuple[torch.Tensor, torch.Tensor], latents: torch.Tensor,
               prompt_embeds: torch.Tensor, ref_tokens: torch.Tensor | None, timesteps: torch.Tensor,
               dts: torch.Tensor) -> torch.Tensor:
    """One step of every row, in the reference's arithmetic: velocity at t, then `x + (sigma' - sigma) * v`."""
    model_dtype = model.x_embedder.weight.dtype
    timestep = timesteps.to(latents.dtype)
    model_input = latents.to(model_dtype)
    if ref_tokens is not None:
        model_input = torch.cat([latents, ref_tokens], dim=1).to(model_dtype)
    velocity = model(model_input, prompt_embeds, timestep / 1000, rope)[:, : latents.shape[1]]
    return (latents.float() + dts.to(velocity.dtype)[:, None, None] * velocity).to(velocity.dtype)


class Flux2Stepper(BucketedStepper):
    """The Euler step over the reference's (t, h, w, l) RoPE; captured buffers in the model dtype."""

    model: Flux2Transformer

    @property
    def buffer_dtype(self) -> torch.dtype:
        return self.model.x_embedder.weight.dtype

    def make_rope(self, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        txt_ids, img_ids = position_ids(layout, TEXT_TOKENS, self.device)
        return self.model.rope(txt_ids, img_ids)

    def step(self, rope, latents, prompt_embeds, ref_tokens, timesteps, dts) -> torch.Tensor:
        return euler_step(self.model, rope, latents, prompt_embeds, ref_tokens, timesteps, dts)

    def shapes(self, layout: Layout) -> StepShapes:
        config = self.model.config
        return StepShapes(layout.num_tokens, config.in_channels, TEXT_TOKENS, config.joint_attention_dim,
                          layout.num_ref_tokens)


class DenoiseComponent(image_components.DenoiseComponent):
    def __init__(self, model: Flux2Transformer, scheduler: FlowSchedulerConfig, limits: DenoiseLimits, device: str,
                 max_batch: int):
        self.model, self.scheduler, self.limits = model, scheduler, limits
        self.device = torch.device(device)
        self.dtype = model.x_embedder.weight.dtype
        self.stepper = Flux2Stepper(model, self.device)
        self.engine = DenoiseEngine("flux2_klein/denoise", self.stepper, max_rows=max_batch, device=self.device)

    def layout_for(self, width: int, height: int, ref_grid: list[tuple[int, int]] = ()) -> Layout:
        return Layout(height // self.limits.multiple, width // self.limits.multiple, tuple(ref_grid))

    def parse(self, inputs: Inputs) -> DenoiseJob:
        req = image_components.parse_denoise_scalars(inputs, self.limits)
        prompt = self._prompt(inputs)
        grid, refs = self._refs(inputs)
        layout = self.layout_for(req.width, req.height, grid)
        latents = self._noise(req.seed, req.num_images, layout)
        timesteps, sigmas = flow_schedule(self.scheduler, req.num_steps, layout.num_tokens)
        return DenoiseJob(
            request_id="", layout=layout, latents=latents,
            prompt_embeds=prompt.to(self.device, self.dtype).expand(req.num_images, -1, -1),
            ref_tokens=None if refs is None else refs.to(self.device, self.dtype).expand(req.num_images, -1, -1),
            timesteps=timesteps.tolist(), sigmas=sigmas.tolist(), on_done=lambda *_: None,
        )

    def _prompt(self, inputs: Inputs) -> torch.Tensor:
        prompt = inputs.get(g.PROMPT_EMBEDS)
        want = (TEXT_TOKENS, self.model.config.joint_attention_dim)
        if prompt is None or tuple(prompt.shape) != want:
            raise ValueError(f"{g.PROMPT_EMBEDS}: expected shape {list(want)}")
        return prompt[None]

    def _refs(self, inputs: Inputs) -> tuple[list[tuple[int, int]], torch.Tensor | None]:
        if g.REF_TOKENS not in inputs:
            return [], None
        grid = [tuple(int(v) for v in row) for row in inputs.get(g.REF_GRID, torch.zeros(0, 2)).reshape(-1, 2)]
        tokens = inputs[g.REF_TOKENS]
        want = (sum(h * w for h, w in grid), self.model.config.in_channels)
        if not grid or tuple(tokens.shape) != want or any(h < 1 or w < 1 for h, w in grid):
            raise ValueError(f"{g.REF_TOKENS}: expected shape {list(want)} for {g.REF_GRID} {grid}")
        return grid, tokens[None]

    def _noise(self, seed: int, num_images: int, layout: Layout) -> torch.Tensor:
        """The reference's initial noise: one CPU generator per request, drawn in the model dtype, packed."""
        generator = torch.Generator("cpu").manual_seed(seed)
        shape = (num_images, self.model.config.in_channels, layout.height, layout.width)
        noise = torch.randn(shape, generator=generator, dtype=self.dtype).to(self.device)
        return noise.reshape(num_images, shape[1], -1).permute(0, 2, 1)

    def finish(self, layout: Layout, latents: torch.Tensor) -> Inputs:
        return {g.LATENTS: latents.cpu()}

    def decode_payload(self, layout: Layout, latents: torch.Tensor,
                       png_rows: bool) -> tuple[torch.Tensor, int, int, bool]:
        multiple = self.limits.multiple
        return latents.to(torch.float32, copy=True), layout.width * multiple, layout.height * multiple, png_rows


# VAE decode



class VaeDecodeComponent(Component):
    def __init__(self, model: VaeDecoder, device: str, max_batch: int, max_area: int):
        self.model, self.device, self.max_area = model, torch.device(device), max_area
        self.multiple = 2 * model.config.scale_factor
        self.engine = BatchingEngine("flux2_klein/vae_decode", self.run_batch, max_rows=max_batch,
                                     key_of=lambda p: (p[1], p[2]), rows_of=lambda p: p[0].shape[0])

    def parse(self, inputs: Inputs) -> tuple[torch.Tensor, int, int, bool]:
        width, height = scalar(inputs, g.WIDTH), scalar(inputs, g.HEIGHT)
        check_geometry(width, height, self.multiple, self.max_area)
        latents = inputs.get(g.LATENTS)
        tokens = (height // self.multiple) * (width // self.multiple)
        if latents is None or latents.dim() != 3 or tuple(latents.shape[1:]) != (tokens,
                                                                                 self.model.config.token_channels):
            raise ValueError(f"{g.LATENTS}: expected [n, {tokens}, {self.model.config.token_channels}] for "
                             f"{width}x{height}")
        return latents, width, height, image_components.wants_png_rows(inputs)

    @torch.inference_mode()
    def run_batch(self, payloads: list[tuple[torch.Tensor, int, int, bool]]) -> list[Inputs]:
        _, width, height, _ = payloads[0]
        latents = torch.cat([p[0] for p in payloads]).to(self.device, self.model.bn.running_var.dtype)
        pixels = torch.cat([self.model(rows, height, width) for rows in decode_slices(latents, self.device)])
        return [image_components.host_image(part, p[3])
                for part, p in zip(pixels.split([p[0].shape[0] for p in payloads]), payloads, strict=True)]
