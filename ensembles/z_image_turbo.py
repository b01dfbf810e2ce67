"""The Z-Image-Turbo walk: one request's path through text encoder, denoise and VAE decode.

    parse (size, n, seed, steps, output knobs; a ValueError names the field and the rule; reference images are
           refused: the model has no image conditioning)
    tokenize the prompt with the chat template (thinking on, as the reference pipeline), pad to 512 (never truncate)
    text_encoder ─▶ denoise (caption refiner + the whole Euler loop, batched across requests) ─▶ vae_decode
    ─▶ encode PNG / JPEG / WebP (in a thread) ─▶ images [n] + the seed used
"""

from __future__ import annotations

import asyncio

import numpy as np

from ensembles.image_walk import ImageRequest, ImageWalk, i32
from mstar_common.diffusion import image_graph as g
from mstar_common.families.z_image_turbo.options import TEXT_TOKENS
from mstar_common.walk_api import Call


class ZImageTurboWalk(ImageWalk):
    text_tokens = TEXT_TOKENS
    enable_thinking = True  # as the reference pipeline

    def __init__(self, tokenizer, options, multiple: int, max_sides: tuple[int, int] | None = None):
        super().__init__(tokenizer, options, multiple)
        self.max_sides = max_sides  # (width, height): the checkpoint's RoPE range (`axes_lens`), in pixels

    def check_size(self, width: int, height: int) -> None:
        """Sizes past the DiT's RoPE tables were never trained: refused here, before the text encoder runs (the
        denoise component refuses them too)."""
        if self.max_sides is not None and (width > self.max_sides[0] or height > self.max_sides[1]):
            raise ValueError(f"{g.WIDTH}: {width}x{height} exceeds this checkpoint's RoPE range of "
                             f"{self.max_sides[0]}x{self.max_sides[1]}")

    async def run(self, inputs: dict[str, np.ndarray], call: Call) -> dict[str, np.ndarray]:
        req = self.parse(inputs)
        input_ids, text_len = self.tokenize(req.prompt)
        encoded = await call("text_encoder", {g.INPUT_IDS: input_ids, g.TEXT_LEN: i32(text_len)})
        size = {g.WIDTH: i32(req.width), g.HEIGHT: i32(req.height)}
        png_rows = self.wants_png_rows(req.output)
        denoised = await call("denoise", {g.PROMPT_EMBEDS: encoded[g.PROMPT_EMBEDS], **size,
                                          g.NUM_IMAGES: i32(req.num_images), g.SEED: np.array([req.seed], np.int64),
                                          g.NUM_STEPS: i32(req.num_steps), g.WANT_PNG_ROWS: i32(int(png_rows))})
        decoded, is_rows = await self.decoded(denoised, call, req.width, req.height, png_rows)
        images = await asyncio.to_thread(self.encode_images, decoded, req.output, is_rows)
        return {g.IMAGES: np.array(images, dtype=np.object_), g.SEED: np.array([req.seed], np.int64)}

    def parse(self, inputs: dict[str, np.ndarray]) -> ImageRequest:
        if g.REFERENCE_IMAGES in inputs and np.asarray(inputs[g.REFERENCE_IMAGES]).size:
            raise ValueError(f"{g.REFERENCE_IMAGES}: z_image_turbo is text-to-image only (no reference-image "
                             "conditioning); use /v1/images/generations without images")
        req = self.parse_common(inputs)
        if req.width is None:
            req.width, req.height = self.default_size()
        return req
