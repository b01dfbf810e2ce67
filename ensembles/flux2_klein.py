"""The FLUX.2 [klein] walk: one request's path through text encoder, VAE encode, denoise and VAE decode.

    parse (size, n, seed, steps, output knobs; a ValueError names the field and the rule)
    ├─ tokenize the prompt with the chat template, pad to 512 (never truncate)  ─▶ text_encoder ─┐
    └─ decode, check, resize and crop each reference image (in a thread)        ─▶ vae_encode  ──┤ concurrently
    denoise (the whole Euler loop, batched across requests inside the component) ◀──────────────┘
    vae_decode ─▶ encode PNG / JPEG / WebP (in a thread) ─▶ images [n] + the seed used
    (for a PNG the decoder answers Paeth-filtered rows, filtered on its GPU; the walk only deflates them)

Every hop carries a whole prompt or image, so its ~1 ms BLS cost is small against the work; the
components batch across concurrent requests. Image preprocessing reproduces the reference pipeline's
(Flux2ImageProcessor): at least 64 px a side, aspect ratio at most 8, resized (Lanczos) to
`max_reference_area` if larger, centre-cropped to the 16-px latent grid, RGB.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np

from ensembles.image_walk import ImageRequest, ImageWalk, concat, i32
from mstar_common.diffusion import image_graph as g
from mstar_common.families.flux2_klein.options import TEXT_TOKENS
from mstar_common.images import check_geometry, decode_image
from mstar_common.walk_api import Call

MIN_REFERENCE_SIDE = 64
MAX_REFERENCE_ASPECT = 8


class Flux2KleinWalk(ImageWalk):
    text_tokens = TEXT_TOKENS
    enable_thinking = False

    async def run(self, inputs: dict[str, np.ndarray], call: Call) -> dict[str, np.ndarray]:
        req = self.parse(inputs)
        references = await asyncio.to_thread(self.prepare_references, req.references)
        width, height = self.output_size(req, references)
        input_ids, text_len = self.tokenize(req.prompt)
        encoded = await asyncio.gather(
            call("text_encoder", {g.INPUT_IDS: input_ids, g.TEXT_LEN: i32(text_len)}),
            *(call("vae_encode", {g.PIXELS: pixels}) for pixels in references),
        )
        denoise_inputs = {
            g.PROMPT_EMBEDS: encoded[0][g.PROMPT_EMBEDS], g.WIDTH: i32(width), g.HEIGHT: i32(height),
            g.NUM_IMAGES: i32(req.num_images), g.SEED: np.array([req.seed], np.int64),
            g.NUM_STEPS: i32(req.num_steps),
        }
        if references:
            denoise_inputs[g.REF_TOKENS] = concat([out[g.REF_TOKENS] for out in encoded[1:]])
            denoise_inputs[g.REF_GRID] = np.stack([np.asarray(out[g.REF_GRID]) for out in encoded[1:]])
        png_rows = self.wants_png_rows(req.output)
        denoise_inputs[g.WANT_PNG_ROWS] = i32(int(png_rows))
        decoded, is_rows = await self.decoded(await call("denoise", denoise_inputs), call, width, height, png_rows)
        images = await asyncio.to_thread(self.encode_images, decoded, req.output, is_rows)
        return {g.IMAGES: np.array(images, dtype=np.object_), g.SEED: np.array([req.seed], np.int64)}

    # parse

    def parse(self, inputs: dict[str, np.ndarray]) -> ImageRequest:
        req = self.parse_common(inputs)
        if g.REFERENCE_IMAGES in inputs:
            req.references = [bytes(v) for v in inputs[g.REFERENCE_IMAGES].reshape(-1)]
        if len(req.references) > self.options.max_reference_images:
            raise ValueError(f"{g.REFERENCE_IMAGES}: at most {self.options.max_reference_images} reference images, "
                             f"got {len(req.references)}")
        return req

    def output_size(self, req: ImageRequest, references: list[np.ndarray]) -> tuple[int, int]:
        """The requested size; else the first reference's (as the reference pipeline does); else the default."""
        if req.width is not None:
            return req.width, req.height
        if not references:
            return self.default_size()
        height, width = references[0].shape[:2]
        check_geometry(width, height, self.multiple, self.options.max_image_area)
        return width, height

    # reference images

    def prepare_references(self, uploads: list[bytes]) -> list[np.ndarray]:
        return [self.prepare_reference(data, f"{g.REFERENCE_IMAGES}[{i}]") for i, data in enumerate(uploads)]

    def prepare_reference(self, data: bytes, field: str) -> np.ndarray:
        from PIL import Image

        image = decode_image(data, field)
        if image.mode != "RGB":  # as diffusers' load_image: Pillow resizes a palette or 1-bit image nearest-neighbour
            image = image.convert("RGB")
        width, height = image.size
        if width < MIN_REFERENCE_SIDE or height < MIN_REFERENCE_SIDE:
            raise ValueError(f"{field}: {width}x{height} is too small: both sides must be at least "
                             f"{MIN_REFERENCE_SIDE} px")
        if max(width / height, height / width) > MAX_REFERENCE_ASPECT:
            raise ValueError(f"{field}: {width}x{height} has an aspect ratio over {MAX_REFERENCE_ASPECT}:1")
        if width * height > self.options.max_reference_area:
            scale = math.sqrt(self.options.max_reference_area / (width * height))
            image = image.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
            width, height = image.size
        crop_w, crop_h = width // self.multiple * self.multiple, height // self.multiple * self.multiple
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
        return np.asarray(image, dtype=np.uint8)
