"""The Z-Image-Turbo walk: one request's path through text encoder, denoise and VAE decode.

    parse (size, n, seed, steps, output knobs; a ValueError names the field and the rule; reference images are
           refused: the model has no image conditioning)
    tokenize the prompt with the chat template (thinking on, as the reference pipeline), pad to 512 (never truncate)
    text_encoder ─▶ denoise (caption refiner + the whole Euler loop, batched across requests) ─▶ vae_decode
    ─▶ encode PNG / JPEG / WebP (in a thread) ─▶ images [n] + the seed used
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from mstar_common.families.z_image_turbo import graph as g
from mstar_common.families.z_image_turbo.options import TEXT_TOKENS, ZImageTurboOptions
from mstar_common.images import OutputOptions, check_geometry, encode_image, output_options, parse_size
from mstar_common.walk_api import Call

MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class ImageRequest:
    prompt: str
    width: int
    height: int
    num_images: int
    seed: int
    num_steps: int
    output: OutputOptions


class ZImageTurboWalk:
    input_names = tuple(spec.name for spec in g.WALK.inputs)

    def __init__(self, tokenizer: Any, options: ZImageTurboOptions, multiple: int):
        self.tokenizer = tokenizer
        self.options = options
        self.multiple = multiple  # pixels per DiT token side

    async def run(self, inputs: dict[str, np.ndarray], call: Call) -> dict[str, np.ndarray]:
        req = self.parse(inputs)
        input_ids, text_len = self.tokenize(req.prompt)
        encoded = await call("text_encoder", {g.INPUT_IDS: input_ids, g.TEXT_LEN: _i32(text_len)})
        size = {g.WIDTH: _i32(req.width), g.HEIGHT: _i32(req.height)}
        latents = (await call("denoise", {g.PROMPT_EMBEDS: encoded[g.PROMPT_EMBEDS], **size,
                                          g.NUM_IMAGES: _i32(req.num_images), g.SEED: np.array([req.seed], np.int64),
                                          g.NUM_STEPS: _i32(req.num_steps)}))[g.LATENTS]
        pixels = (await call("vae_decode", {g.LATENTS: latents, **size}))[g.PIXELS]
        images = await asyncio.to_thread(lambda: [encode_image(p, req.output) for p in np.asarray(pixels)])
        return {g.IMAGES: np.array(images, dtype=np.object_), g.SEED: np.array([req.seed], np.int64)}

    def parse(self, inputs: dict[str, np.ndarray]) -> ImageRequest:
        opts = self.options
        if g.REFERENCE_IMAGES in inputs and np.asarray(inputs[g.REFERENCE_IMAGES]).size:
            raise ValueError("image: z_image_turbo is text-to-image only (no reference-image conditioning); "
                             "use /v1/images/generations without images")
        prompt = _text(inputs, g.PROMPT)
        if prompt is None or not prompt.strip():
            raise ValueError("prompt: required and must not be empty")
        width, height = _int(inputs, g.WIDTH), _int(inputs, g.HEIGHT)
        if (width is None) != (height is None):
            raise ValueError("size: give both width and height, or neither")
        if width is None:
            width, height = parse_size(opts.default_size)
        check_geometry(width, height, self.multiple, opts.max_image_area)
        num_images = _ranged(inputs, g.NUM_IMAGES, "n", 1, opts.max_images_per_request, 1)
        steps = _ranged(inputs, g.NUM_STEPS, "num_inference_steps", 1, opts.max_inference_steps,
                        opts.default_num_inference_steps)
        seed = _ranged(inputs, g.SEED, "seed", 0, MAX_SEED, None)
        output = output_options(_text(inputs, g.OUTPUT_FORMAT), _int(inputs, g.PNG_LEVEL), _int(inputs, g.COMPRESSION))
        return ImageRequest(prompt, width, height, num_images, secrets.randbelow(MAX_SEED) if seed is None else seed,
                            steps, output)

    def tokenize(self, prompt: str) -> tuple[np.ndarray, int]:
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  enable_thinking=True)
        encoded = self.tokenizer(text, padding="max_length", max_length=TEXT_TOKENS, truncation=False)
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        if len(ids) > TEXT_TOKENS:
            raise ValueError(f"prompt: {len(ids)} tokens with the chat template exceed the text encoder's "
                             f"{TEXT_TOKENS}-token input; shorten the prompt")
        return np.asarray(ids, dtype=np.int32), int(sum(mask))


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
