"""`model_kwargs.lora`: adapters folded into the DiT's weights at load, against the reference, diffusers'
transformer running the same adapter through PEFT (unfused, fp32, CPU, the tiny klein checkpoint).

Our transformer with the fold matches diffusers' forward with the adapter active within atol 2e-5 (fp32; the
fold reorders the sums W x + s B (A x) into (W + s B A) x; measured 1.4e-6, and 5.9e-6 with rsLoRA, on outputs
up to 8 and 13), while the adapter moves the output by far more than that (asserted, so the comparison can
fail). PEFT scaling rules, several adapters, the single rounding to bf16 and every refusal are checked too, and
the same adapters re-spelled in the original (ai-toolkit/BFL) and Kohya layouts, which diffusers' own converters
read the same way."""

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
    # the fp32 sum (as addmm forms it: `base + 0.3 * 2 * (up @ down)` can differ from it in the last fp32 bit, and
    # then round the other way at a bf16 tie), rounded once; the base rounded first would differ everywhere
    want = torch.addmm(base, up, down, alpha=0.3 * 2.0).to(torch.bfloat16)
    assert torch.equal(folded.state_dict()[f"{name}.weight"], want)
    assert not torch.equal(want, base.to(torch.bfloat16) + (0.3 * 2.0 * (up @ down)).to(torch.bfloat16))


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
    (lambda s: {**s, "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 64)},
     r"1 module\(s\) this transformer does not have, e.g. blocks.0.attn1.to_q: a LoRA for another"),
    (lambda s: {**s, "lora_unet_double_blocks_0_img_attn_qkvx.lora_down.weight": torch.zeros(4, 64)},
     r"1 module\(s\) this transformer does not have, e.g. lora_unet_double_blocks_0_img_attn_qkvx: a LoRA"),
    (lambda s: {**s, "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)},
     r"text-encoder LoRA keys \(text_encoder.model.layers.0"),
    (lambda s: {"diffusion_model.double_blocks.0.img_attn.qkv.lokr_w1": torch.zeros(4, 4)},
     r"a LyCORIS LoKr/LoHa adapter \(diffusion_model.double_blocks.0.img_attn.qkv.lokr_w1\)"),
    (lambda s: {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.zeros(4, 64),
                "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": torch.zeros(190, 4)},
     r"double_blocks.0.img_attn.qkv: lora_B \(190, 4\) @ lora_A \(4, 64\) is not a low-rank pair of 3 equal row"),
    (lambda s: {**s, "transformer.proj_out.lora_A.weight": torch.zeros(4, 65)},
     r"proj_out: lora_B \(16, 4\) @ lora_A \(4, 65\) does not make the weight's shape \(16, 32\)"),
    (lambda s: {k: v for k, v in s.items() if not k.endswith("proj_out.lora_B.weight")},
     r"proj_out has only lora_A"),
    (lambda s: {**s, "transformer.proj_out.lora_B.bias": torch.zeros(64)},
     r"keys that are not LoRA lora_A/lora_B/alpha weights: transformer.proj_out.lora_B.bias"),
], ids=["other-model", "kohya-other-model", "text-encoder", "lokr", "fused-rows", "shape", "a-without-b",
        "lora-bias"])
def test_adapters_for_something_else_are_refused_naming_the_file(checkpoint, tmp_path, good, spoil, message):
    path = write(tmp_path / "bad", spoil(good))
    with pytest.raises(ValueError, match=f"LoRA {path}: {message}"):
        loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(path)])
    with pytest.raises(ValueError, match=f"LoRA {path}: {message}"):  # the same, from the file's header alone
        loader.check_lora(checkpoint, [LoraAdapter(path)])


@pytest.mark.parametrize("config, rule", [
    ('{"lora_alpha": "16"}', r"lora_alpha must be a number, got '16'"),  # was a TypeError
    ('{"lora_alpha": null}', r"lora_alpha must be a number, got None"),
    ('[1, 2]', r"is not a JSON object"),  # was an AttributeError
    ('{"lora_alpha": 8, "use_rslora": "false"}', r"use_rslora must be true or false, got 'false'"),  # was rsLoRA on
])
def test_an_adapter_config_of_the_wrong_shape_is_refused_naming_the_file_and_key(checkpoint, tmp_path, good, config,
                                                                                 rule):
    fine = write(tmp_path / "cfg", good)
    (tmp_path / "cfg" / "adapter_config.json").write_text(config)
    with pytest.raises(ValueError, match=rf"^LoRA {fine}: {tmp_path / 'cfg' / 'adapter_config.json'}: {rule}$"
                       if "JSON object" not in rule else rf"^LoRA {fine}: .*adapter_config.json {rule}$"):
        loader.check_lora(checkpoint, [LoraAdapter(fine)])
    header = tmp_path / "header" / "a.safetensors"
    header.parent.mkdir()
    save_file(good, header, metadata={"lora_adapter_metadata": config})
    with pytest.raises(ValueError, match=rf"^LoRA {header}: {header}'s lora_adapter_metadata header"):
        loader.check_lora(checkpoint, [LoraAdapter(str(header))])


