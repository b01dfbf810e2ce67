"""Z-Image-Turbo: every component bit for bit against diffusers 0.42.1 / transformers (fp32, CPU, the tiny random
checkpoint), and the whole walk against `ZImagePipeline` (fixed seed, guidance 0): PSNR = inf, i.e. identical
uint8 images. A request batched with others stays within 60 dB PSNR of its solo image (measured on the 2-core
CPU: 86-89 dB or identical; CPU GEMMs round differently at other batch sizes)."""

from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import ZImagePipeline  # noqa: E402

from mstar_common.config import deployment_from_dict  # noqa: E402
from mstar_common.families.z_image_turbo import loader  # noqa: E402
from mstar_common.families.z_image_turbo.family import ZImageTurboFamily, capture_denoise_graphs  # noqa: E402
from mstar_common.families.z_image_turbo.scheduler import z_image_schedule  # noqa: E402
from mstar_common.families.z_image_turbo.tiny import build_tiny_checkpoint  # noqa: E402
from mstar_common.families.z_image_turbo.transformer import padded_length, patchify, unpatchify  # noqa: E402
from mstar_common.local_walk import LocalWalk  # noqa: E402
from tests.unit import image_helpers  # noqa: E402
from tests.unit.image_helpers import decode, psnr, request  # noqa: E402

COMPONENTS = ("walk", "text_encoder", "denoise", "vae_decode")
MIN_BATCHED_PSNR = 60.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("zimage") / "z-image-turbo-tiny")


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return ZImagePipeline.from_pretrained(checkpoint)


def tiny_deployment(checkpoint, **model_kwargs):
    return deployment_from_dict({
        "name": "zimage-test", "family": "z_image_turbo", "checkpoint": str(checkpoint),
        "components": {name: {} for name in COMPONENTS},
        "model_kwargs": {"default_size": "64x64", "capture_sizes": [], **model_kwargs},
    })


# components


def test_the_checkpoints_norm_weights_vary(pipe):
    """(So the bit-exact checks see them: diffusers initialises every RMSNorm weight to 1, and the caption
    embedder's, `cap_embedder.0`, stayed 1: a transformer that ignored it passed bit for bit.)"""
    norms = [m for m in pipe.transformer.modules() if type(m).__name__.endswith("RMSNorm") and m.weight is not None]
    assert len(norms) > 10 and pipe.transformer.cap_embedder[0] in norms
    assert all(not torch.all(m.weight == 1) for m in norms)


@torch.no_grad()
@pytest.mark.parametrize("height,width,caption_len,batch", [(4, 6, 20, 1), (3, 5, 32, 1), (4, 6, 45, 2), (8, 8, 7, 3)],
                         ids=["pad-both", "image-pad-only", "batch2", "batch3-unpadded-image"])
def test_transformer_is_bit_exact(checkpoint, pipe, height, width, caption_len, batch):
    ours = loader.load_transformer(checkpoint, "float32", "cpu")
    torch.manual_seed(height * width + caption_len)
    latents = torch.randn(batch, 16, 2 * height, 2 * width)
    feats = torch.randn(caption_len, 24)
    t = torch.rand(batch)  # every row at its own timestep
    want = pipe.transformer([x[:, None] for x in latents], t, [feats] * batch, return_dict=False)[0]
    caption = ours.encode_caption(feats)
    assert caption.shape == (padded_length(caption_len), 32)
    got = ours(patchify(latents, 2), caption.expand(batch, -1, -1), t, ours.rope(height, width, caption.shape[0]))
    assert torch.equal(unpatchify(got, height, width, 2), torch.stack(want)[:, :, 0])


def test_patchify_round_trips_and_matches_the_reference_token_order(pipe):
    latents = torch.randn(2, 16, 6, 10)
    tokens = patchify(latents, 2)
    want, _, _ = pipe.transformer._patchify_image(latents[1][:, None], 2, 1)
    assert torch.equal(tokens[1], want) and torch.equal(unpatchify(tokens, 3, 5, 2), latents)


