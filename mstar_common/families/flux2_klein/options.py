"""`model_kwargs` of a flux2_klein deployment: typed, defaulted, strictly checked (unknown keys are refused)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mstar_common.config import DeploymentError
from mstar_common.diffusion import image_options
from mstar_common.diffusion.image_options import DTYPES, LoraAdapter, default_dtype, is_int
from mstar_common.images import parse_size

__all__ = ["DTYPES", "TEXT_TOKENS", "Flux2KleinOptions", "options_from_kwargs"]

TEXT_TOKENS = 512  # the text encoder's fixed input length (prompts are padded to it, never truncated)


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
    # decode the latents inside the denoise component (its own thread and CUDA stream) and answer pixels,
    # instead of the walk's hop to the vae_decode component
    vae_in_denoise: bool = False
    # the transformer blocks' linears as row-wise scaled fp8 (e4m3) GEMMs (mstar_common/layers/fp8_linear.py):
    # faster on fp8 tensor cores, images close to but not equal to bf16's
    dit_fp8: bool = False
    # LoRA adapters folded into the DiT's weights at load (fp32, one rounding), so a styled deployment runs at base
    # speed: diffusers/PEFT- or BFL-layout safetensors; DoRA files are refused (docs/flux2_klein.md)
    lora: tuple[LoraAdapter, ...] = ()

    @property
    def edit_sizes(self) -> list[str]:
        """The edit buckets captured: `capture_edit_sizes`, else the `capture_sizes` whose area a reference can have
        (references are resized to `max_reference_area`, so a larger bucket would never replay)."""
        if self.capture_edit_sizes is not None:
            return self.capture_edit_sizes
        return [size for size in self.capture_sizes if math.prod(parse_size(size)) <= self.max_reference_area]

    def dtype_for(self, device: str) -> str:
        return default_dtype(self.dtype, device)


def options_from_kwargs(kwargs: dict[str, Any], source: str) -> Flux2KleinOptions:
    return image_options.options_from_kwargs(Flux2KleinOptions, kwargs, source, _check)


def _check(key: str, value: Any, where: str) -> Any:
    if key == "text_encoder_out_layers":
        if not isinstance(value, list) or not value or not all(is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a non-empty list of layer numbers >= 1, got {value!r}")
        return tuple(value)
    if key == "capture_edit_sizes":
        return None if value is None else image_options.check_sizes(value, where)
    return image_options.check_value(key, value, where)
