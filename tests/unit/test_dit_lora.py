"""`model_kwargs.lora`: adapters folded into the DiT's weights at load, against the reference, diffusers'
transformer running the same adapter through PEFT (unfused, fp32, CPU, the tiny klein checkpoint).

Our transformer with the fold matches diffusers' forward with the adapter active within atol 2e-5 (fp32; the
fold reorders the sums W x + s B (A x) into (W + s B A) x; measured 1.4e-6, and 5.9e-6 with rsLoRA, on outputs
up to 8 and 13), while the adapter moves the output by far more than that (asserted, so the comparison can
fail). PEFT scaling rules, several adapters, the single rounding to bf16 and every refusal are checked too."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mstar_common.config import DeploymentError, deployment_from_dict  # noqa: E402
from mstar_common.diffusion.image_options import LoraAdapter  # noqa: E402
from mstar_common.families.flux2_klein import loader  # noqa: E402
from mstar_common.families.flux2_klein.tiny import TINY_TAPS, build_tiny_checkpoint  # noqa: E402

TARGETS = ["to_q", "to_v", "to_out.0", "ff.linear_in", "to_qkv_mlp_proj", "proj_out"]
ATOL = 2e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("flux2") / "flux2-klein-tiny")


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    batch, h, w = 2, 4, 6
    latents, prompt = torch.randn(batch, h * w, 16), torch.randn(batch, 512, 48)
    txt_ids = Flux2KleinPipeline._prepare_text_ids(prompt)
    img_ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(batch, 16, h, w))
    return latents, prompt, torch.tensor([0.9, 0.3]), txt_ids, img_ids


def reference(checkpoint, adapters):
    """diffusers' transformer with PEFT adapters `{name: (LoraConfig, seed)}` added, every factor random (PEFT
    starts lora_B at zero, which would leave the output unchanged)."""
    model = Flux2Transformer2DModel.from_pretrained(checkpoint / "transformer").eval()
    for name, (config, seed) in adapters.items():
        model.add_adapter(config, adapter_name=name)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, param in model.named_parameters():
                if f".{name}." in key and "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def run_reference(model, inputs):
    latents, prompt, timestep, txt_ids, img_ids = inputs
    with torch.no_grad():
        return model(hidden_states=latents, encoder_hidden_states=prompt, timestep=timestep, img_ids=img_ids,
                     txt_ids=txt_ids, guidance=None, return_dict=False)[0]


def run_ours(checkpoint, inputs, lora=(), dtype="float32"):
    latents, prompt, timestep, txt_ids, img_ids = inputs
    ours = loader.load_transformer(checkpoint, dtype, "cpu", lora)
    with torch.no_grad():
        return ours(latents, prompt, timestep, ours.rope(txt_ids[0], img_ids[0]))


def save_diffusers(model, name, folder, config=None, **extra):
    """The adapter as diffusers' pipeline saves it (`transformer.<module>.lora_A.weight`), with PEFT's
    adapter_config.json beside it when `config` is given."""
    state = get_peft_model_state_dict(model, adapter_name=name)
    Flux2KleinPipeline.save_lora_weights(folder, transformer_lora_layers=state, **extra)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder / "pytorch_lora_weights.safetensors")


def lora(r=4, alpha=8, **kwargs):
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, **kwargs)


@pytest.fixture(scope="module")
def base(checkpoint, inputs):
    return run_ours(checkpoint, inputs)


@pytest.mark.parametrize("rslora", [False, True], ids=["alpha-over-r", "rslora-alpha-over-sqrt-r"])
def test_fold_matches_diffusers_with_the_peft_adapter_active(checkpoint, inputs, base, tmp_path, rslora):
    model = reference(checkpoint, {"style": (lora(use_rslora=rslora), 1)})
    want = run_reference(model, inputs)
    path = save_diffusers(model, "style", tmp_path, {"r": 4, "lora_alpha": 8, "use_rslora": rslora})
    got = run_ours(checkpoint, inputs, [LoraAdapter(path)])
    assert (want - base).abs().max() > 100 * ATOL  # the adapter matters
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_scale_zero_is_the_base_and_scale_multiplies_the_peft_scaling(checkpoint, inputs, base, tmp_path):
    model = reference(checkpoint, {"style": (lora(), 1)})
    path = save_diffusers(model, "style", tmp_path, {"lora_alpha": 8})
    assert torch.equal(run_ours(checkpoint, inputs, [LoraAdapter(path, 0.0)]), base)
    model.set_adapters(["style"], weights=[0.5])
    torch.testing.assert_close(run_ours(checkpoint, inputs, [LoraAdapter(path, 0.5)]), run_reference(model, inputs),
                               atol=ATOL, rtol=0)


def test_alpha_key_in_the_file_then_header_metadata_then_alpha_equals_r(checkpoint, inputs, tmp_path):
    model = reference(checkpoint, {"style": (lora(alpha=8), 1)})
    want = run_reference(model, inputs)
    state = load_file(save_diffusers(model, "style", tmp_path / "plain"))
    # no alpha anywhere: alpha = r, a scaling of 1, i.e. half the adapter's alpha=8/r=4
    unscaled = run_ours(checkpoint, inputs, [LoraAdapter(str(tmp_path / "plain"), 2.0)])
    torch.testing.assert_close(unscaled, want, atol=ATOL, rtol=0)
    # per-module alpha keys (beating a wrong adapter_config.json beside them)
    keyed = dict(state)
    keyed.update({key.replace(".lora_A.weight", ".alpha"): torch.tensor(8.0) for key in state if "lora_A" in key})
    (tmp_path / "keyed").mkdir()
    save_file(keyed, tmp_path / "keyed" / "a.safetensors")
    (tmp_path / "keyed" / "adapter_config.json").write_text(json.dumps({"lora_alpha": 1}))
    torch.testing.assert_close(run_ours(checkpoint, inputs, [LoraAdapter(str(tmp_path / "keyed"))]), want,
                               atol=ATOL, rtol=0)
    # diffusers' own metadata header (save_lora_weights with the adapter's config)
    meta = model.peft_config["style"].to_dict()
    path = save_diffusers(model, "style", tmp_path / "meta", transformer_lora_adapter_metadata=meta)
    torch.testing.assert_close(run_ours(checkpoint, inputs, [LoraAdapter(path)]), want, atol=ATOL, rtol=0)


def test_two_adapters_sum(checkpoint, inputs, tmp_path):
    adapters = {"a": (lora(r=4, alpha=8), 1), "b": (LoraConfig(r=2, lora_alpha=2, target_modules=["to_k"]), 2)}
    model = reference(checkpoint, adapters)
    model.set_adapters(["a", "b"], weights=[1.0, -0.7])
    want = run_reference(model, inputs)
    paths = [save_diffusers(model, name, tmp_path / name, {"lora_alpha": adapters[name][0].lora_alpha})
             for name in adapters]
    got = run_ours(checkpoint, inputs, [LoraAdapter(paths[0]), LoraAdapter(paths[1], -0.7)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    alone = run_ours(checkpoint, inputs, [LoraAdapter(paths[0])])
    assert (alone - want).abs().max() > 100 * ATOL  # the second adapter counts


@torch.no_grad()
def test_bf16_weights_are_the_fp32_sum_rounded_once(checkpoint, tmp_path):
    model = reference(checkpoint, {"style": (lora(), 1)})
    path = save_diffusers(model, "style", tmp_path, {"lora_alpha": 8})
    name = "transformer_blocks.0.attn.to_q"
    state = load_file(path)
    down, up = state[f"transformer.{name}.lora_A.weight"], state[f"transformer.{name}.lora_B.weight"]
    base = loader.load_transformer(checkpoint, "float32", "cpu").state_dict()[f"{name}.weight"]
    folded = loader.load_transformer(checkpoint, "bfloat16", "cpu", [LoraAdapter(path, 0.3)])
    want = (base + 0.3 * 2.0 * (up @ down)).to(torch.bfloat16)
    assert torch.equal(folded.state_dict()[f"{name}.weight"], want)


def write(folder, tensors, name="a.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / name)
    return str(folder / name)


@pytest.fixture
def good(checkpoint, tmp_path):
    """A valid adapter's tensors (diffusers keys) for the refusal tests to spoil."""
    model = reference(checkpoint, {"style": (lora(), 1)})
    return load_file(save_diffusers(model, "style", tmp_path / "good"))


