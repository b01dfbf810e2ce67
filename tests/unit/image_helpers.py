"""Helpers of the image families' parity tests: entry requests, decoded images and their PSNR, the reference
tokenization, the solo-versus-batched run and the loader's two-way coverage check."""

from __future__ import annotations

import asyncio
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mstar_common.local_walk import LocalWalk


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def decode(data: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(data)))


def request(prompt: str, width: int | None = None, height: int | None = None, seed: int = 0, **extra):
    inputs = {"prompt": np.array([prompt.encode()], dtype=object), "seed": np.array([seed], np.int64)}
    if width is not None:
        inputs["width"], inputs["height"] = np.array([width], np.int32), np.array([height], np.int32)
    for name, value in extra.items():
        inputs[name] = value if isinstance(value, np.ndarray) else np.array([value], np.int32)
    return inputs


def prompt_ids(pipe, prompts: list[str], enable_thinking: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference pipeline's padded chat-template ids and real lengths."""
    rows, lens = [], []
    for prompt in prompts:
        text = pipe.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=enable_thinking)
        encoded = pipe.tokenizer(text, padding="max_length", max_length=512)
        rows.append(encoded["input_ids"])
        lens.append(sum(encoded["attention_mask"]))
    return torch.tensor(rows), torch.tensor(lens)


def run_solo_and_batched(family, deployment, checkpoint: Path, requests: list[dict]):
    """Each request alone, then all at once: (solo outputs, batched outputs, (denoise steps, rows stepped) of the
    batched run)."""

    async def run():
        async with LocalWalk(family, deployment, checkpoint) as walk:
            solo = [await walk.run(r) for r in requests]
            engine = walk.components["denoise"].engine
            before = (engine.num_steps, engine.num_rows_stepped)
            together = await asyncio.gather(*(walk.run(r) for r in requests))
            return solo, together, (engine.num_steps - before[0], engine.num_rows_stepped - before[1])

    return asyncio.run(run())


def assert_batched_images_match(solo: list[dict], together: list[dict], min_psnr: float) -> None:
    for alone, batched in zip(solo, together, strict=True):
        for a, b in zip(alone["images"], batched["images"], strict=True):
            assert psnr(decode(a), decode(b)) >= min_psnr


def assert_transformer_coverage_checked(loader, checkpoint: Path, tmp_path: Path, required: str) -> Path:
    """An extra transformer tensor and a missing one (`required`) both fail the load; returns the broken copy."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint, broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors["extra.weight"] = torch.zeros(1)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match="unused checkpoint tensors extra.weight"):
        loader.load_transformer(broken, "float32", "cpu")
    del tensors["extra.weight"], tensors[required]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"missing {required}"):
        loader.load_transformer(broken, "float32", "cpu")
    return broken


def assert_vae_in_denoise_matches_the_hop(family, make_deployment, checkpoint: Path, requests: list[dict]) -> None:
    """model_kwargs.vae_in_denoise: the denoise component decodes on its own thread and answers pixels, the walk
    skips the vae_decode hop. The first request, alone, gives the hop path's images byte for byte (fp32 CPU); run
    together, each path's decoder batches whatever finished together, and a batch of other rows rounds the last
    bits differently, so those are held to the batching tests' 60 dB."""

    async def run(dep):
        async with LocalWalk(family, dep, checkpoint) as walk:
            outputs = [await walk.run(requests[0])] + list(await asyncio.gather(*(walk.run(r) for r in requests)))
            return outputs, walk.components["vae_decode"].engine.num_batches, walk.components["denoise"]

    hop, hop_decodes, _ = asyncio.run(run(make_deployment(checkpoint)))
    local, local_decodes, denoise = asyncio.run(run(make_deployment(checkpoint, vae_in_denoise=True)))
    assert hop_decodes > 0 and local_decodes == 0
    rows = sum(int(r.get("num_images", np.array([1]))[0]) for r in requests) + int(
        requests[0].get("num_images", np.array([1]))[0])
    assert denoise.decoder is not None and denoise.decoder.engine.num_rows_run == rows
    assert list(hop[0]["images"]) == list(local[0]["images"])
    assert [a["seed"] for a in hop] == [b["seed"] for b in local]
    assert_batched_images_match(hop[1:], local[1:], 60.0)


def fp8_against_full_precision(family, make_deployment, checkpoint: Path, inputs: dict):
    """model_kwargs.dit_fp8: one request through the full-precision walk and through the fp8 one; returns (the
    two images' PSNR, the fp8 walk's transformer)."""

    async def run(dep):
        async with LocalWalk(family, dep, checkpoint) as walk:
            return await walk.run(inputs), walk.components["denoise"].model

    full, _ = asyncio.run(run(make_deployment(checkpoint)))
    fp8, model = asyncio.run(run(make_deployment(checkpoint, dit_fp8=True)))
    return psnr(decode(full["images"][0]), decode(fp8["images"][0])), model
