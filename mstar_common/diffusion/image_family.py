"""What the image families share as a `Family`: the deployment checks (typed `model_kwargs`, CUDA graphs on the
denoise step only, the walk router on the cpu), the component dispatch with its pipeline check and load log, and
the walk's tokenizer.

A family supplies its component builders; its package `mstar_common/families/<name>/` provides
`options.options_from_kwargs`, `loader.check_pipeline` and `tiny.build_tiny_checkpoint` (imported when first
used, so the registry imports no torch or diffusers)."""

from __future__ import annotations

import importlib
import logging
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import AdmissionConfig, Deployment, DeploymentError, Resources
from mstar_common.families.base import Family, refuse_upload_limit
from mstar_common.images import check_geometry, parse_size

logger = logging.getLogger(__name__)

Builder = Callable[[Deployment, Any, Path, str], Any]  # (deployment, options, checkpoint, device) -> runtime


class ImageFamily(Family):
    proxy_kind: ClassVar[str] = "image"

    @abstractmethod
    def builders(self) -> dict[str, Builder]:
        """Component name -> its builder."""

    def options_from_kwargs(self, kwargs: dict[str, Any], source: str) -> Any:
        """The family's typed `model_kwargs` (a DeploymentError names the key)."""
        return family_module(self.name, "options").options_from_kwargs(kwargs, source)

    @abstractmethod
    def grid_multiple(self, checkpoint: Path) -> int:
        """Pixels per latent token side (the VAE's downscale times the DiT's patch): image sides are multiples."""

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """default_size, and the captured sizes where the denoise step is captured, on this checkpoint's grid and
        within max_image_area (a request without a size takes the default: off the grid, every one is a 400); the
        LoRA adapters against the checkpoint's DiT."""
        try:
            self.check_pipeline(checkpoint)
            family_module(self.name, "loader").scheduler_config(checkpoint)  # refused only as the denoise loaded
        except ValueError as exc:  # a pipeline this family does not serve
            raise DeploymentError(f"{source}: checkpoint {checkpoint}: {exc}") from None
        options = self.options_from_kwargs(dep.model_kwargs, source)
        if options.lora:  # every adapter against this DiT, from the files' headers, before any weights load
            try:
                family_module(self.name, "loader").check_lora(checkpoint, options.lora)
            except ValueError as exc:
                raise DeploymentError(f"{source}: model_kwargs.lora: {exc}") from None
        multiple, max_sides = self.grid_multiple(checkpoint), self.max_sides(checkpoint)
        sizes = {"default_size": [options.default_size]}
        if dep.components["denoise"].cuda_graphs:
            sizes["capture_sizes"] = options.capture_sizes
            sizes["capture_edit_sizes"] = getattr(options, "capture_edit_sizes", None) or []
        for key, values in sizes.items():
            for size in values:
                try:
                    check_geometry(*parse_size(size), multiple, options.max_image_area, field=f"model_kwargs.{key}")
                except ValueError as exc:
                    raise DeploymentError(f"{source}: {exc}") from None
                width, height = parse_size(size)
                if max_sides is not None and (width > max_sides[0] or height > max_sides[1]):
                    # every request is held to them: past them, each request without a size was a 400 naming
                    # `size`, which its client never sent, and a captured size never replayed
                    raise DeploymentError(f"{source}: model_kwargs.{key}: {size} exceeds this checkpoint's RoPE "
                                          f"range of {max_sides[0]}x{max_sides[1]} (transformer axes_lens), which "
                                          f"every request is held to")

    def max_sides(self, checkpoint: Path) -> tuple[int, int] | None:
        """(width, height) in pixels past which this checkpoint's DiT refuses an image (its RoPE range), or None."""
        return None

    def check_pipeline(self, checkpoint: Path) -> None:
        """Refuse a checkpoint this family does not serve (model_index.json)."""
        family_module(self.name, "loader").check_pipeline(checkpoint)

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        refuse_upload_limit(dep, source)
        options = self.options_from_kwargs(dep.model_kwargs, source)
        if dep.components["denoise"].cuda_graphs:  # a capture list left empty would capture nothing, silently
            empty = [key for key in ("capture_batch_sizes", "capture_caption_tokens")
                     if getattr(options, key, None) == []]
            if not options.capture_sizes and not getattr(options, "edit_sizes", []):
                empty.insert(0, "capture_sizes")
            if empty:
                raise DeploymentError(f"{source}: model_kwargs.{empty[0]}: empty while components.denoise.cuda_graphs "
                                      f"is true, so no denoise step would be captured; list what to capture, or set "
                                      f"cuda_graphs: false")
        default = Resources()
        for key in ("kv_cache", "max_model_len", "max_batch_tokens"):  # what nothing here reads is refused (§16.3)
            if getattr(dep.resources, key) != getattr(default, key):
                raise DeploymentError(f"{source}: resources.{key}: an image family has no KV pool, token budget or "
                                      f"sequence length to set (its components batch whole images); remove it "
                                      f"(model_kwargs sets sizes and batches, docs/{self.name}.md)")
        if dep.admission.queue_timeout_s != AdmissionConfig().queue_timeout_s:
            raise DeploymentError(f"{source}: admission.queue_timeout_s: an image walk does not wait for admission: "
                                  f"past max_concurrent_requests + admission.max_queue walks a request is refused at "
                                  f"once (429), and an admitted one ends at admission.request_timeout_s (504); remove "
                                  f"it")
        for name, comp in dep.components.items():
            if comp.cuda_graphs and name not in CAPTURED:
                raise DeploymentError(f"{source}: components.{name}.cuda_graphs: only the denoise step and the text "
                                      "encoder are captured")
        if dep.components["walk"].placement.device != "cpu":
            raise DeploymentError(f"{source}: components.walk.placement: the walk router runs on the cpu")

    def wire_dtype(self, dep: Deployment) -> str:
        """The components' dtype when they all compute in one (placements on the cpu and a gpu may differ: the
        default is float32 on the cpu and bfloat16 on a gpu), else FP32."""
        options = self.options_from_kwargs(dep.model_kwargs, dep.name)
        dtypes = {options.dtype_for("cpu" if comp.placement.device == "cpu" else "cuda")
                  for name, comp in dep.components.items() if self.graph.components[name].kind != "walk_router"}
        return WIRE_DTYPES[dtypes.pop()] if len(dtypes) == 1 else "FP32"

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        options = self.options_from_kwargs(dep.model_kwargs, dep.name)
        builders = self.builders()
        if component not in builders:
            raise KeyError(f"{self.name} has no component {component!r}; it has {sorted(builders)}")
        self.check_checkpoint(dep, checkpoint, dep.name)  # the pipeline's class first
        runtime = builders[component](dep, options, checkpoint, device)
        logger.info("[%s/%s] loaded %s on %s (%s)", self.name, component, checkpoint.name, device,
                    options.dtype_for(device))
        return runtime


