"""flux2_klein deployments: model_kwargs checks, the generated repository (walk router entry + four component
nodes), and the walk's own refusals (prompt too long for the 512-token encoder, reference-image rules)."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import yaml
from PIL import Image

from mstar_common.cli import CONFIGS
from mstar_common.config import DeploymentError, deployment_from_dict, load_deployment
from mstar_common.families.flux2_klein.options import Flux2KleinOptions
from mstar_common.repository import entry_model, render_repository

BASE = yaml.safe_load((CONFIGS / "flux2_klein.yaml").read_text())


def with_kwargs(**model_kwargs):
    return deployment_from_dict({**BASE, "model_kwargs": {**BASE["model_kwargs"], **model_kwargs}}, source="t.yaml")


@pytest.mark.parametrize("kwargs,message", [
    ({"colour": 1}, "unknown key"),
    ({"dtype": "int8"}, "model_kwargs.dtype"),
    ({"default_size": "big"}, "model_kwargs.default_size"),
    ({"max_batch_size": 0}, "model_kwargs.max_batch_size"),
    ({"max_images_per_request": 9}, "exceeds max_batch_size"),
    ({"default_num_inference_steps": 60}, "exceeds max_inference_steps"),
    ({"capture_batch_sizes": [16]}, "never replay"),
    ({"text_encoder_out_layers": []}, "text_encoder_out_layers"),
])
def test_bad_model_kwargs_are_refused_naming_the_key(kwargs, message):
    with pytest.raises(DeploymentError, match=message):
        with_kwargs(**kwargs)


def test_cuda_graphs_only_on_the_denoise_step_and_the_walk_on_the_cpu():
    raw = yaml.safe_load((CONFIGS / "flux2_klein_4b_gpu.yaml").read_text())
    raw["components"]["vae_decode"]["cuda_graphs"] = True
    with pytest.raises(DeploymentError, match="components.vae_decode.cuda_graphs"):
        deployment_from_dict(raw)
    raw = yaml.safe_load((CONFIGS / "flux2_klein_4b_gpu.yaml").read_text())
    raw["components"]["walk"]["placement"] = {"device": "gpu", "gpus": [0]}
    with pytest.raises(DeploymentError, match="components.walk.placement"):
        deployment_from_dict(raw)


@pytest.mark.parametrize("family_config", ["flux2_klein_4b_gpu.yaml", "z_image_turbo.yaml"])
@pytest.mark.parametrize("resources,key", [
    ({"kv_cache": {"num_pages": "auto", "gpu_memory_fraction": 0.3}}, "kv_cache"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"max_batch_tokens": 4096}, "max_batch_tokens"),
])
def test_an_image_deployment_refuses_resources_nothing_reads(family_config, resources, key):
    """ENGINE.md 16.3: settings nothing reads are refused. An image family has no KV pool or token budget, so a
    `resources` block (e.g. a GPU memory fraction meant to share the GPU) did nothing, silently."""
    raw = yaml.safe_load((CONFIGS / family_config).read_text())
    deployment_from_dict(copy.deepcopy(raw))
    raw["resources"] = resources
    with pytest.raises(DeploymentError, match=rf"resources.{key}: an image family has no KV pool"):
        deployment_from_dict(raw)


@pytest.mark.parametrize("config", ["flux2_klein.yaml", "flux2_klein_4b_gpu.yaml"])
def test_repository_has_the_walk_router_entry_and_four_decoupled_components(config):
    dep = load_deployment(CONFIGS / config)
    files = render_repository(dep, config)
    assert entry_model(dep) == "flux2_klein_walk"
    modules = {"walk": "walk_router", "text_encoder": "stateless_node", "vae_encode": "stateless_node",
               "denoise": "denoise_node", "vae_decode": "stateless_node"}
    for component, module in modules.items():
        assert f"from backends.{module} import TritonPythonModel" in files[f"flux2_klein_{component}/1/model.py"]
        assert "decoupled: true" in files[f"flux2_klein_{component}/config.pbtxt"]
    assert "KIND_CPU" in files["flux2_klein_walk/config.pbtxt"]


def test_activations_cross_hops_in_the_components_dtype():
    """Family.wire_dtype: one dtype for every component -> that dtype on the wire (bf16 halves the bytes of the
    text embeddings each request carries); components that compute in different dtypes -> FP32."""
    from mstar_common.families.flux2_klein.family import Flux2KleinFamily

    def embeds_type(dep) -> str:
        text = render_repository(dep, "t")["flux2_klein_text_encoder/config.pbtxt"]
        return text.split('name: "prompt_embeds" data_type: ')[1].split()[0]

    gpu = yaml.safe_load((CONFIGS / "flux2_klein_4b_gpu.yaml").read_text())
    assert Flux2KleinFamily().wire_dtype(deployment_from_dict(gpu)) == "BF16"
    assert embeds_type(deployment_from_dict(gpu)) == "TYPE_BF16"
    assert embeds_type(with_kwargs()) == "TYPE_FP32"  # the CPU config: float32
    assert embeds_type(with_kwargs(dtype="float16")) == "TYPE_FP16"
    gpu["components"]["text_encoder"]["placement"] = {"device": "cpu", "instances": 1}
    gpu["components"]["text_encoder"].pop("cuda_graphs")
    gpu["model_kwargs"].pop("dtype")  # the defaults: float32 on the cpu, bfloat16 on a gpu
    assert embeds_type(deployment_from_dict(gpu)) == "TYPE_FP32"


# the walk's refusals (no server needed)


@pytest.fixture(scope="module")
def walk():
    from ensembles.flux2_klein import Flux2KleinWalk
    from mstar_common.families.qwen3.tiny import build_tokenizer

    options = Flux2KleinOptions(default_size="64x64", max_image_area=65536, max_reference_area=128 * 128)
    return Flux2KleinWalk(build_tokenizer(), options, multiple=16)


def upload(width: int, height: int, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_prompt_is_padded_to_512_and_never_truncated(walk):
    ids, text_len = walk.tokenize("a cat")
    assert ids.shape == (512,) and 5 < text_len < 30 and ids[text_len:].tolist() == [ids[-1]] * (512 - text_len)
    with pytest.raises(ValueError, match="exceed the text encoder's 512-token input"):
        walk.tokenize("lorem ipsum " * 400)


@pytest.mark.parametrize("inputs,message", [
    ({}, "prompt: required"),
    ({"width": np.array([64], np.int32)}, "^height: give both width and height"),  # the walk's own input names
    ({"num_images": np.array([5], np.int32)}, "^num_images: must be in"),
    ({"seed": np.array([-1], np.int64)}, "seed: must be in"),
    ({"num_inference_steps": np.array([51], np.int32)}, "num_inference_steps"),
    ({"reference_images": np.array([b"x"] * 5, dtype=object)}, "^reference_images: at most 4 reference images"),
    ({"output_format": np.array([b"bmp"], dtype=object)}, "output_format"),
])
def test_walk_parse_refusals(walk, inputs, message):
    base = {"prompt": np.array([b"a cat"], dtype=object)} if "prompt" not in message else {}
    with pytest.raises(ValueError, match=message):
        walk.parse({**base, **inputs})


def test_reference_images_follow_the_reference_pipelines_rules(walk):
    assert walk.prepare_reference(upload(100, 80, "RGBA"), "image[0]").shape == (80, 96, 3)  # cropped to the grid
    resized = walk.prepare_reference(upload(400, 200), "image[0]")  # over 128x128 of area: Lanczos to that area
    assert resized.shape == (80, 176, 3)
    with pytest.raises(ValueError, match=r"image\[1\]: 50x80 is too small"):
        walk.prepare_reference(upload(50, 80), "image[1]")
    with pytest.raises(ValueError, match="aspect ratio over 8:1"):
        walk.prepare_reference(upload(640, 64), "image[0]")


def test_a_palette_reference_is_resized_as_its_rgb_is_as_diffusers_load_image_gives_it(walk):
    """Pillow resizes a palette ("P") or 1-bit image nearest-neighbour whatever filter is asked: a PNG-8 or GIF
    reference over max_reference_area was shrunk that way (6.7 dB from the same picture saved as RGB), where
    diffusers' load_image converts to RGB first and the pipeline resizes it with Lanczos."""
    import numpy as np

    lines = np.zeros((300, 400, 3), np.uint8)
    lines[::3] = 255  # fine detail that nearest-neighbour and Lanczos shrink differently
    lines[:, ::7, 1] = 200
    palette = Image.fromarray(lines).quantize(16)
    as_rgb = palette.convert("RGB")

    def png(image):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    ours = walk.prepare_reference(png(palette), "image[0]")
    assert ours.shape == walk.prepare_reference(png(as_rgb), "image[0]").shape == (96, 144, 3)
    assert np.array_equal(ours, walk.prepare_reference(png(as_rgb), "image[0]"))