def test_dora_is_refused(checkpoint, tmp_path):
    model = Flux2Transformer2DModel.from_pretrained(checkpoint / "transformer")
    model.add_adapter(lora(use_dora=True))
    state = get_peft_model_state_dict(model)
    assert any("lora_magnitude_vector" in key for key in state)
    path = write(tmp_path, {f"transformer.{k}": v.contiguous() for k, v in state.items()})
    with pytest.raises(ValueError, match=r"a DoRA adapter .*lora_magnitude_vector"):
        loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(path)])
    kohya = write(tmp_path / "k", {"transformer.proj_out.dora_scale": torch.ones(1, 64)})
    with pytest.raises(ValueError, match=r"a DoRA adapter .*dora_scale"):
        loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(kohya)])


@pytest.mark.parametrize("spoil,message", [
    (lambda s: {**s, "transformer.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 64)},
     r"1 module\(s\) this transformer does not have, e.g. double_blocks.0.img_attn.qkv.weight: a LoRA for another"),
    (lambda s: {**s, "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)},
     r"text-encoder LoRA keys \(text_encoder.model.layers.0"),
    (lambda s: {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 64)},
     r"BFL/Kohya-layout keys .* not supported yet; convert .*lora_state_dict"),
    (lambda s: {**s, "transformer.proj_out.lora_A.weight": torch.zeros(4, 65)},
     r"proj_out: lora_B \(16, 4\) @ lora_A \(4, 65\) does not make the weight's shape \(16, 32\)"),
    (lambda s: {k: v for k, v in s.items() if not k.endswith("proj_out.lora_B.weight")},
     r"proj_out has only lora_A"),
    (lambda s: {**s, "transformer.proj_out.lora_B.bias": torch.zeros(64)},
     r"keys that are not LoRA lora_A/lora_B/alpha weights: transformer.proj_out.lora_B.bias"),
], ids=["other-model", "text-encoder", "bfl-layout", "shape", "a-without-b", "lora-bias"])
def test_adapters_for_something_else_are_refused_naming_the_file(checkpoint, tmp_path, good, spoil, message):
    path = write(tmp_path / "bad", spoil(good))
    with pytest.raises(ValueError, match=f"LoRA {path}: {message}"):
        loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(path)])


