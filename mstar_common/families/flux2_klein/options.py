"""`model_kwargs` of a flux2_klein deployment: typed, defaulted, strictly checked (unknown keys are refused)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mstar_common.config import DeploymentError
from mstar_common.images import parse_size

TEXT_TOKENS = 512  # the text encoder's fixed input length (prompts are padded to it, never truncated)
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class Flux2KleinOptions:
    dtype: str | None = None  # float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on gpu)
    text_encoder_out_layers: tuple[int, ...] = (9, 18, 27)  # Qwen3 layers whose outputs the DiT reads
    default_size: str = "1024x1024"  # WxH when a request names none (edits default to the first reference's)
    default_num_inference_steps: int = 4  # the distilled sampler's step count
    max_inference_steps: int = 50
    max_image_area: int = 2048 * 2048  # output pixels; larger requests are a 400
    max_images_per_request: int = 4  # OpenAI `n`
    max_reference_images: int = 4
    max_reference_area: int = 1024 * 1024  # larger references are resized to this area, as the reference does
    max_batch_size: int = 8  # image rows per denoise step
    text_encoder_max_batch: int = 8  # prompts per text-encoder forward
    vae_max_batch: int = 4  # images per VAE encode / decode forward
    capture_sizes: list[str] = field(default_factory=lambda: ["1024x1024"])  # WxH of captured denoise steps
    capture_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    capture_edit_sizes: list[str] | None = None  # one reference of the output size; None: capture_sizes

    @property
    def edit_sizes(self) -> list[str]:
        return self.capture_sizes if self.capture_edit_sizes is None else self.capture_edit_sizes

    def dtype_for(self, device: str) -> str:
        return self.dtype or ("float32" if device == "cpu" else "bfloat16")


def options_from_kwargs(kwargs: dict[str, Any], source: str) -> Flux2KleinOptions:
    names = {f.name: f for f in dataclasses.fields(Flux2KleinOptions)}
    if unknown := sorted(set(kwargs) - set(names)):
        raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: {sorted(names)}")
    values = {}
    for key, value in kwargs.items():
        values[key] = _check(key, value, f"{source}: model_kwargs.{key}")
    options = Flux2KleinOptions(**values)
    _check_relations(options, source)
    return options


def _check(key: str, value: Any, where: str) -> Any:
    if key == "dtype":
        if value is not None and value not in DTYPES:
            raise DeploymentError(f"{where}: must be one of {list(DTYPES)}, got {value!r}")
        return value
    if key == "text_encoder_out_layers":
        if not isinstance(value, list) or not value or not all(_is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a non-empty list of layer numbers >= 1, got {value!r}")
        return tuple(value)
    if key in ("default_size",):
        return _size(value, where)
    if key in ("capture_sizes", "capture_edit_sizes"):
        if value is None and key == "capture_edit_sizes":
            return None
        if not isinstance(value, list):
            raise DeploymentError(f"{where}: must be a list of 'WxH' sizes, got {value!r}")
        return [_size(v, where) for v in value]
    if key == "capture_batch_sizes":
        if not isinstance(value, list) or not all(_is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a list of batch sizes >= 1, got {value!r}")
        return value
    if not _is_int(value) or value < 1:
        raise DeploymentError(f"{where}: must be an integer >= 1, got {value!r}")
    return value


def _check_relations(options: Flux2KleinOptions, source: str) -> None:
    where = f"{source}: model_kwargs"
    if options.default_num_inference_steps > options.max_inference_steps:
        raise DeploymentError(f"{where}.default_num_inference_steps: {options.default_num_inference_steps} exceeds "
                              f"max_inference_steps={options.max_inference_steps}")
    if options.max_images_per_request > options.max_batch_size:
        raise DeploymentError(f"{where}.max_images_per_request: {options.max_images_per_request} exceeds "
                              f"max_batch_size={options.max_batch_size} (a request's images step together)")
    if options.max_images_per_request > options.vae_max_batch:
        raise DeploymentError(f"{where}.max_images_per_request: {options.max_images_per_request} exceeds "
                              f"vae_max_batch={options.vae_max_batch} (a request's images decode together)")
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