@torch.no_grad()
def test_text_encoder_is_bit_exact_and_skips_the_last_layer(checkpoint, pipe):
    ours = loader.load_text_encoder(checkpoint, "float32", "cpu")
    assert len(ours.model.layers) == 2 and ours.model.norm is None  # 3 layers; the caption is hidden_states[-2]
    prompts = ["a cat in a hat", "the quick brown fox jumps over the lazy dog, twice", "GPU"]
    want = pipe._encode_prompt(list(prompts), device=torch.device("cpu"))
    ids, lens = image_helpers.prompt_ids(pipe, prompts, enable_thinking=True)
    got = ours(ids, lens)
    for row, length, reference in zip(got, lens, want, strict=True):
        assert torch.equal(row[:length], reference)


def test_text_encoder_loads_a_causal_lm_layout_too(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    weights = copy / "text_encoder" / "model.safetensors"
    tensors = load_file(weights)
    renamed = {f"model.{name}": t for name, t in tensors.items()}
    save_file({**renamed, "lm_head.weight": tensors["embed_tokens.weight"].clone()}, weights)
    ids = torch.randint(0, 300, (1, 512))
    lens = torch.tensor([9])
    a = loader.load_text_encoder(checkpoint, "float32", "cpu")(ids, lens)
    assert torch.equal(loader.load_text_encoder(copy, "float32", "cpu")(ids, lens), a)


@torch.no_grad()
def test_vae_decode_is_bit_exact(checkpoint, pipe):
    ours = loader.load_vae_decoder(checkpoint, "float32", "cpu")
    torch.manual_seed(1)
    latents = torch.randn(2, 16, 8, 12)
    scaled = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    images = pipe.vae.decode(scaled, return_dict=False)[0]
    want = (pipe.image_processor.postprocess(images, output_type="np") * 255).round().astype(np.uint8)
    assert np.array_equal(ours(latents).numpy(), want)


@pytest.mark.parametrize("steps,tokens,dynamic", [(8, 16, False), (1, 4096, False), (4, 64, True), (9, 5000, True)])
def test_schedule_equals_the_reference_scheduler(checkpoint, steps, tokens, dynamic):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

    from mstar_common.families.z_image_turbo.scheduler import ZImageSchedulerConfig

    raw = {**json.loads((checkpoint / "scheduler" / "scheduler_config.json").read_text()),
           "use_dynamic_shifting": dynamic}
    reference = FlowMatchEulerDiscreteScheduler.from_config(raw)
    reference.set_timesteps(steps, sigmas=get_default_z_image_sigmas(steps), mu=calculate_shift(tokens))
    timesteps, sigmas = z_image_schedule(ZImageSchedulerConfig.from_diffusers(raw), steps, tokens)
    assert torch.equal(timesteps, reference.timesteps) and torch.equal(sigmas, reference.sigmas)


def test_loader_checks_coverage_and_refuses_other_pipelines(checkpoint, tmp_path):
    broken = image_helpers.assert_transformer_coverage_checked(loader, checkpoint, tmp_path, "x_pad_token")
    index = json.loads((broken / "model_index.json").read_text())
    (broken / "model_index.json").write_text(json.dumps({**index, "_class_name": "ZImageOmniPipeline"}))
    with pytest.raises(ValueError, match="z_image_turbo serves"):
        loader.check_pipeline(broken)


# the whole walk


def _reference(pipe, **kwargs) -> list[np.ndarray]:
    images = pipe(num_inference_steps=kwargs.pop("num_inference_steps", 8), guidance_scale=0.0, output_type="np",
                  **kwargs).images
    return list((images * 255).round().astype(np.uint8))


def test_whole_pipeline_equals_diffusers(checkpoint, pipe):
    async def run():
        async with LocalWalk(ZImageTurboFamily(), tiny_deployment(checkpoint), checkpoint) as walk:
            return (await walk.run(request("a red fox in the snow", 96, 64, seed=7, num_images=2)),
                    await walk.run(request("a lighthouse", seed=3, num_inference_steps=3)))

    t2i, small = asyncio.run(run())
    want = _reference(pipe, prompt="a red fox in the snow", height=64, width=96, num_images_per_prompt=2,
                      generator=torch.Generator().manual_seed(7))
    got = [decode(b) for b in t2i["images"]]
    assert got[0].shape == (64, 96, 3)
    assert [psnr(a, b) for a, b in zip(got, want, strict=True)] == [float("inf")] * 2
    want = _reference(pipe, prompt="a lighthouse", height=64, width=64, num_inference_steps=3,
                      generator=torch.Generator().manual_seed(3))
    assert psnr(decode(small["images"][0]), want[0]) == float("inf")
    assert psnr(got[0], got[1]) < 40  # the two images of a request differ (their own noise)


def test_batched_requests_match_their_solo_images(checkpoint):
    requests = [request("a cat", 64, 64, 1), request("a dog on a hill", 96, 64, 2),
                request("a city at night", 64, 64, 3, num_inference_steps=6),
                request("a boat", 64, 64, 4, num_images=2),
                request("a sunset", 64, 64, 5, num_inference_steps=2)]

    dep = tiny_deployment(checkpoint)
    solo, together, (steps, rows) = image_helpers.run_solo_and_batched(ZImageTurboFamily(), dep, checkpoint, requests)
    assert rows == 8 + 8 + 6 + 2 * 8 + 2 and steps < 32  # solo, the same rows take 32 forwards
    image_helpers.assert_batched_images_match(solo, together, MIN_BATCHED_PSNR)


def test_vae_in_denoise_gives_the_hop_paths_images_without_calling_vae_decode(checkpoint):
    requests = [request("a cat", 64, 64, 1), request("a boat", 96, 64, 4, num_images=2)]
    image_helpers.assert_vae_in_denoise_matches_the_hop(ZImageTurboFamily(), tiny_deployment, checkpoint, requests)


@torch.no_grad()
def test_bucketed_step_equals_the_eager_step(checkpoint):
    dep = tiny_deployment(checkpoint, capture_sizes=["64x64"], capture_caption_tokens=[32], capture_batch_sizes=[2])
    family = ZImageTurboFamily()
    runtime = family.build_component("denoise", dep, checkpoint, "cpu")
    prompt = torch.randn(11, 24)
    inputs = {"prompt_embeds": prompt, "width": torch.tensor([64]), "height": torch.tensor([64]),
              "seed": torch.tensor([5])}
    job = runtime.parse(inputs)
    timesteps, dts = torch.tensor(job.timesteps[:1]), torch.tensor([job.sigmas[1] - job.sigmas[0]])
    eager = runtime.stepper(job.layout, job.latents, job.prompt_embeds, None, timesteps, dts)
    capture_denoise_graphs(runtime, family_options(dep), capture=False)
    bucketed = runtime.stepper(job.layout, job.latents, job.prompt_embeds, None, timesteps, dts)
    # The bucket runs 2 rows (one stale): CPU GEMMs may round a 2-row batch differently from a 1-row one.
    assert runtime.stepper.graphs.num_replays == 1 and torch.allclose(bucketed, eager, rtol=0, atol=1e-5)


def family_options(dep):
    from mstar_common.families.z_image_turbo.options import options_from_kwargs

    return options_from_kwargs(dep.model_kwargs, dep.name)


@pytest.mark.parametrize("inputs,rule", [
    ({"reference_images": np.array([b"png"], dtype=object)}, "text-to-image only"),
    ({"width": np.array([100], np.int32), "height": np.array([64], np.int32)}, "multiples of 16"),
    ({"num_inference_steps": np.array([0], np.int32)}, "num_inference_steps: must be in [1, 50]"),
    ({"num_images": np.array([5], np.int32)}, "num_images: must be in [1, 4]"),  # the walk's own input names
])
def test_walk_refusals_name_the_rule(checkpoint, inputs, rule):
    walk = ZImageTurboFamily().build_component("walk", tiny_deployment(checkpoint), checkpoint, "cpu")
    with pytest.raises(ValueError) as error:
        walk.parse({**request("a cat"), **inputs})
    assert rule in str(error.value)


def test_the_walk_refuses_sizes_past_the_rope_range_and_the_formats_sides(checkpoint):
    """Before the text encoder runs: a size past the DiT's RoPE tables (the tiny checkpoint's 512 px a side, 32
    rows of 16 px; 8,192 for the real model, passed under the default area by 8208x496), and a side the output
    format cannot hold. The last row of the tables was refused (496 px), which diffusers renders."""
    walk = ZImageTurboFamily().build_component("walk", tiny_deployment(checkpoint, max_image_area=2**22),
                                               checkpoint, "cpu")
    size = lambda w, h: {"width": np.array([w], np.int32), "height": np.array([h], np.int32)}  # noqa: E731
    assert walk.parse({**request("a cat"), **size(512, 64)}).width == 512
    with pytest.raises(ValueError, match=r"^width: 528x64 exceeds this checkpoint's RoPE range of 512x512"):
        walk.parse({**request("a cat"), **size(528, 64)})
    walk.max_sides = None  # the format's own limit, past any RoPE range
    with pytest.raises(ValueError, match=r"^width: 16384x16 is too large for output_format 'webp': webp images are "
                                         r"at most 16383 px a side"):
        walk.parse({**request("a cat"), **size(16384, 16), "output_format": np.array([b"webp"], dtype=object)})
    assert walk.parse({**request("a cat"), **size(16384, 16)}).width == 16384  # png has no such limit


def test_denoise_refuses_sizes_past_the_rope_range(checkpoint):
    runtime = ZImageTurboFamily().build_component("denoise", tiny_deployment(checkpoint, max_image_area=2**20),
                                                  checkpoint, "cpu")
    inputs = {"prompt_embeds": torch.randn(5, 24), "width": torch.tensor([528]), "height": torch.tensor([64]),
              "seed": torch.tensor([0])}
    with pytest.raises(ValueError, match="RoPE range of 512x512"):
        runtime.parse(inputs)
    runtime.parse({**inputs, "width": torch.tensor([512])})  # the tables' last column: rendered, as by diffusers
    with pytest.raises(ValueError, match="prompt_embeds: expected shape"):
        runtime.parse({**inputs, "width": torch.tensor([64]), "prompt_embeds": torch.randn(5, 23)})


def test_dit_fp8_runs_the_attention_and_mlp_linears_in_e4m3_and_stays_close(checkpoint):
    """model_kwargs.dit_fp8 on Z-Image: each block's attention and MLP linears become Fp8Linear where fp8 GEMMs
    take their shape (features multiples of 16: all of them at the 6B shapes; the tiny MLP's 85-wide hidden
    layer is not), the adaLN modulations stay, and the image stays close to the full-precision one: 52.3 dB
    measured (tiny random weights, fp32 on the CPU); a broken fp8 GEMM gives noise, far below the bound."""
    from mstar_common.layers.fp8_linear import Fp8Linear, is_eligible

    value, model = image_helpers.fp8_against_full_precision(ZImageTurboFamily(), tiny_deployment, checkpoint,
                                                            request("a lighthouse at dusk", 64, 64, 5))
    blocks = [*model.noise_refiner, *model.context_refiner, *model.layers]
    parts = [m for b in blocks for part in (b.attention, b.feed_forward) for m in part.modules()]
    assert not any(is_eligible(m) for m in parts)  # every linear fp8 can take was swapped
    assert sum(isinstance(m, Fp8Linear) for m in parts) == 4 * len(blocks)  # q, k, v, out (the tiny MLP: 85 wide)
    adaln = [b.adaLN_modulation[0] for b in blocks if b.adaLN_modulation is not None]
    assert adaln and all(type(m) is torch.nn.Linear for m in adaln)
    assert 40.0 < value < float("inf"), value
