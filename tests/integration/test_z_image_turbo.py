"""Z-Image-Turbo through a real tritonserver (CPU, the tiny built-in checkpoint) and the proxy: the official `openai`
client generates (b64_json) an image equal to diffusers' `ZImagePipeline` at the same seed; a bad size is a 400
naming the rule; /v1/images/edits is a 400 (the model has no reference-image conditioning); native /generate and
the SDK."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import torch
import yaml
from PIL import Image

from mstar_common.cli import CONFIGS
from mstar_common.config import deployment_from_dict
from tests.integration.conftest import serve_deployment

pytest.importorskip("diffusers")
pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def served_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("zimage-served")
    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    with serve_deployment(deployment_from_dict(raw, source="zimage-test"), root, "zimage-test") as served:
        yield served


@pytest.fixture(scope="module")
def oai(served_images):
    return openai.OpenAI(base_url=served_images.proxy_url + "/v1", api_key="none", max_retries=0, timeout=120)


def pixels(b64: str) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_openai_generate_equals_the_diffusers_pipeline(served_images, oai):
    from diffusers import ZImagePipeline

    result = oai.images.generate(model=served_images.dep.name, prompt="a lighthouse at dawn", size="96x64", n=2,
                                 response_format="b64_json", extra_body={"seed": 21, "num_inference_steps": 3})
    assert result.model_extra["seed"] == 21 and len(result.data) == 2
    pipe = ZImagePipeline.from_pretrained(served_images.checkpoint)
    want = pipe(prompt="a lighthouse at dawn", width=96, height=64, num_inference_steps=3, guidance_scale=0.0,
                num_images_per_prompt=2, generator=torch.Generator().manual_seed(21), output_type="np").images
    want = (want * 255).round().astype(np.uint8)
    for data, expected in zip(result.data, want, strict=True):
        assert np.array_equal(pixels(data.b64_json), expected)


@pytest.mark.parametrize("size,rule", [("100x100", "multiples of 16"), ("512x512", "max_image_area")])
def test_bad_size_is_a_400_naming_the_rule(served_images, oai, size, rule):
    with pytest.raises(openai.BadRequestError) as error:
        oai.images.generate(model=served_images.dep.name, prompt="x", size=size)
    assert error.value.status_code == 400 and rule in error.value.body["message"]


def test_edits_are_refused(served_images, oai):
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64)).save(buffer, format="PNG")
    with pytest.raises(openai.BadRequestError) as error:
        oai.images.edit(model=served_images.dep.name, image=("a.png", buffer.getvalue(), "image/png"), prompt="x")
    assert error.value.status_code == 400 and "text-to-image only" in error.value.body["message"]


def test_native_generate_and_sdk(served_images):
    import httpx

    from mstar import MStarClient

    reply = httpx.post(served_images.proxy_url + "/generate", timeout=60,
                       json={"text": "a cat", "output_modalities": ["image"],
                             "model_kwargs": {"size": "64x48", "seed": 3, "num_inference_steps": 2}})
    assert reply.status_code == 200 and reply.json()["seed"] == 3
    assert pixels(reply.json()["outputs"]["image"][0]).shape == (48, 64, 3)
    image = MStarClient(served_images.proxy_url).generate_image("a cat", width=48, height=32, seed=0)
    assert np.array(Image.open(io.BytesIO(image))).shape == (32, 48, 3)
