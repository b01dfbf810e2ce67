"""Checks of the `model_kwargs` every image family takes (dtype, sizes, limits, batch and capture sizes): the
family's options dataclass is filled from YAML here, unknown keys refused, and each error names the key."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mstar_common.checkpoints import expand_home
from mstar_common.config import DeploymentError, is_finite_number, refuse_repeats
from mstar_common.images import parse_size

DTYPES = ("float32", "bfloat16", "float16")
MAX_REFERENCE_IMAGES = 4  # FLUX.2 [klein]'s edits: up to four references (the proxy's upload cap is this one)

Options = TypeVar("Options")
KeyCheck = Callable[[str, Any, str], Any]  # (key, YAML value, where) -> the field's value


def options_from_kwargs(cls: type[Options], kwargs: dict[str, Any], source: str, check: KeyCheck) -> Options:
    """`cls(**kwargs)`, each value through `check` (the family's keys, then `check_value`), then `check_relations`."""
    names = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(kwargs) - names):
        raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: {sorted(names)}")
    options = cls(**{key: check(key, value, f"{source}: model_kwargs.{key}") for key, value in kwargs.items()})
    check_relations(options, f"{source}: model_kwargs")
    return options


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One entry of `model_kwargs.lora`: an adapter folded into the DiT's weights at load
    (`mstar_common/diffusion/dit_lora.py`)."""

    path: str  # a .safetensors file, or a folder holding exactly one
    scale: float = 1.0  # multiplies the adapter's own alpha/r (PEFT's scaling)


def check_value(key: str, value: Any, where: str) -> Any:
    """The shared keys: dtype, default_size, capture_sizes, capture_batch_sizes, vae_in_denoise, dit_fp8, lora; any
    other is an integer >= 1."""
    if key == "dtype":
        if value is not None and value not in DTYPES:
            raise DeploymentError(f"{where}: must be one of {list(DTYPES)}, got {value!r}")
        return value
    if key == "default_size":
        return check_size(value, where)
    if key == "capture_sizes":
        return check_sizes(value, where)
    if key in ("vae_in_denoise", "dit_fp8"):
        if not isinstance(value, bool):
            raise DeploymentError(f"{where}: must be true or false, got {value!r}")
        return value
    if key == "capture_batch_sizes":
        if not isinstance(value, list) or not all(is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a list of batch sizes >= 1, got {value!r}")
        refuse_repeats(value, where, "batch size")
        return value
    if key == "lora":
        return check_lora(value, where)
    if not is_int(value) or value < 1:
        raise DeploymentError(f"{where}: must be an integer >= 1, got {value!r}")
    if key == "max_reference_images" and value > MAX_REFERENCE_IMAGES:
        raise DeploymentError(f"{where}: at most {MAX_REFERENCE_IMAGES} (the model's reference-image limit, which "
                              f"the proxy's uploads also hold to), got {value}")
    return value


def check_lora(value: Any, where: str) -> tuple[LoraAdapter, ...]:
    """`[{path, scale}]`: each path an existing adapter file (refused here, before any weights load), each scale
    a finite number (default 1.0)."""
    if not isinstance(value, list):
        raise DeploymentError(f"{where}: must be a list of {{path, scale}} mappings, got {value!r}")
    adapters = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise DeploymentError(f"{at}: must be a mapping with path (and scale), got {entry!r}")
        if unknown := sorted(set(entry) - {"path", "scale"}):
            raise DeploymentError(f"{at}: unknown key(s) {unknown}; allowed: ['path', 'scale']")
        path, scale = entry.get("path"), entry.get("scale", 1.0)
        if not isinstance(path, str) or not path:
            raise DeploymentError(f"{at}.path: must be the path of a LoRA .safetensors file, got {path!r}")
        try:
            exists = expand_home(path).exists()
        except FileNotFoundError as exc:
            raise DeploymentError(f"{at}.path: {exc}") from None
        if not exists:
            raise DeploymentError(f"{at}.path: {path} does not exist")
        if not is_finite_number(scale):
            raise DeploymentError(f"{at}.scale: must be a finite number, got {scale!r}")
        adapters.append(LoraAdapter(path, float(scale)))
    return tuple(adapters)


def check_relations(options: Any, where: str) -> None:
    if options.default_num_inference_steps > options.max_inference_steps:
        raise DeploymentError(f"{where}.default_num_inference_steps: {options.default_num_inference_steps} exceeds "
                              f"max_inference_steps={options.max_inference_steps}")
    if options.max_images_per_request > options.max_batch_size:
        raise DeploymentError(f"{where}.max_images_per_request: {options.max_images_per_request} exceeds "
                              f"max_batch_size={options.max_batch_size} (a request's images step together)")
    if options.max_images_per_request > options.vae_max_batch:
        raise DeploymentError(f"{where}.max_images_per_request: {options.max_images_per_request} exceeds "
                              f"vae_max_batch={options.vae_max_batch} (a request's images decode together)")
    width, height = parse_size(options.default_size)
    if width * height > options.max_image_area:
        raise DeploymentError(f"{where}.default_size: {options.default_size} = {width * height} pixels exceeds "
                              f"max_image_area={options.max_image_area} (every request without a size would be "
                              f"refused)")
    reference_area = getattr(options, "max_reference_area", None)  # the families that take reference images
    if reference_area is not None and reference_area > options.max_image_area:
        raise DeploymentError(f"{where}.max_reference_area: {reference_area} exceeds max_image_area="
                              f"{options.max_image_area} (an edit without a size takes its first reference's, "
                              f"up to max_reference_area, and would be refused)")
    edit_sizes = getattr(options, "capture_edit_sizes", None)  # one reference of the output size, given
    if edit_sizes and reference_area is not None:
        if too_large := [s for s in edit_sizes if math.prod(parse_size(s)) > reference_area]:
            raise DeploymentError(f"{where}.capture_edit_sizes: {too_large} exceed max_reference_area="
                                  f"{reference_area}; an edit's references are resized to that area, so such graphs "
                                  f"(one reference of the output size) would never replay")
    if any(b > options.max_batch_size for b in options.capture_batch_sizes):
        raise DeploymentError(f"{where}.capture_batch_sizes: {options.capture_batch_sizes} has sizes above "
                              f"max_batch_size={options.max_batch_size}; such graphs would never replay")


def default_dtype(dtype: str | None, device: str) -> str:
    """The configured dtype, else float32 on the cpu and bfloat16 on a gpu."""
    return dtype or ("float32" if device == "cpu" else "bfloat16")


def check_sizes(value: Any, where: str) -> list[str]:
    if not isinstance(value, list):
        raise DeploymentError(f"{where}: must be a list of 'WxH' sizes, got {value!r}")
    sizes = [check_size(v, where) for v in value]
    refuse_repeats(sizes, where)
    return sizes


def check_size(value: Any, where: str) -> str:
    try:
        width, height = parse_size(value)
    except ValueError as exc:
        raise DeploymentError(f"{where}: {exc}") from None
    return f"{width}x{height}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