def test_an_unreadable_or_twice_named_adapter_is_refused_naming_the_file(checkpoint, tmp_path, good):
    """A Git LFS pointer (a LoRA repo cloned without git-lfs) escaped `mstar check` as safetensors' own error, a
    traceback naming neither the file nor the key; a bad adapter_config.json was refused without its path; and a
    module given twice (two spellings, or two layouts' names for one weight) was summed twice or half dropped."""
    from mstar_common.families.flux2_klein.family import Flux2KleinFamily

    pointer = tmp_path / "lfs" / "a.safetensors"
    pointer.parent.mkdir()
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 123\n")
    with pytest.raises(DeploymentError, match=rf"^t.yaml: model_kwargs.lora: LoRA {pointer}: {pointer} is not a "
                                              rf"readable safetensors file .*Git LFS pointer"):
        Flux2KleinFamily().check_checkpoint(deployment(lora=[{"path": str(pointer)}]), checkpoint, "t.yaml")
    fine = write(tmp_path / "config", good)
    (tmp_path / "config" / "adapter_config.json").write_text('{"lora_alpha": 8,')
    with pytest.raises(ValueError, match=rf"LoRA {fine}: {tmp_path / 'config' / 'adapter_config.json'} is not JSON"):
        loader.check_lora(checkpoint, [LoraAdapter(fine)])
    key = next(k for k in good if k.endswith("to_q.lora_A.weight"))
    module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
    kohya = f"lora_unet_{module.replace('.', '_')}.lora_down.weight"
    twice = write(tmp_path / "twice", {**good, kohya: good[key].clone()})
    with pytest.raises(ValueError, match=rf"LoRA {twice}: (transformer.{module}.lora_A.weight and {kohya}|{kohya} "
                                         rf"and transformer.{module}.lora_A.weight) both name {module}'s lora_A"):
        loader.check_lora(checkpoint, [LoraAdapter(twice)])
    block = module.removesuffix(".attn.to_q")  # transformer_blocks.N; BFL's fused qkv also covers to_q
    fused = {f"diffusion_model.double_blocks.{block.split('.')[-1]}.img_attn.qkv.lora_A.weight": good[key].clone(),
             f"diffusion_model.double_blocks.{block.split('.')[-1]}.img_attn.qkv.lora_B.weight":
                 torch.cat([good[key.replace("lora_A", "lora_B")]] * 3)}
    both = write(tmp_path / "both", {**good, **fused})
    with pytest.raises(ValueError, match=rf"LoRA {both}: .* both change {module}.weight \(two layouts' names for one "
                                         rf"weight\); keep one"):
        loader.check_lora(checkpoint, [LoraAdapter(both)])


@torch.no_grad()
def test_peft_s_adapter_named_keys_fold_as_diffusers_keys(checkpoint, tmp_path, good):
    """A PEFT model's raw state dict names the adapter (`lora_A.default.weight`): the same fold."""
    plain = write(tmp_path / "plain", good)
    named = write(tmp_path / "named", {k.replace(".weight", ".default.weight"): v for k, v in good.items()})
    want = loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(plain)]).state_dict()
    got = loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(named)]).state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_mstar_check_refuses_a_bad_adapter_before_any_weights_load(checkpoint, tmp_path, good):
    from mstar_common.families.flux2_klein.family import Flux2KleinFamily

    family = Flux2KleinFamily()
    fine = write(tmp_path / "fine", good)
    family.check_checkpoint(deployment(lora=[{"path": fine}]), checkpoint, "t.yaml")
    bad = write(tmp_path / "bad", {k.replace(".to_q.", ".to_z."): v for k, v in good.items()})
    with pytest.raises(DeploymentError, match=r"^t.yaml: model_kwargs.lora: LoRA .*bad/a.safetensors: 1 module\(s\) "
                                              r"this transformer does not have, e.g. transformer_blocks.0.attn.to_z:"):
        family.check_checkpoint(deployment(lora=[{"path": fine}, {"path": bad}]), checkpoint, "t.yaml")


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


# Other layouts: the adapter re-spelled as ai-toolkit/BFL and Kohya files write FLUX.2's modules. The tables below
# are the test's own, from the BFL model's module names; diffusers' converters (`lora_state_dict`) read the same
# files as a second opinion.

