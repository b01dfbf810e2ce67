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


def test_the_walk_applies_its_cap_and_its_deadline(tmp_path_factory):
    """The walk router's own admission (cap 1 + queue 1 here: the third of three at once is overloaded, a 429
    through the proxy) and deadline (a Triton client's timeout ends the request with deadline_exceeded when it
    passes, not when the work is done)."""
    import queue
    import threading
    import time

    import httpx
    import tritonclient.grpc as grpcclient

    from mstar_common import wire

    root = tmp_path_factory.mktemp("zimage-limits")
    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    raw["max_concurrent_requests"], raw["admission"] = 1, {"max_queue": 1}
    heavy = {"prompt": "a cat", "size": "256x256", "n": 4, "num_inference_steps": 40}
    with serve_deployment(deployment_from_dict(raw, source="zimage-limits"), root, "zimage-limits") as served:
        url = served.proxy_url + "/v1/images/generations"
        replies: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: replies.append(
            httpx.post(url, json={"model": served.dep.name, **heavy}, timeout=120))) for _ in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(120)
        codes = sorted(r.status_code for r in replies)
        assert codes == [200, 200, 429], [r.text for r in replies]
        assert "cap of 1 running and 1 queued" in next(r for r in replies if r.status_code == 429).text

        inputs = []
        for name, value in (("prompt", "a cat"), ("width", 256), ("height", 256), ("num_images", 4),
                            ("num_inference_steps", 40)):
            dtype, np_dtype = wire.IMAGE_INPUTS[name]
            array = np.array([value.encode() if dtype == "BYTES" else value], dtype=np_dtype)
            tensor = grpcclient.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(served.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((time.monotonic(), error)))
        started = time.monotonic()
        client.async_stream_infer(served.entry, inputs, timeout=300_000)  # microseconds
        at, error = results.get(timeout=60)
        client.stop_stream()
        client.close()
        assert error is not None and "deadline_exceeded" in str(error) and "0.3 s" in str(error)
        assert at - started < 1.2  # the work itself takes several seconds on this machine
        time.sleep(5)  # the abandoned work ends; the server serves on
        ok = httpx.post(url, json={"model": served.dep.name, "prompt": "x", "size": "64x64"}, timeout=60)
        assert ok.status_code == 200, ok.text