def test_kernel_switches_name_the_variable_and_the_rule(monkeypatch):
    """The diffusion kernels run on CUDA only, `MSTAR_DIFFUSION_KERNELS=0` turns them off, and a bad value of either
    switch names the variable and what it accepts (the CPU path never reads the attention switch)."""
    from mstar_common.diffusion import attention
    from mstar_common.diffusion.diffusers_checkpoint import kernels_enabled

    assert not kernels_enabled("cpu")
    monkeypatch.setenv("MSTAR_DIFFUSION_KERNELS", "0")
    assert not kernels_enabled("cuda:0")
    monkeypatch.setenv("MSTAR_DIFFUSION_KERNELS", "1")
    assert kernels_enabled("cuda:0")
    monkeypatch.setenv("MSTAR_DIFFUSION_KERNELS", "yes")
    with pytest.raises(ValueError, match="MSTAR_DIFFUSION_KERNELS='yes': expected 0 or 1"):
        kernels_enabled("cuda:0")
    monkeypatch.delenv("MSTAR_DIT_ATTENTION", raising=False)
    from torch.nn.attention import SDPBackend

    assert attention.sdpa_backends()[0] == SDPBackend.CUDNN_ATTENTION
    monkeypatch.setenv("MSTAR_DIT_ATTENTION", "flash")
    assert attention.sdpa_backends() == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    monkeypatch.setenv("MSTAR_DIT_ATTENTION", "auto")
    assert attention.sdpa_backends() is None
    monkeypatch.setenv("MSTAR_DIT_ATTENTION", "fa3")
    with pytest.raises(ValueError, match="MSTAR_DIT_ATTENTION='fa3': expected one of auto, cudnn, flash, efficient"):
        attention.sdpa_backends()