BFL_SINGLE = {  # diffusers module -> the BFL module, {i} the block
    "transformer_blocks.{i}.attn.to_out.0": "double_blocks.{i}.img_attn.proj",
    "transformer_blocks.{i}.attn.to_add_out": "double_blocks.{i}.txt_attn.proj",
    "transformer_blocks.{i}.ff.linear_in": "double_blocks.{i}.img_mlp.0",
    "transformer_blocks.{i}.ff.linear_out": "double_blocks.{i}.img_mlp.2",
    "transformer_blocks.{i}.ff_context.linear_in": "double_blocks.{i}.txt_mlp.0",
    "transformer_blocks.{i}.ff_context.linear_out": "double_blocks.{i}.txt_mlp.2",
    "single_transformer_blocks.{i}.attn.to_qkv_mlp_proj": "single_blocks.{i}.linear1",
    "single_transformer_blocks.{i}.attn.to_out": "single_blocks.{i}.linear2",
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
}
BFL_FUSED = {  # BFL's fused projection -> the diffusers modules it holds, in its row order
    "double_blocks.{i}.img_attn.qkv": [f"transformer_blocks.{{i}}.attn.to_{x}" for x in "qkv"],
    "double_blocks.{i}.txt_attn.qkv": [f"transformer_blocks.{{i}}.attn.add_{x}_proj" for x in "qkv"],
}
LAYOUT_TARGETS = (r".*\.(to_q|to_k|add_v_proj|to_out\.0|to_add_out|ff\.linear_in|ff_context\.linear_out|"
                  r"to_qkv_mlp_proj|timestep_embedder\.linear_1)|single_transformer_blocks\.\d+\.attn\.to_out|"
                  r"x_embedder|proj_out")


def pairs_of(state, factor):
    """A diffusers-layout file's tensors -> {module: (A, B * factor)} (the PEFT scaling baked into B)."""
    modules = {key.removeprefix("transformer.").removesuffix(".lora_A.weight") for key in state if "lora_A" in key}
    return {m: (state[f"transformer.{m}.lora_A.weight"], state[f"transformer.{m}.lora_B.weight"] * factor)
            for m in modules}


def to_bfl(pairs, num_double, num_single):
    """{diffusers module: (A, B)} -> {BFL module: (A, B)}: a fused qkv stacks its members' A [sum r, in] over a
    block-diagonal B [3 out, sum r] (a member without an adapter has zero rows)."""
    out = {}
    for pattern, bfl in BFL_SINGLE.items():
        for i in range(num_double if pattern.startswith("transformer_blocks") else num_single):
            if (module := pattern.format(i=i)) in pairs:
                out[bfl.format(i=i)] = pairs[module]
    for bfl, members in BFL_FUSED.items():
        for i in range(num_double):
            present = [(k, pairs[m.format(i=i)]) for k, m in enumerate(members) if m.format(i=i) in pairs]
            if not present:
                continue
            rows = next(up.shape[0] for _, (_, up) in present)
            down = torch.cat([down for _, (down, _) in present])
            up = torch.zeros(3 * rows, down.shape[0])
            col = 0
            for k, (member_down, member_up) in present:
                up[k * rows:(k + 1) * rows, col:col + member_down.shape[0]] = member_up
                col += member_down.shape[0]
            out[bfl.format(i=i)] = (down, up)
    return out


def ai_toolkit_file(folder, pairs):
    """`diffusion_model.<BFL module>.lora_A/B.weight`, no alpha (a factor of 1: the scaling is baked into B)."""
    tensors = {}
    for module, (down, up) in pairs.items():
        tensors[f"diffusion_model.{module}.lora_A.weight"] = down.contiguous()
        tensors[f"diffusion_model.{module}.lora_B.weight"] = up.contiguous()
    return write(folder, tensors)


def kohya_file(folder, pairs, alpha_over_r=0.5):
    """`lora_unet_<module with _>.lora_down/lora_up.weight` and `.alpha`: B divided by alpha/r, which the alpha
    tensor then restores."""
    tensors = {}
    for module, (down, up) in pairs.items():
        name = "lora_unet_" + module.replace(".", "_")
        tensors[f"{name}.lora_down.weight"] = down.contiguous()
        tensors[f"{name}.lora_up.weight"] = (up / alpha_over_r).contiguous()
        tensors[f"{name}.alpha"] = torch.tensor(alpha_over_r * down.shape[0])
    return write(folder, tensors)


def diffusers_converted(pipeline, path, folder):
    """diffusers' own reading of a foreign-layout file (`lora_state_dict`), saved as a diffusers-layout file."""
    return write(folder, {k: v.clone() for k, v in pipeline.lora_state_dict(path).items()})


@pytest.fixture(scope="module")
def layout_case(checkpoint, inputs):
    """An adapter on most kinds of FLUX.2 linear (PEFT, r=4, alpha=8) with diffusers' output under it, and its
    pairs with the scaling baked in."""
    model = reference(checkpoint, {"style": (LoraConfig(r=4, lora_alpha=8, target_modules=LAYOUT_TARGETS), 5)})
    state = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(model, adapter_name="style").items()}
    config = model.config
    return run_reference(model, inputs), pairs_of(state, 2.0), config.num_layers, config.num_single_layers


