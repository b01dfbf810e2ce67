"""What the image walks share: reading the entry tensors, the request fields every image family takes (prompt,
size, n, steps, seed, output knobs; a ValueError names the field and the rule) and the chat-template tokenizer
padded to the text encoder's fixed input. The families add their own fields and hops."""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mstar_common.config import env_switch
from mstar_common.diffusion import image_graph as g
from mstar_common.diffusion.png import DEFLATE, encode_png, encode_png_rows
from mstar_common.families.text import check_text_fits, max_token_bytes
from mstar_common.images import (
    OutputOptions,
    check_format_size,
    check_geometry,
    encode_image,
    output_options,
    parse_size,
    png_encoder,
)
from mstar_common.walk_api import Call

MAX_SEED = 2**63 - 1
# a seed the walk draws (none given) is below 2**53, so the one the response returns survives any JSON reader:
# JavaScript's JSON.parse (openai-node) reads a number as a double, and 99% of seeds drawn below 2**63 came back
# rounded, a different seed that made a different image when sent again (RFC 8259 section 6)
DRAWN_SEED_BOUND = 2**53
TIMINGS = env_switch("MSTAR_TIMINGS", False)  # log the walk's own parts beside the router's hop times
logger = logging.getLogger(__name__)


@contextmanager
def timed(label: str):
    """With MSTAR_TIMINGS=1, log the block's wall time as `timing <label>` (scripts/bench_flux2.py reads it)."""
    started = time.perf_counter()
    yield
    if TIMINGS:
        logger.info("[walk] timing %s: %.1f ms", label, (time.perf_counter() - started) * 1e3)


@dataclass(slots=True)
class ImageRequest:
    prompt: str
    width: int | None  # None: the family picks (default size, or a reference's)
    height: int | None
    num_images: int
    seed: int
    num_steps: int
    output: OutputOptions
    references: list[bytes] = field(default_factory=list)  # encoded uploads, in order