WIRE_DTYPES = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}  # model_kwargs.dtype -> Triton's
CAPTURED = ("denoise", "text_encoder")  # the components whose forwards can be captured as CUDA graphs


def captures(dep: Deployment, component: str, device: str) -> bool:
    """Whether `component` runs captured CUDA graphs: asked for, and on a gpu."""
    return dep.components[component].cuda_graphs and device.startswith("cuda")


def quantize_dit_fp8(modules: list[Any], device: str) -> int:
    """`model_kwargs.dit_fp8`: every eligible linear under `modules` (a family's transformer blocks, or their
    attention and MLP parts) becomes a row-wise scaled e4m3 GEMM (mstar_common/layers/fp8_linear.py). Refused
    on a GPU without fp8 tensor cores (compute capability < 8.9)."""
    import torch

    from mstar_common.layers.fp8_linear import quantize_linears

    if device.startswith("cuda") and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
        raise DeploymentError(f"model_kwargs.dit_fp8: needs fp8 tensor cores (compute capability >= 8.9); "
                              f"{torch.cuda.get_device_name(torch.device(device))} has none")
    count = sum(quantize_linears(module) for module in modules)
    logger.info("dit_fp8: %d transformer linears run as row-wise scaled e4m3 GEMMs", count)
    return count


def family_module(family: str, module: str) -> Any:
    return importlib.import_module(f"mstar_common.families.{family}.{module}")


def tiny_builder(family: str) -> Callable[[Path], Path]:
    """`family`'s `tiny.build_tiny_checkpoint`, imported on the first build."""

    def build(out_dir: Path) -> Path:
        return family_module(family, "tiny").build_tiny_checkpoint(out_dir)

    return build


def load_walk_tokenizer(checkpoint: Path) -> Any:
    """The checkpoint's tokenizer, padding on the right to the text encoder's fixed input."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint / "tokenizer"))
    if tokenizer.pad_token_id is None:
        raise DeploymentError("checkpoint tokenizer has no pad token; the text encoder input is padded to 512")
    if getattr(tokenizer, "padding_side", "right") != "right":
        tokenizer.padding_side = "right"  # the text encoder reads each row's first text_len ids
    return tokenizer
