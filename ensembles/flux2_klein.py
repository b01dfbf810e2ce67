"""The FLUX.2 [klein] walk: one request's path through text encoder, VAE encode, denoise and VAE decode.

    parse (size, n, seed, steps, output knobs; a ValueError names the field and the rule)
    ├─ tokenize the prompt with the chat template, pad to 512 (never truncate)  ─▶ text_encoder ─┐
    └─ decode, check, resize and crop each reference image (in a thread)        ─▶ vae_encode  ──┤ concurrently
    denoise (the whole Euler loop, batched across requests inside the component) ◀──────────────┘
    vae_decode ─▶ encode PNG / JPEG / WebP (in a thread) ─▶ images [n] + the seed used

Every hop carries a whole prompt or image, so its ~1 ms BLS cost is small against the work; the
components batch across concurrent requests. Image preprocessing reproduces the reference pipeline's
(Flux2ImageProcessor): at least 64 px a side, aspect ratio at most 8, resized (Lanczos) to
`max_reference_area` if larger, centre-cropped to the 16-px latent grid, RGB.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar_common.families.flux2_klein import graph as g
from mstar_common.families.flux2_klein.options import TEXT_TOKENS, Flux2KleinOptions
from mstar_common.images import OutputOptions, check_geometry, decode_image, encode_image, output_options, parse_size
from mstar_common.walk_api import Call

MIN_REFERENCE_SIDE = 64
MAX_REFERENCE_ASPECT = 8
MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class ImageRequest:
    prompt: str
    width: int | None
    height: int | None
    num_images: int
    seed: int
    num_steps: int
    references: list[bytes]
    output: OutputOptions


class Flux2KleinWalk:
    input_names = tuple(spec.name for spec in g.WALK.inputs)

    def __init__(self, tokenizer: Any, options: Flux2KleinOptions, multiple: int):
        self.tokenizer = tokenizer
        self.options = options
        self.multiple = multiple  # pixels per latent token side

    async def run(self, inputs: dict[str, np.ndarray], call: Call) -> dict[str, np.ndarray]:
        req = self.parse(inputs)
        references = await asyncio.to_thread(self.prepare_references, req.references)
        width, height = self.output_size(req, references)
        input_ids, text_len = self.tokenize(req.prompt)
        encoded = await asyncio.gather(
            call("text_encoder", {g.INPUT_IDS: input_ids, g.TEXT_LEN: np.array([text_len], np.int32)}),
            *(call("vae_encode", {g.PIXELS: pixels}) for pixels in references),
        )
        denoise_inputs = {
            g.PROMPT_EMBEDS: encoded[0][g.PROMPT_EMBEDS], g.WIDTH: _i32(width), g.HEIGHT: _i32(height),
            g.NUM_IMAGES: _i32(req.num_images), g.SEED: np.array([req.seed], np.int64),
            g.NUM_STEPS: _i32(req.num_steps),
        }
        if references:
            denoise_inputs[g.REF_TOKENS] = np.concatenate([np.asarray(out[g.REF_TOKENS]) for out in encoded[1:]])
            denoise_inputs[g.REF_GRID] = np.stack([np.asarray(out[g.REF_GRID]) for out in encoded[1:]])
        latents = (await call("denoise", denoise_inputs))[g.LATENTS]
        decoded = await call("vae_decode", {g.LATENTS: latents, g.WIDTH: _i32(width), g.HEIGHT: _i32(height)})
        pixels = decoded[g.PIXELS]
        images = await asyncio.to_thread(lambda: [encode_image(p, req.output) for p in np.asarray(pixels)])
        return {g.IMAGES: np.array(images, dtype=np.object_), g.SEED: np.array([req.seed], np.int64)}

    # parse

    def parse(self, inputs: dict[str, np.ndarray]) -> ImageRequest:
        opts = self.options
        prompt = _text(inputs, g.PROMPT)
        if prompt is None or not prompt.strip():
            raise ValueError("prompt: required and must not be empty")
        width, height = _int(inputs, g.WIDTH), _int(inputs, g.HEIGHT)
        if (width is None) != (height is None):
            raise ValueError("size: give both width and height, or neither")
        if width is not None:
            check_geometry(width, height, self.multiple, opts.max_image_area)
        num_images = _ranged(inputs, g.NUM_IMAGES, "n", 1, opts.max_images_per_request, 1)
        steps = _ranged(inputs, g.NUM_STEPS, "num_inference_steps", 1, opts.max_inference_steps,
                        opts.default_num_inference_steps)
        seed = _ranged(inputs, g.SEED, "seed", 0, MAX_SEED, None)
        references = [bytes(v) for v in inputs[g.REFERENCE_IMAGES].reshape(-1)] if g.REFERENCE_IMAGES in inputs else []
        if len(references) > opts.max_reference_images:
            raise ValueError(f"image: at most {opts.max_reference_images} reference images, got {len(references)}")
        output = output_options(_text(inputs, g.OUTPUT_FORMAT), _int(inputs, g.PNG_LEVEL), _int(inputs, g.COMPRESSION))
        return ImageRequest(prompt, width, height, num_images, secrets.randbelow(MAX_SEED) if seed is None else seed,
                            steps, references, output)

    def output_size(self, req: ImageRequest, references: list[np.ndarray]) -> tuple[int, int]:
        """The requested size; else the first reference's (as the reference pipeline does); else the default."""
        if req.width is not None:
            return req.width, req.height
        if references:
            height, width = references[0].shape[:2]
        else:
            width, height = parse_size(self.options.default_size)
        check_geometry(width, height, self.multiple, self.options.max_image_area)
        return width, height

    def tokenize(self, prompt: str) -> tuple[np.ndarray, int]:
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=False)
        encoded = self.tokenizer(text, padding="max_length", max_length=TEXT_TOKENS, truncation=False)
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        if len(ids) > TEXT_TOKENS:
            raise ValueError(f"prompt: {len(ids)} tokens with the chat template exceed the text encoder's "
                             f"{TEXT_TOKENS}-token input; shorten the prompt")
        return np.asarray(ids, dtype=np.int32), int(sum(mask))

    # reference images

    def prepare_references(self, uploads: list[bytes]) -> list[np.ndarray]:
        return [self.prepare_reference(data, f"image[{i}]") for i, data in enumerate(uploads)]

    def prepare_reference(self, data: bytes, field: str) -> np.ndarray:
        from PIL import Image

        image = decode_image(data, field)
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
        return np.asarray(image.convert("RGB") if image.mode != "RGB" else image, dtype=np.uint8)


def _i32(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int32)


def _scalar(inputs: dict[str, np.ndarray], name: str) -> Any:
    if name not in inputs:
        return None
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name}: expected one value, got {values.size}")
    return values[0]


def _text(inputs: dict[str, np.ndarray], name: str) -> str | None:
    value = _scalar(inputs, name)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: must be UTF-8 text") from None
    return None if value is None else str(value)


def _int(inputs: dict[str, np.ndarray], name: str) -> int | None:
    value = _scalar(inputs, name)
    return None if value is None else int(value)


def _ranged(inputs: dict[str, np.ndarray], name: str, field: str, low: int, high: int,
            default: int | None) -> int | None:
    value = _int(inputs, name)
    if value is None:
        return default
    if not low <= value <= high:
        raise ValueError(f"{field}: must be in [{low}, {high}], got {value}")
    return value
