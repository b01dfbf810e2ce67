"""`model_kwargs` of a z_image_turbo deployment: typed, defaulted, strictly checked (unknown keys are refused)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mstar_common.config import DeploymentError
from mstar_common.images import parse_size

TEXT_TOKENS = 512  # the caption encoder's input length (prompts are padded to it, never truncated)
DTYPES = ("float32", "bfloat16", "float16")
CAPTION_BUCKET = 32  # the DiT pads captions to a multiple of this; rows batch per bucket


@dataclass(frozen=True, slots=True)
class ZImageTurboOptions:
    dtype: str | None = None  # float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on gpu)
    default_size: str = "1024x1024"  # WxH when a request names none
    default_num_inference_steps: int = 8  # the distilled sampler's step count
    max_inference_steps: int = 50
    max_image_area: int = 2048 * 2048  # output pixels; larger requests are a 400
    max_images_per_request: int = 4  # OpenAI `n`
    max_batch_size: int = 8  # image rows per denoise step
    text_encoder_max_batch: int = 8  # prompts per text-encoder forward
    vae_max_batch: int = 4  # images per VAE decode forward
    capture_sizes: list[str] = field(default_factory=lambda: ["1024x1024"])  # WxH of captured denoise steps
    capture_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    capture_caption_tokens: list[int] = field(default_factory=lambda: [64, 128])  # padded caption lengths

    def dtype_for(self, device: str) -> str:
        return self.dtype or ("float32" if device == "cpu" else "bfloat16")


def options_from_kwargs(kwargs: dict[str, Any], source: str) -> ZImageTurboOptions:
    names = {f.name for f in dataclasses.fields(ZImageTurboOptions)}
    if unknown := sorted(set(kwargs) - names):
        raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: {sorted(names)}")
    options = ZImageTurboOptions(**{key: _check(key, value, f"{source}: model_kwargs.{key}")
                                    for key, value in kwargs.items()})
    _check_relations(options, f"{source}: model_kwargs")
    return options


def _check(key: str, value: Any, where: str) -> Any:
    if key == "dtype":
        if value is not None and value not in DTYPES:
            raise DeploymentError(f"{where}: must be one of {list(DTYPES)}, got {value!r}")
        return value
    if key == "default_size":
        return _size(value, where)
    if key == "capture_sizes":
        if not isinstance(value, list):
            raise DeploymentError(f"{where}: must be a list of 'WxH' sizes, got {value!r}")
        return [_size(v, where) for v in value]
    if key in ("capture_batch_sizes", "capture_caption_tokens"):
        if not isinstance(value, list) or not all(_is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a list of integers >= 1, got {value!r}")
        if key == "capture_caption_tokens" and any(v % CAPTION_BUCKET or v > TEXT_TOKENS for v in value):
            raise DeploymentError(f"{where}: padded caption lengths are multiples of {CAPTION_BUCKET} up to "
                                  f"{TEXT_TOKENS}, got {value!r}")
        return value
    if not _is_int(value) or value < 1:
        raise DeploymentError(f"{where}: must be an integer >= 1, got {value!r}")
    return value


def _check_relations(options: ZImageTurboOptions, where: str) -> None:
    if options.default_num_inference_steps > options.max_inference_steps:
        raise DeploymentError(f"{where}.default_num_inference_steps: {options.default_num_inference_steps} exceeds "
                              f"max_inference_steps={options.max_inference_steps}")
    for other in ("max_batch_size", "vae_max_batch"):
        if options.max_images_per_request > getattr(options, other):
            raise DeploymentError(f"{where}.max_images_per_request: {options.max_images_per_request} exceeds "
                                  f"{other}={getattr(options, other)} (a request's images step and decode together)")
    if any(b > options.max_batch_size for b in options.capture_batch_sizes):
        raise DeploymentError(f"{where}.capture_batch_sizes: {options.capture_batch_sizes} has sizes above "
                              f"max_batch_size={options.max_batch_size}; such graphs would never replay")


def _size(value: Any, where: str) -> str:
    try:
        width, height = parse_size(value)
    except ValueError as exc:
        raise DeploymentError(f"{where}: {exc}") from None
    return f"{width}x{height}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
