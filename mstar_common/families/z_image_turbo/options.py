"""`model_kwargs` of a z_image_turbo deployment: typed, defaulted, strictly checked (unknown keys are refused)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar_common.config import DeploymentError, refuse_repeats
from mstar_common.diffusion import image_options
from mstar_common.diffusion.image_options import DTYPES, LoraAdapter, default_dtype, is_int

__all__ = ["CAPTION_BUCKET", "DTYPES", "TEXT_TOKENS", "ZImageTurboOptions", "options_from_kwargs"]

TEXT_TOKENS = 512  # the caption encoder's input length (prompts are padded to it, never truncated)
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
    # decode the latents inside the denoise component (its own thread and CUDA stream) and answer pixels,
    # instead of the walk's hop to the vae_decode component
    vae_in_denoise: bool = False
    # the blocks' attention and MLP linears as row-wise scaled fp8 (e4m3) GEMMs (mstar_common/layers/fp8_linear.py)
    dit_fp8: bool = False
    # LoRA adapters folded into the DiT's weights at load (fp32, one rounding), so a styled deployment runs at base
    # speed: diffusers/PEFT- or BFL-layout safetensors; DoRA files are refused (docs/z_image_turbo.md)
    lora: tuple[LoraAdapter, ...] = ()
    capture_caption_tokens: list[int] = field(default_factory=lambda: [64, 128])  # padded caption lengths

    def dtype_for(self, device: str) -> str:
        return default_dtype(self.dtype, device)


def options_from_kwargs(kwargs: dict[str, Any], source: str) -> ZImageTurboOptions:
    return image_options.options_from_kwargs(ZImageTurboOptions, kwargs, source, _check)


def _check(key: str, value: Any, where: str) -> Any:
    if key == "capture_caption_tokens":
        if not isinstance(value, list) or not all(is_int(v) and v >= 1 for v in value):
            raise DeploymentError(f"{where}: must be a list of integers >= 1, got {value!r}")
        if any(v % CAPTION_BUCKET or v > TEXT_TOKENS for v in value):
            raise DeploymentError(f"{where}: padded caption lengths are multiples of {CAPTION_BUCKET} up to "
                                  f"{TEXT_TOKENS}, got {value!r}")
        refuse_repeats(value, where, "length")
        return value
    return image_options.check_value(key, value, where)