def test_taps_the_checkpoints_text_encoder_lacks_are_refused_before_serving(tmp_path):
    """Accepted by `mstar check`, then the text encoder failed to load inside tritonserver."""
    from mstar_common.cli import check_against_checkpoint
    from mstar_common.config import DeploymentError
    from mstar_common.families.flux2_klein.tiny import build_tiny_checkpoint
    from mstar_common.families.registry import get_family

    checkpoint = build_tiny_checkpoint(tmp_path / "flux2-klein-tiny")
    raw = copy.deepcopy(BASE)
    raw["model_kwargs"]["text_encoder_out_layers"] = [100, 200, 300]
    with pytest.raises(DeploymentError, match=r"^t.yaml: model_kwargs.text_encoder_out_layers: taps must be distinct "
                                              r"layer numbers in \[1, "):
        check_against_checkpoint(get_family("flux2_klein"), deployment_from_dict(raw), checkpoint, "t.yaml")
    check_against_checkpoint(get_family("flux2_klein"), deployment_from_dict(copy.deepcopy(BASE)), checkpoint, "t.yaml")


def test_a_prompt_too_long_for_the_text_encoder_is_refused_before_tokenizing(walk):
    # it was tokenized first, on the walk's event loop: ~20 s for 16 MB, every request of the walk waiting
    with pytest.raises(ValueError, match=r"^prompt: 4000000 bytes cannot fit 512 tokens \(at most \d+ bytes\)"):
        walk.parse({"prompt": np.array([b"a" * 4_000_000], dtype=object)})
    assert walk.parse({"prompt": np.array([b"a cat " * 50], dtype=object)}).prompt.startswith("a cat")