@pytest.mark.parametrize("layout", ["ai-toolkit", "kohya"])
def test_bfl_and_kohya_layouts_fold_as_diffusers_runs_the_adapter(checkpoint, inputs, base, layout_case, tmp_path,
                                                                    layout):
    want, pairs, num_double, num_single = layout_case
    bfl = to_bfl(pairs, num_double, num_single)
    assert any(".qkv" in module for module in bfl) and any("single_blocks" in module for module in bfl)
    path = (ai_toolkit_file if layout == "ai-toolkit" else kohya_file)(tmp_path / layout, bfl)
    got = run_ours(checkpoint, inputs, [LoraAdapter(path)])
    assert (want - base).abs().max() > 100 * ATOL
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # diffusers' converter reads the same file the same way
    converted = diffusers_converted(Flux2KleinPipeline, path, tmp_path / "converted")
    torch.testing.assert_close(run_ours(checkpoint, inputs, [LoraAdapter(converted)]), got, atol=ATOL, rtol=0)


@torch.no_grad()
def test_the_bfl_final_modulation_lands_with_its_halves_swapped(checkpoint, tmp_path):
    """BFL's final adaLN modulation puts shift before scale; diffusers' checkpoint conversion swaps the two halves
    of its weight into norm_out.linear (scale first), so a BFL LoRA's B rows are swapped the same way."""
    generator = torch.Generator().manual_seed(7)
    down, up = torch.randn(2, 32, generator=generator), torch.randn(64, 2, generator=generator)
    path = ai_toolkit_file(tmp_path, {"final_layer.adaLN_modulation.1": (down, up)})
    base_weight = loader.load_transformer(checkpoint, "float32", "cpu").state_dict()["norm_out.linear.weight"]
    folded = loader.load_transformer(checkpoint, "float32", "cpu", [LoraAdapter(path)])
    shift, scale = (up @ down).chunk(2)
    torch.testing.assert_close(folded.state_dict()["norm_out.linear.weight"], base_weight + torch.cat([scale, shift]),
                               atol=1e-6, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("layout", ["diffusers", "original", "kohya", "kohya-qkv"])
def test_z_image_turbo_folds_the_same_adapters(tmp_path, layout):
    """Z-Image-Turbo's DiT loads adapters the same way: its fold matches diffusers' forward with the adapter active,
    from diffusers' file, from the original layout (`diffusion_model.`, each attention's output as `attention.out`)
    and from Kohya's (`lora_unet_`, `_` for `.`, alpha tensors), also with each attention's q, k, v as the original
    model's fused `attention.qkv` (refused as another model's module before); diffusers' own converter reads the
    foreign layouts the same way."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from mstar_common.families.z_image_turbo import loader as z_loader
    from mstar_common.families.z_image_turbo.tiny import build_tiny_checkpoint as build_z_checkpoint
    from mstar_common.families.z_image_turbo.transformer import patchify, unpatchify

    checkpoint = build_z_checkpoint(tmp_path / "z-image-turbo-tiny")
    model = ZImageTransformer2DModel.from_pretrained(checkpoint / "transformer").eval()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "w1", "w3",
                                                                     "cap_embedder.1"]))
    generator = torch.Generator().manual_seed(3)
    for key, param in model.named_parameters():
        if "lora_" in key:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    state = get_peft_model_state_dict(model)
    if layout == "diffusers":
        ZImagePipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=state)
        (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8}))
        path = str(tmp_path / "lora")
    else:
        pairs = pairs_of({f"transformer.{k}": v for k, v in state.items()}, 2.0)
        assert any(module.endswith("attention.to_out.0") for module in pairs)
        pairs = {module.replace("attention.to_out.0", "attention.out"): pair for module, pair in pairs.items()}
        if layout == "kohya-qkv":  # q, k, v as one fused projection: stacked A over a block-diagonal B
            for block in sorted({m.removesuffix(".attention.to_q") for m in pairs if m.endswith(".attention.to_q")}):
                members = [pairs.pop(f"{block}.attention.to_{x}") for x in "qkv"]
                down = torch.cat([a for a, _ in members])
                up = torch.block_diag(*(b for _, b in members))
                pairs[f"{block}.attention.qkv"] = (down, up)
        if layout == "original":
            path = ai_toolkit_file(tmp_path / layout, pairs)
        else:
            path = kohya_file(tmp_path / layout, pairs)
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
    got = ours([LoraAdapter(path)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    if layout != "diffusers":
        converted = diffusers_converted(ZImagePipeline, path, tmp_path / "converted")
        torch.testing.assert_close(ours([LoraAdapter(converted)]), got, atol=ATOL, rtol=0)
