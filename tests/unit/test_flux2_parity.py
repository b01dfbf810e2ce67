"""FLUX.2 [klein]: every component bit for bit against diffusers 0.42.1 (fp32, CPU, the tiny random checkpoint),
and the whole walk against `Flux2KleinPipeline` (fixed seed): PSNR = inf, i.e. identical uint8 images, for
text-to-image and for editing with two references. A request batched with others stays within 60 dB PSNR
of its solo image (measured: 86-91 dB; CPU GEMMs round differently at other batch sizes)."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from diffusers import Flux2KleinPipeline  # noqa: E402
from PIL import Image  # noqa: E402

from mstar_common.config import deployment_from_dict  # noqa: E402
from mstar_common.families.flux2_klein import loader  # noqa: E402
from mstar_common.families.flux2_klein.family import Flux2KleinFamily  # noqa: E402
from mstar_common.families.flux2_klein.scheduler import flow_schedule  # noqa: E402
from mstar_common.families.flux2_klein.tiny import TINY_TAPS, build_tiny_checkpoint  # noqa: E402
from mstar_common.local_walk import LocalWalk  # noqa: E402
from tests.unit import image_helpers  # noqa: E402
from tests.unit.image_helpers import decode, psnr, request  # noqa: E402

COMPONENTS = ("walk", "text_encoder", "vae_encode", "denoise", "vae_decode")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("flux2") / "flux2-klein-tiny")


@pytest.fixture(scope="module")
def pipe(checkpoint):
    return Flux2KleinPipeline.from_pretrained(checkpoint)


def tiny_deployment(checkpoint, **model_kwargs):
    return deployment_from_dict({
        "name": "flux2-test", "family": "flux2_klein", "checkpoint": str(checkpoint),
        "components": {name: {} for name in COMPONENTS},
        "model_kwargs": {"text_encoder_out_layers": list(TINY_TAPS), "default_size": "64x64", **model_kwargs},
    })


# components


@torch.no_grad()
def test_transformer_is_bit_exact_with_per_row_timesteps_and_references(checkpoint, pipe):
    ours = loader.load_transformer(checkpoint, "float32", "cpu")
    torch.manual_seed(0)
    batch, h, w = 3, 4, 6
    latents = torch.randn(batch, h * w, 16)
    refs = torch.randn(batch, 2 * 2 + 3 * 2, 16)
    prompt = torch.randn(batch, 512, 48)
    timestep = torch.tensor([0.9, 0.5, 0.1])
    txt_ids = pipe._prepare_text_ids(prompt)
    img_ids = pipe._prepare_latent_ids(torch.zeros(batch, 16, h, w))
    ref_ids = pipe._prepare_image_ids([torch.zeros(1, 16, 2, 2), torch.zeros(1, 16, 3, 2)]).expand(batch, -1, -1)
    for hidden, ids in ((latents, img_ids), (torch.cat([latents, refs], 1), torch.cat([img_ids, ref_ids], 1))):
        want = pipe.transformer(hidden_states=hidden, encoder_hidden_states=prompt, timestep=timestep, img_ids=ids,
                                txt_ids=txt_ids, guidance=None, return_dict=False)[0]
        got = ours(hidden, prompt, timestep, ours.rope(txt_ids[0], ids[0]))
        assert torch.equal(got, want)


@torch.no_grad()
@pytest.mark.parametrize("taps", [TINY_TAPS, (2, 4)], ids=["taps-1-2-3", "taps-2-4-last-layer-normed"])
def test_text_encoder_is_bit_exact_and_runs_only_to_the_deepest_tap(checkpoint, pipe, taps):
    ours = loader.load_text_encoder(checkpoint, taps, "float32", "cpu")
    assert len(ours.model.layers) == max(taps)
    prompts = ["a cat in a hat", "the quick brown fox jumps over the lazy dog, twice", "GPU"]
    want = pipe._get_qwen3_prompt_embeds(pipe.text_encoder, pipe.tokenizer, prompts, hidden_states_layers=taps)
    assert torch.equal(ours(*image_helpers.prompt_ids(pipe, prompts, enable_thinking=False)), want)


@pytest.mark.parametrize("rows", [1, 3])
def test_text_encoder_buckets_pad_and_drop_spare_rows(checkpoint, pipe, rows):
    """The captured text encoder's buckets (run eager here, `capture=False`): a batch of 1 or 3 prompts in the
    1- and 4-row buckets, the spare rows padding, gives each prompt's own rows (the mask is always built there:
    the same values as the eager `is_causal` path within fp32 rounding)."""
    from mstar_common.families.flux2_klein.components import TextEncoderComponent

    runtime = TextEncoderComponent(loader.load_text_encoder(checkpoint, TINY_TAPS, "float32", "cpu"), "cpu", 4)
    runtime.capture_graphs(capture=False)
    assert [bucket[0] for bucket in runtime.graphs.buckets] == [1, 2, 4]
    prompts = ["a cat in a hat", "the quick brown fox jumps over the lazy dog, twice", "GPU"][:rows]
    ids, lens = image_helpers.prompt_ids(pipe, prompts, enable_thinking=False)
    with torch.inference_mode():
        got = runtime.graphs.run(ids, lens)
        want = runtime.model(ids, lens)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        outputs = runtime.run_batch([(row, int(length)) for row, length in zip(ids, lens, strict=True)])
    assert torch.equal(torch.stack([o["prompt_embeds"] for o in outputs]), got)


@pytest.mark.gpu
def test_text_encoder_graph_replay_equals_the_eager_static_pass(checkpoint, pipe):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.families.flux2_klein.components import TextEncoderComponent

    model = loader.load_text_encoder(checkpoint, TINY_TAPS, "bfloat16", "cuda")
    runtime = TextEncoderComponent(model, "cuda", 4)
    runtime.capture_graphs()
    ids, lens = image_helpers.prompt_ids(pipe, ["a cat in a hat", "GPU", "a much longer prompt than the others"],
                                         enable_thinking=False)
    ids, lens = ids.cuda(), lens.cuda()
    with torch.inference_mode():
        got = runtime.graphs.run(ids, lens)
        padded_ids = torch.cat([ids, torch.zeros_like(ids[:1])])
        padded_lens = torch.cat([lens, torch.ones_like(lens[:1])])
        want = model(padded_ids, padded_lens, static=True)[:3]
    assert runtime.graphs.num_replays == 1
    assert torch.equal(got, want)


@torch.no_grad()
def test_vae_encode_and_decode_are_bit_exact(checkpoint, pipe):
    encoder = loader.load_vae_encoder(checkpoint, "float32", "cpu")
    decoder = loader.load_vae_decoder(checkpoint, "float32", "cpu")
    torch.manual_seed(1)
    pixels = torch.rand(2, 3, 64, 96) * 2 - 1
    assert torch.equal(encoder(pixels), pipe._pack_latents(pipe._encode_vae_image(pixels, None)))
    tokens = torch.randn(2, 4 * 6, 16)
    latents = pipe._unpack_latents_with_ids(tokens, pipe._prepare_latent_ids(torch.zeros(2, 16, 4, 6)), 4, 6)
    bn = pipe.vae.bn
    latents = latents * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps) \
        + bn.running_mean.view(1, -1, 1, 1)
    images = pipe.vae.decode(pipe._unpatchify_latents(latents), return_dict=False)[0]
    want = (pipe.image_processor.postprocess(images, output_type="np") * 255).round().astype(np.uint8)
    assert np.array_equal(decoder(tokens, 64, 96).numpy(), want)


@pytest.mark.parametrize("steps,tokens", [(4, 16), (4, 4096), (8, 5000), (1, 64)])
def test_schedule_equals_the_reference_scheduler(checkpoint, pipe, steps, tokens):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    sigmas = np.linspace(1.0, 1 / steps, steps)
    pipe.scheduler.set_timesteps(steps, sigmas=sigmas, mu=compute_empirical_mu(tokens, steps))
    timesteps, ours = flow_schedule(loader.scheduler_config(checkpoint), steps, tokens)
    assert torch.equal(timesteps, pipe.scheduler.timesteps) and torch.equal(ours, pipe.scheduler.sigmas)


def test_loader_checks_coverage_both_ways(checkpoint, tmp_path):
    broken = image_helpers.assert_transformer_coverage_checked(loader, checkpoint, tmp_path, "proj_out.weight")
    index = json.loads((broken / "model_index.json").read_text())
    (broken / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}))
    with pytest.raises(ValueError, match="is_distilled=false"):
        loader.check_pipeline(broken)


# the whole walk


def _reference(pipe, **kwargs) -> list[np.ndarray]:
    images = pipe(num_inference_steps=kwargs.pop("num_inference_steps", 4), text_encoder_out_layers=TINY_TAPS,
                  output_type="np", **kwargs).images
    return list((images * 255).round().astype(np.uint8))


def test_whole_pipeline_equals_diffusers_text_to_image_and_edit(checkpoint, pipe):
    reference_image = Image.fromarray((np.random.RandomState(0).rand(80, 100, 3) * 255).astype(np.uint8))
    buffer = io.BytesIO()
    reference_image.save(buffer, format="PNG")

    async def run():
        async with LocalWalk(Flux2KleinFamily(), tiny_deployment(checkpoint), checkpoint) as walk:
            t2i = await walk.run(request("a red fox in the snow", 96, 64, seed=7, num_images=2))
            edit = await walk.run({**request("make it blue", seed=3),
                                   "reference_images": np.array([buffer.getvalue()] * 2, dtype=object)})
            return t2i, edit

    t2i, edit = asyncio.run(run())
    want = _reference(pipe, prompt="a red fox in the snow", height=64, width=96, num_images_per_prompt=2,
                      generator=torch.Generator().manual_seed(7))
    got = [decode(b) for b in t2i["images"]]
    assert [psnr(a, b) for a, b in zip(got, want, strict=True)] == [float("inf")] * 2
    want = _reference(pipe, image=[reference_image] * 2, prompt="make it blue",
                      generator=torch.Generator().manual_seed(3))
    got = decode(edit["images"][0])
    assert got.shape == (80, 96, 3)  # the first reference's size, cropped to the 16-px grid
    # equal but for float rounding at a uint8 boundary (since the tiny VAE's GroupNorm weights vary, 2026-12-07:
    # one value of 23,040 one level apart); a wrong reference encode differs everywhere
    diff = np.abs(got.astype(np.int16) - want[0].astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())


def test_batched_requests_match_their_solo_images(checkpoint):
    requests = [request("a cat", 64, 64, 1), request("a dog on a hill", 96, 64, 2),
                request("a city at night", 64, 64, 3, num_inference_steps=6),
                request("a boat", 96, 64, 4, num_images=2),
                request("a sunset", 64, 64, 5, num_inference_steps=2)]

    dep = tiny_deployment(checkpoint)
    solo, together, (steps, rows) = image_helpers.run_solo_and_batched(Flux2KleinFamily(), dep, checkpoint, requests)
    assert rows == 4 + 4 + 6 + 2 * 4 + 2 and steps < 20  # solo, the same rows take 20 forwards
    image_helpers.assert_batched_images_match(solo, together, 60.0)


def test_vae_in_denoise_gives_the_hop_paths_images_without_calling_vae_decode(checkpoint):
    requests = [request("a cat", 64, 64, 1), request("a dog on a hill", 96, 64, 2, num_images=2),
                request("a boat", 64, 64, 3, num_inference_steps=2)]
    image_helpers.assert_vae_in_denoise_matches_the_hop(Flux2KleinFamily(), tiny_deployment, checkpoint, requests)


def test_vae_in_denoise_must_be_a_boolean(checkpoint):
    from mstar_common.config import DeploymentError

    with pytest.raises(DeploymentError, match=r"model_kwargs.vae_in_denoise: must be true or false, got 1"):
        Flux2KleinFamily().build_component("denoise", tiny_deployment(checkpoint, vae_in_denoise=1), checkpoint, "cpu")


def test_dit_fp8_runs_the_blocks_linears_in_e4m3_and_stays_close(checkpoint):
    """model_kwargs.dit_fp8: every double and single block linear becomes an Fp8Linear (the embedders, the
    modulations and the output projection do not), and a request's image stays close to the full-precision
    one: tiny random weights, fp32 on the CPU, 4 steps, 62.8 dB measured (not bit-exact: the bound's upper end
    fails if the swap did nothing; a GEMM missing a scale or a transposed weight gives noise, far below 40 dB).
    At klein-4B's shapes on the H200: docs/benchmarks.md."""
    from mstar_common.layers.fp8_linear import Fp8Linear

    value, model = image_helpers.fp8_against_full_precision(Flux2KleinFamily(), tiny_deployment, checkpoint,
                                                            request("a red cube on a table", 64, 64, 7))
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    in_blocks = [m for b in blocks for m in b.modules() if isinstance(m, (Fp8Linear, torch.nn.Linear))]
    assert in_blocks and all(isinstance(m, Fp8Linear) for m in in_blocks)
    assert not any(isinstance(m, Fp8Linear) for m in (model.x_embedder, model.proj_out, model.context_embedder))
    assert 40.0 < value < float("inf"), value


def test_dit_fp8_must_be_a_boolean(checkpoint):
    from mstar_common.config import DeploymentError

    with pytest.raises(DeploymentError, match=r"model_kwargs.dit_fp8: must be true or false, got 'yes'"):
        Flux2KleinFamily().build_component("denoise", tiny_deployment(checkpoint, dit_fp8="yes"), checkpoint, "cpu")


def test_a_drawn_seed_survives_a_json_reader_that_reads_doubles(checkpoint, monkeypatch):
    """With no seed the walk drew one below 2**63 and returned it; 99% of those are past 2**53, where JavaScript's
    JSON.parse rounds them: sent back, the rounded seed made a different image. The draw is below 2**53 now."""
    import ensembles.image_walk as image_walk

    monkeypatch.setattr(image_walk.secrets, "randbelow", lambda bound: bound - 1)  # the largest draw
    walk = LocalWalk(Flux2KleinFamily(), tiny_deployment(checkpoint), checkpoint).walk
    inputs = request("a fox", 64, 64)
    del inputs["seed"]
    seed = walk.parse_common(inputs).seed
    assert seed == 2**53 - 1 and float(seed) == seed
