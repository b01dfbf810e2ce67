"""Reading a diffusers-layout checkpoint into the image families' modules: its JSON files, the pipeline class
check, the Qwen3 text encoder's config, and `load_module`, which fills a module from a safetensors folder and
checks coverage both ways (a parameter or buffer the checkpoint does not fill fails the load, and so does a
checkpoint tensor that nothing reads, except the tensors a component knowingly skips)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar_common.config import env_switch
from mstar_common.families.qwen3.modeling import Qwen3Config
from mstar_common.layers.rotary import rope_theta_from_config
from mstar_common.safetensors_io import format_names, iter_tensors

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kernels_enabled(device: str) -> bool:
    """Whether a loaded module runs its fused Triton kernels: on CUDA, unless `MSTAR_DIFFUSION_KERNELS=0`."""
    return torch.device(device).type == "cuda" and env_switch("MSTAR_DIFFUSION_KERNELS", True)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file missing: {path.parent.name}/{path.name}")
    return json.loads(path.read_text())


def check_pipeline_class(root: Path, classes: tuple[str, ...], family: str) -> dict[str, Any]:
    """model_index.json, if it names one of `classes`; else a ValueError saying what `family` serves."""
    index = read_json(root / "model_index.json")
    if index.get("_class_name") not in classes:
        raise ValueError(f"model_index.json _class_name={index.get('_class_name')!r}: {family} serves "
                         f"{list(classes)}")
    scheduler = index.get("scheduler")  # the class diffusers builds, whatever scheduler_config.json says
    if scheduler is not None and (not isinstance(scheduler, list) or scheduler[-1:] != [SCHEDULER_CLASS]):
        raise ValueError(f"model_index.json scheduler={scheduler!r}: {family} samples with "
                         f"{SCHEDULER_CLASS} (diffusers builds the class named here)")
    return index


SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def qwen3_text_encoder_config(root: Path) -> Qwen3Config:
    raw = read_json(root / "text_encoder" / "config.json")
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"text_encoder/config.json model_type={raw.get('model_type')!r}: only 'qwen3' is supported")
    rope_theta_from_config(raw)  # the caption encoders rotate with plain RoPE: a scaled one is refused, not ignored
    return Qwen3Config.from_hf(raw)


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


@torch.no_grad()
def load_module(build: Callable[[], nn.Module], folder: Path, stem: str, skipped: Callable[[str], bool],
                dtype: str, device: str, rename: Callable[[str], str] | None = None,
                adjust: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Any:
    """Build a module and fill it from a diffusers/HF safetensors folder (checkpoint names, after `rename`,
    are module names), checking coverage both ways. `adjust(name, tensor)` may replace a checkpoint tensor before
    it is cast to `dtype` (the LoRA fold: its fp32 sum is rounded once, here)."""
    # Build on meta and materialise uninitialised: random init of a multi-billion-parameter model costs seconds.
    with torch.device("meta"):
        module = build()
    module = module.to(dtype=resolve_dtype(dtype)).to_empty(device=device)
    targets = module.state_dict(keep_vars=True)
    filled: set[str] = set()
    unused: list[str] = []
    for name, tensor in iter_tensors(folder, stem):
        name = rename(name) if rename is not None else name
        if name in targets:
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{folder.name}/{name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.data.copy_(adjust(name, tensor) if adjust is not None else tensor)
            filled.add(name)
        elif not skipped(name):
            unused.append(name)
    missing = sorted(set(targets) - filled)
    if missing or unused:
        raise ValueError(f"checkpoint folder {folder.name} does not match {type(module).__name__}: missing "
                         f"{format_names(missing)}; unused checkpoint tensors {format_names(sorted(unused))}")
    logger.info("loaded %s from %s (%d tensors)", type(module).__name__, folder.name, len(filled))
    return module.eval()


def load_vae_decoder(build: Callable[[], nn.Module], root: Path, dtype: str, device: str) -> Any:
    """The decoder half of `root/vae` (the encoder half is knowingly skipped)."""
    return load_module(build, root / "vae", "diffusion_pytorch_model",
                       lambda name: name.startswith(("encoder.", "quant_conv.")), dtype, device)