class ImageWalk:
    """Base of an image family's walk; `options` carries the family's `model_kwargs` (sizes, limits, defaults)."""

    input_names = tuple(spec.name for spec in g.WALK.inputs)
    text_tokens: int = 512  # the text encoder's fixed input length (prompts are padded to it, never truncated)
    enable_thinking: bool = False  # the chat template's thinking switch, as the reference pipeline sets it

    def __init__(self, tokenizer: Any, options: Any, multiple: int):
        self.tokenizer = tokenizer
        self.options = options
        self.multiple = multiple  # pixels per token side
        self.max_prompt_bytes = self.text_tokens * max_token_bytes(tokenizer)  # a longer prompt cannot fit
        if DEFLATE != "isal":  # what a missing dependency costs, said once (the PNG deflate, png.py)
            logger.warning("[walk] PNG deflate on zlib: `isal` is not importable here (6-15x slower per image)")

    def parse_common(self, inputs: dict[str, np.ndarray]) -> ImageRequest:
        opts = self.options
        prompt = text(inputs, g.PROMPT)
        if prompt is None or not prompt.strip():
            raise ValueError("prompt: required and must not be empty")
        check_text_fits(prompt, "prompt", self.text_tokens, self.max_prompt_bytes)  # before the tokenizer sees it
        width, height = integer(inputs, g.WIDTH), integer(inputs, g.HEIGHT)
        # refusals name the walk's own inputs (a direct Triton client's); the proxy renames them (n, size, ...)
        if (width is None) != (height is None):
            raise ValueError(f"{g.WIDTH if width is None else g.HEIGHT}: give both width and height, or neither")
        if width is not None:
            check_geometry(width, height, self.multiple, opts.max_image_area, field=g.WIDTH)
        num_images = ranged(inputs, g.NUM_IMAGES, g.NUM_IMAGES, 1, opts.max_images_per_request, 1)
        steps = ranged(inputs, g.NUM_STEPS, "num_inference_steps", 1, opts.max_inference_steps,
                       opts.default_num_inference_steps)
        seed = ranged(inputs, g.SEED, "seed", 0, MAX_SEED, None)
        output = output_options(text(inputs, g.OUTPUT_FORMAT), integer(inputs, g.PNG_LEVEL),
                                integer(inputs, g.COMPRESSION))
        if width is not None:
            self.check_size(width, height)
            check_format_size(width, height, output.format, field=g.WIDTH)
        if seed is None:
            seed = secrets.randbelow(DRAWN_SEED_BOUND)
        return ImageRequest(prompt, width, height, num_images, seed, steps, output)

    def check_size(self, width: int, height: int) -> None:
        """A family's own size rule beyond the grid and the area (none here)."""

    def default_size(self) -> tuple[int, int]:
        width, height = parse_size(self.options.default_size)
        check_geometry(width, height, self.multiple, self.options.max_image_area)
        return width, height

    def tokenize(self, prompt: str) -> tuple[np.ndarray, int]:
        messages = [{"role": "user", "content": prompt}]
        with timed("tokenize"):
            chat = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      enable_thinking=self.enable_thinking)
            encoded = self.tokenizer(chat, padding="max_length", max_length=self.text_tokens, truncation=False)
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        if len(ids) > self.text_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens with the chat template exceed the text encoder's "
                             f"{self.text_tokens}-token input; shorten the prompt")
        return np.asarray(ids, dtype=np.int32), int(sum(mask))

    def wants_png_rows(self, output: OutputOptions) -> bool:
        """Whether to ask the decoder for PNG rows (Paeth-filtered on its device, mstar_common/diffusion/png.py):
        for a PNG from our encoder (`MSTAR_PNG_ENCODER=pil` encodes the pixels with PIL instead)."""
        return output.format == "png" and png_encoder() != "pil"

    async def decoded(self, denoised: dict[str, np.ndarray], call: Call, width: int, height: int,
                      png_rows: bool) -> tuple[np.ndarray, bool]:
        """The denoise component's answer decoded: its own (model_kwargs.vae_in_denoise, decoded in that component)
        or the vae_decode component's for its latents; PNG rows if asked for, else pixels. -> (array, is_rows)"""
        for name in (g.PNG_ROWS, g.PIXELS):
            if name in denoised:
                return np.asarray(denoised[name]), name == g.PNG_ROWS
        decoded = await call("vae_decode", {g.LATENTS: denoised[g.LATENTS], g.WIDTH: i32(width), g.HEIGHT: i32(height),
                                            g.WANT_PNG_ROWS: i32(int(png_rows))})
        name = g.PNG_ROWS if g.PNG_ROWS in decoded else g.PIXELS
        return np.asarray(decoded[name]), name == g.PNG_ROWS

    def encode_images(self, images: np.ndarray, output: OutputOptions, png_rows: bool = False) -> list[bytes]:
        """uint8 pixels `[n, H, W, 3]`, or (`png_rows`) the decoder's PNG scanlines `[n, H, 1 + 3W]` -> one encoded
        image each: the scanlines deflated in parallel strips (`mstar_common/diffusion/png.py`); other formats, and
        PNG with MSTAR_PNG_ENCODER=pil, through PIL. Blocking: call it in a thread."""
        with timed(f"encode_images[{DEFLATE}]"):
            if png_rows:
                return [encode_png_rows(rows, 3, output.png_compress_level) for rows in images]
            if self.wants_png_rows(output):
                return [encode_png(p, output.png_compress_level) for p in images]
            return [encode_image(p, output) for p in images]


def concat(parts: list) -> Any:
    """Component outputs joined along the first axis: numpy arrays, or torch tensors (a bfloat16 wire). One part
    is passed on as it is, so the walk router can forward the tensor it received without a copy."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def i32(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int32)


def scalar(inputs: dict[str, np.ndarray], name: str) -> Any:
    if name not in inputs:
        return None
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name}: expected one value, got {values.size}")
    return values[0]


def text(inputs: dict[str, np.ndarray], name: str) -> str | None:
    value = scalar(inputs, name)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: must be UTF-8 text") from None
    return None if value is None else str(value)


def integer(inputs: dict[str, np.ndarray], name: str) -> int | None:
    value = scalar(inputs, name)
    return None if value is None else int(value)


def ranged(inputs: dict[str, np.ndarray], name: str, label: str, low: int, high: int,
           default: int | None) -> int | None:
    value = integer(inputs, name)
    if value is None:
        return default
    if not low <= value <= high:
        raise ValueError(f"{label}: must be in [{low}, {high}], got {value}")
    return value