def deployment(**model_kwargs):
    return deployment_from_dict({
        "name": "flux2-test", "family": "flux2_klein", "checkpoint": "builtin:flux2-klein-tiny",
        "components": {name: {} for name in ("walk", "text_encoder", "vae_encode", "denoise", "vae_decode")},
        "model_kwargs": {"text_encoder_out_layers": list(TINY_TAPS), "default_size": "64x64", **model_kwargs},
    }, source="t.yaml")


def test_options_read_lora_entries_and_refuse_bad_ones(tmp_path):
    path = write(tmp_path, {"transformer.proj_out.lora_A.weight": torch.zeros(1, 32)})
    from mstar_common.families.flux2_klein.options import options_from_kwargs

    options = options_from_kwargs({"lora": [{"path": path}, {"path": path, "scale": -0.5}]}, "t.yaml")
    assert options.lora == (LoraAdapter(path, 1.0), LoraAdapter(path, -0.5))
    for entries, message in [
        ([{"path": path}, {"path": str(tmp_path / "missing.safetensors")}],
         r"^t.yaml: model_kwargs.lora\[1\].path: .*missing.safetensors does not exist"),
        ([{"path": path, "scale": "strong"}], r"model_kwargs.lora\[0\].scale: must be a finite number"),
        ([{"path": path, "scale": float("nan")}], r"model_kwargs.lora\[0\].scale: must be a finite number"),
        ([{"path": path, "weight": 1}], r"model_kwargs.lora\[0\]: unknown key\(s\) \['weight'\]"),
        ([{"scale": 1}], r"model_kwargs.lora\[0\].path: must be the path"),
        ({"path": path}, r"model_kwargs.lora: must be a list"),
    ]:
        with pytest.raises(DeploymentError, match=message):
            deployment(lora=entries)


@torch.no_grad()
def test_z_image_turbo_folds_the_same_adapters(tmp_path):
    """Z-Image-Turbo's DiT loads diffusers keys the same way: its fold matches diffusers' forward with the adapter
    active too."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from mstar_common.families.z_image_turbo import loader as z_loader
    from mstar_common.families.z_image_turbo.tiny import build_tiny_checkpoint as build_z_checkpoint
    from mstar_common.families.z_image_turbo.transformer import patchify, unpatchify

    checkpoint = build_z_checkpoint(tmp_path / "z-image-turbo-tiny")
    model = ZImageTransformer2DModel.from_pretrained(checkpoint / "transformer").eval()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_out.0", "w1", "w3", "cap_embedder.1"]))
    generator = torch.Generator().manual_seed(3)
    for key, param in model.named_parameters():
        if "lora_" in key:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    ZImagePipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(model))
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8}))
    torch.manual_seed(0)
    height, width, batch = 4, 6, 2
    latents, feats, t = torch.randn(batch, 16, 2 * height, 2 * width), torch.randn(20, 24), torch.rand(batch)
    want = torch.stack(model([x[:, None] for x in latents], t, [feats] * batch, return_dict=False)[0])[:, :, 0]

    def ours(lora):
        dit = z_loader.load_transformer(checkpoint, "float32", "cpu", lora)
        caption = dit.encode_caption(feats)
        got = dit(patchify(latents, 2), caption.expand(batch, -1, -1), t, dit.rope(height, width, caption.shape[0]))
        return unpatchify(got, height, width, 2)

    assert (ours(()) - want).abs().max() > 100 * ATOL
    torch.testing.assert_close(ours([LoraAdapter(str(tmp_path / "lora"))]), want, atol=ATOL, rtol=0)