@pytest.mark.parametrize("config, kwargs, key", [
    ("z_image_turbo_gpu.yaml", {"capture_sizes": []}, "capture_sizes"),
    ("z_image_turbo_gpu.yaml", {"capture_batch_sizes": []}, "capture_batch_sizes"),
    ("z_image_turbo_gpu.yaml", {"capture_caption_tokens": []}, "capture_caption_tokens"),
    ("flux2_klein_4b_gpu.yaml", {"capture_sizes": [], "capture_edit_sizes": []}, "capture_sizes"),
    ("flux2_klein_4b_gpu.yaml", {"capture_batch_sizes": []}, "capture_batch_sizes"),
])
def test_a_captured_denoise_step_with_nothing_to_capture_is_refused(config, kwargs, key):
    """An empty list under `cuda_graphs: true` captured no graph and said nothing (each step ran eager), as the
    engine's empty bucket lists are refused."""
    raw = yaml.safe_load((CONFIGS / config).read_text())
    raw["model_kwargs"].update(kwargs)
    with pytest.raises(DeploymentError, match=rf"model_kwargs.{key}: empty while components.denoise.cuda_graphs "
                                              rf"is true"):
        deployment_from_dict(copy.deepcopy(raw), config)
    raw["components"]["denoise"]["cuda_graphs"] = False  # the CPU demos' way: nothing captured, on purpose
    deployment_from_dict(raw, config)


def test_a_captured_denoise_step_may_capture_edits_alone():
    raw = yaml.safe_load((CONFIGS / "flux2_klein_4b_gpu.yaml").read_text())
    raw["model_kwargs"].update(capture_sizes=[], capture_edit_sizes=["1024x1024"])
    deployment_from_dict(raw, "flux2_klein_4b_gpu.yaml")


def test_a_reference_area_over_the_image_area_is_refused_at_startup():
    """An edit without a size takes its first reference's (up to max_reference_area): with the reference area over
    max_image_area every such edit of a large reference was refused, naming a `size` the client never sent."""
    from mstar_common.config import DeploymentError
    from mstar_common.families.flux2_klein.options import options_from_kwargs

    with pytest.raises(DeploymentError, match=r"max_reference_area: 1048576 exceeds max_image_area=262144"):
        options_from_kwargs({"max_image_area": 512 * 512, "default_size": "512x512", "capture_sizes": ["512x512"]},
                            "t.yaml")
    options_from_kwargs({"max_image_area": 512 * 512, "max_reference_area": 512 * 512, "default_size": "512x512",
                         "capture_sizes": ["512x512"]}, "t.yaml")


def test_edit_buckets_larger_than_a_reference_can_be_are_never_captured():
    """References are resized to max_reference_area before they are encoded, so an edit bucket of one reference of
    a larger output size never replays: `capture_sizes: [1024x1024, 1536x1024]` captured 1536x1024 edit graphs
    (minutes of start-up and ~1 GiB each) for nothing, and an explicit one passed every check."""
    from mstar_common.families.flux2_klein.options import options_from_kwargs

    options = options_from_kwargs({"capture_sizes": ["1024x1024", "1536x1024"]}, "test.yaml")
    assert options.edit_sizes == ["1024x1024"]
    smaller = options_from_kwargs({"capture_sizes": ["512x512"], "max_reference_area": 512 * 512}, "test.yaml")
    assert smaller.edit_sizes == ["512x512"]
    with pytest.raises(DeploymentError, match=r"^test.yaml: model_kwargs.capture_edit_sizes: \['1536x1024'\] exceed "
                                              r"max_reference_area=1048576; .* would never replay"):
        options_from_kwargs({"capture_edit_sizes": ["1024x1024", "1536x1024"]}, "test.yaml")


def test_the_dit_attention_order_is_set_once_for_the_process_not_around_each_call():
    """`sdpa_kernel` around every call set and restored torch's process-wide SDPA priority: with Z-Image's caption
    refiner and the eager denoise steps on two threads, one thread's exit put the default order back under the
    other's call (flash first, not cuDNN), and the last exit left its saved order set for good. Run in a child
    process: the order is the process's."""
    import subprocess
    import sys

    code = """
import threading, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.attention as nn_attention
from mstar_common.diffusion import attention

default = torch._C._get_sdp_priority_order()
def no_context(*args, **kwargs):
    raise AssertionError("no per-call sdpa_kernel context")
nn_attention.sdpa_kernel = no_context
threads = [threading.Thread(target=attention.use_backend_order) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
order = torch._C._get_sdp_priority_order()
assert order[0] == int(SDPBackend.CUDNN_ATTENTION) and order != default, (order, default)
attention.use_backend_order()
assert torch._C._get_sdp_priority_order() == order
assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MSTAR_DIT_ATTENTION"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
