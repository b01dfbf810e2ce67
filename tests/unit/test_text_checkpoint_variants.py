"""Real-world variants of Qwen3 and Llama checkpoints, built tiny with transformers' own classes: each is either
served with transformers' logits and greedy tokens, or refused by `mstar check` (and so by `mstar serve` before it
starts anything) with one line naming the config key."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mstar_common import cli, wire
from mstar_common.checkpoints import vary_norms_and_biases
from mstar_common.config import load_deployment
from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.types import EngineConfig, FinishReason, SamplingParams
from mstar_common.families.llama.family import LlamaFamily
from mstar_common.families.llama.loader import load_llama
from mstar_common.families.qwen3.family import Qwen3Family
from mstar_common.families.qwen3.loader import load_qwen3
from mstar_common.families.qwen3.tiny import VOCAB_MULTIPLE, build_tokenizer
from tests.unit.test_qwen3_parity import PagedRunner

transformers = pytest.importorskip("transformers")

TOKENIZER = build_tokenizer()
VOCAB = -(-len(TOKENIZER) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
BASE = {"vocab_size": VOCAB, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "initializer_range": 0.2, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": None}
FAMILIES = {  # family -> (HF model class, HF config class, loader)
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, load_llama),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, load_qwen3),
}
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}  # small, so the tiny prompts cross every band


def build(path: Path, family: str, model_cls: type | None = None, config_cls: type | None = None, **overrides) -> Path:
    hf_model, hf_config, _ = FAMILIES[family]
    config = (config_cls or hf_config)(**{**BASE, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # norm weights varied and the zero-initialised biases random: with 1s and 0s a variant whose biases or norm
        # weights the loader dropped still matched transformers exactly
        model = vary_norms_and_biases((model_cls or hf_model)(config).eval())
    model.save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


def as_transformers_v4(path: Path) -> Path:
    """Rewrite config.json as checkpoints on the Hub still have it (transformers v4): `rope_theta` at the top,
    `rope_scaling` with `type`, `torch_dtype`."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else {"type": rope.pop("rope_type"), **rope}
    config["torch_dtype"] = config.pop("dtype", "bfloat16")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _prompt(length: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def _greedy(engine: AREngine, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], str]:
    tokens, finish = [], []
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                       lambda rid, toks, fin, err: (tokens.extend(toks), fin and finish.append(fin)))
    while engine.step() or engine.scheduler.num_running:
        pass
    return tokens, finish[0] if finish else ""


def assert_matches_transformers(path: Path, family: str) -> None:
    hf_model, _, loader = FAMILIES[family]
    hf = hf_model.from_pretrained(path, dtype=torch.float32).eval()
    model, config = loader(path)
    ids = _prompt(70)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model)
    table = runner.new_table(len(ids))
    got = torch.cat([runner.forward([(table, ids[:45], 0)]), runner.forward([(table, ids[45:], 45)])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    engine = AREngine(model, EngineConfig(num_kv_pages=64, page_size=8, max_num_seqs=4, max_batch_tokens=64),
                      eos_token_ids=[], vocab_size=config["vocab_size"])
    out = hf.generate(torch.tensor([ids[:20]]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert _greedy(engine, ids[:20], 12)[0] == out[0, 20:].tolist()


SERVED = {
    "llama-head_dim-apart-from-hidden/heads": ("llama", {"head_dim": 32}),
    "llama-gqa-1": ("llama", {"num_key_value_heads": 6}),
    "llama-gqa-8": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 12}),
    "llama-attention_bias-mlp_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama3.1-rope": ("llama", {"rope_parameters": {"rope_theta": 500_000.0, **LLAMA31_ROPE}}),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False}),
    "qwen3-head_dim-apart-from-hidden/heads": ("qwen3", {"head_dim": 32}),
    "qwen3-attention_bias": ("qwen3", {"attention_bias": True}),
    # YaRN as Qwen3's model cards enable it (original small, so the tiny prompts cross the ramp), and with every
    # optional key; the attention factor goes into the softmax scale, transformers' into cos and sin
    "qwen3-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                 "original_max_position_embeddings": 32}}),
    "qwen3-yarn-every-key": ("qwen3", {"rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4, "original_max_position_embeddings": 64,
        "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}}),
    "llama-yarn-mscale": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 16, "mscale": 1.0,
                                                        "mscale_all_dim": 0.5}}),
}


@pytest.mark.parametrize("variant", SERVED)
def test_a_variant_is_served_as_transformers_runs_it(variant, tmp_path):
    family, overrides = SERVED[variant]
    assert_matches_transformers(build(tmp_path / "ckpt", family, **overrides), family)


@pytest.mark.parametrize("family, overrides", [
    ("llama", {"rope_parameters": {"rope_theta": 500_000.0, **LLAMA31_ROPE}}),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    ("qwen3", {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 32}}),
], ids=["llama3.1", "linear", "qwen3", "qwen3-yarn"])
def test_a_config_json_in_the_transformers_v4_layout_is_read_the_same(family, overrides, tmp_path):
    assert_matches_transformers(as_transformers_v4(build(tmp_path / "ckpt", family, **overrides)), family)


def _check(tmp_path: Path, family: str, checkpoint: Path, capsys) -> tuple[int, str]:
    raw = yaml.safe_load((cli.CONFIGS / "qwen3.yaml").read_text())
    raw.update(family=family, checkpoint=str(checkpoint))
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()  # the build's progress bars
    code = cli.main(["check", str(path)])
    return code, capsys.readouterr().err


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


REFUSED = {
    "qwen3-moe": ("qwen3", dict(model_cls=transformers.Qwen3MoeForCausalLM, config_cls=transformers.Qwen3MoeConfig,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), {},
                  r"model_type='qwen3_moe' \(architectures \['Qwen3MoeForCausalLM'\]\) is not supported: only "
                  r"\['qwen3'\]"),
    "qwen3-longrope": ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6,
                                                     "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                                     "original_max_position_embeddings": 128}}, {},
                       r"rope_parameters.rope_type='longrope' is not supported"),
    "qwen3-sliding-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, {},
                             r"use_sliding_window=true is not supported"),
    "llama-dynamic-rope": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                           {}, r"rope_parameters.rope_type='dynamic' is not supported: only 'default', 'llama3', "
                               r"'linear', 'yarn' RoPE are"),
    "llama-under-family-qwen3": ("llama", {}, {"family": "qwen3"}, r"model_type='llama' .* only \['qwen3'\]"),
    "a-classifier-head": ("llama", {}, {"architectures": ["LlamaForSequenceClassification"]},
                          r"architectures=\['LlamaForSequenceClassification'\] is not supported"),
    "quantized": ("llama", {}, {"quantization_config": {"quant_method": "fp8"}},
                  r"quantization_config \(quant_method='fp8'\) is not supported"),
}


@pytest.mark.parametrize("variant", REFUSED)
def test_an_unsupported_variant_is_refused_by_mstar_check_naming_the_key(variant, tmp_path, capsys):
    """`mstar check` said ok to each; the component then failed at load, inside tritonserver."""
    family, build_args, edits, rule = REFUSED[variant]
    checkpoint = build(tmp_path / "ckpt", family, **build_args)
    served_as = edits.get("family", family)
    _edit_config(checkpoint, **{k: v for k, v in edits.items() if k != "family"})
    code, err = _check(tmp_path, served_as, checkpoint, capsys)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"mstar: error: dep.yaml: checkpoint {checkpoint}: config.json: ")
    assert re.search(rule, err), err


def test_rope_tables_an_older_checkpoint_carries_are_skipped_and_other_extra_tensors_refused(tmp_path):
    """transformers before 4.31 saved each layer's `rotary_emb.inv_freq` (some trainers cos/sin caches too):
    derived from config.json, transformers skips them on load, and so does the loader; any other extra tensor is
    still refused by name."""
    path = build(tmp_path / "ckpt", "llama", rope_parameters={"rope_theta": 500_000.0, **LLAMA31_ROPE})
    tensors = load_file(path / "model.safetensors")
    for layer in range(BASE["num_hidden_layers"]):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert_matches_transformers(path, "llama")
    tensors["model.layers.0.self_attn.rotary_emb.scale"] = torch.ones(1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unused checkpoint tensors model.layers.0.self_attn.rotary_emb.scale$"):
        load_llama(path)


FAMILIES_RUNTIME = {"llama": LlamaFamily, "qwen3": Qwen3Family}


def _runtime(path: Path, family: str = "llama"):
    dep = load_deployment(cli.CONFIGS / "qwen3.yaml")
    return FAMILIES_RUNTIME[family]().build_component("llm", dataclasses.replace(dep, family=family), path, "cpu")



@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_an_eos_token_id_list_stops_generation_at_any_of_its_ids(where, tmp_path):
    """Llama 3 instruct lists [128001, 128008, 128009] in both files; generation stops at any of them, and at the
    tokenizer's eos_token beside them (as vLLM), where transformers' generate stops given that set."""
    path = build(tmp_path / "ckpt", "llama")
    prompt = _prompt(20)
    free_run, _ = _greedy(_runtime(path).engine, prompt, 12)
    stop_at = next(i for i in range(2, 12) if free_run[i] not in free_run[:i])
    eos = [VOCAB - 1, free_run[stop_at], VOCAB - 2]
    if where == "config.json":
        _edit_config(path, eos_token_id=eos)
        (path / "generation_config.json").unlink()
    else:
        _edit_config(path, eos_token_id=VOCAB - 3)
        generation = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    runtime = _runtime(path)
    stops = sorted({*eos, transformers.AutoTokenizer.from_pretrained(path).eos_token_id})
    assert sorted(runtime.engine.eos_token_ids) == stops and len(stops) == 4
    tokens, finish = _greedy(runtime.engine, prompt, 12, ignore_eos=False)
    end = next(i for i, token in enumerate(free_run) if token in stops)  # at stop_at, or at the tokenizer's before
    assert end <= stop_at and tokens == free_run[:end + 1] and finish == FinishReason.STOP
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=stops)
    assert theirs[0, 20:].tolist() == tokens


def _messages_prompt(runtime, messages: list[dict]) -> list[int]:
    return runtime.parse_request({wire.MESSAGES: np.array([json.dumps(messages).encode()], dtype=object)}).prompt_ids


def test_the_chat_template_is_found_in_chat_template_jinja_or_tokenizer_config(tmp_path):
    """transformers 5 writes the template to chat_template.jinja; most Hub checkpoints keep it inside
    tokenizer_config.json; without either the chat route refuses messages (a 400 naming `messages`)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = TOKENIZER.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    path = build(tmp_path / "ckpt", "qwen3")
    assert (path / "chat_template.jinja").is_file()
    runtime = _runtime(path, "qwen3")
    assert _messages_prompt(runtime, messages) == TOKENIZER.encode(want, add_special_tokens=False)
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))
    assert _messages_prompt(_runtime(path, "qwen3"), messages) == _messages_prompt(runtime, messages)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match=r"^messages: this checkpoint has no chat template, so it takes a raw "
                                         r"prompt only: /v1/completions' `prompt`"):
        _messages_prompt(_runtime(path, "qwen3"), messages)


def test_sharded_weights_load_and_a_shard_missing_or_no_tokenizer_is_refused_by_mstar_check(tmp_path, capsys):
    """Shards listed in model.safetensors.index.json load as one file does; a download cut short (the index and
    some shards) or a folder without tokenizer files said ok at `mstar check` and failed at load."""
    single = build(tmp_path / "single", "qwen3", tie_word_embeddings=False)
    path = tmp_path / "sharded"
    transformers.Qwen3ForCausalLM.from_pretrained(single, dtype=torch.float32).save_pretrained(
        path, max_shard_size="100KB")
    TOKENIZER.save_pretrained(path)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").is_file()
    assert_matches_transformers(path, "qwen3")
    assert _check(tmp_path, "qwen3", path, capsys)[0] == 0
    shards[-1].rename(tmp_path / "elsewhere")
    code, err = _check(tmp_path, "qwen3", path, capsys)
    assert code == 2 and err == (f"mstar: error: dep.yaml: checkpoint {path}: model.safetensors.index.json names "
                                 f"shard(s) ['{shards[-1].name}'] that are not in the folder (an unfinished "
                                 f"download?)\n")
    (tmp_path / "elsewhere").rename(shards[-1])
    (path / "tokenizer.json").unlink()
    code, err = _check(tmp_path, "qwen3", path, capsys)
    assert code == 2 and err.startswith(f"mstar: error: dep.yaml: checkpoint {path}: no tokenizer (tokenizer.json, ")


@pytest.mark.parametrize("stored, says", [(torch.bfloat16, "float32"), (torch.float16, "bfloat16"),
                                          (torch.float32, "bfloat16")])
def test_weights_stored_in_another_dtype_than_torch_dtype_says_load_as_transformers_loads_them(stored, says,
                                                                                                tmp_path):
    path = build(tmp_path / "ckpt", "qwen3", tie_word_embeddings=False)
    tensors = {name: t.to(stored) for name, t in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _edit_config(path, dtype=says, torch_dtype=says)
    assert_matches_transformers(path, "qwen3")


def test_a_raw_prompt_gets_the_bos_a_llama_tokenizer_adds(tmp_path):
    """Llama 3's tokenizer.json frames every text as `<|begin_of_text|> $A`: transformers' `tokenizer(text)` and
    vLLM's completions start the prompt with it, and a Llama base model's output depends on it. text_input (and so
    /v1/completions) was encoded without it; a chat prompt takes the BOS its template writes, not a second one."""
    from tokenizers import processors

    bos = "<|endoftext|>"
    backend = build_tokenizer().backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, TOKENIZER.convert_tokens_to_ids(bos))])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>")
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = build(tmp_path / "ckpt", "llama")
    tokenizer.save_pretrained(path)
    runtime = _runtime(path)
    text = "Hello world"
    ids = runtime.parse_request({wire.TEXT_INPUT: np.array([text.encode()], dtype=object)}).prompt_ids
    assert ids == tokenizer(text).input_ids and ids[0] == tokenizer.bos_token_id
    assert _messages_prompt(runtime, [{"role": "user", "content": text}]) == ids


def _gen_config(path: Path, **fields) -> Path:
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, **fields}))
    return path


def test_a_request_that_leaves_a_knob_unset_samples_with_the_checkpoints_generation_config(tmp_path):
    """Qwen3's and Llama 3's checkpoints recommend sampling values in generation_config.json (Qwen3: temperature 0.6,
    top_p 0.95, top_k 20); vLLM applies them to requests that leave those knobs unset, and so does the server now.
    A knob the request sets wins; `model_kwargs.generation_config: ignore` keeps the API's own defaults."""
    path = _gen_config(build(tmp_path / "ckpt", "qwen3"), do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
                       repetition_penalty=1.05)
    prompt = {wire.TEXT_INPUT: np.array([b"Hello"], dtype=object)}
    params = _runtime(path, "qwen3").parse_request(prompt).params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.6, 0.95, 20, 0.0, 1.05)
    sent = {**prompt, "temperature": np.array([0.0], np.float32), "top_k": np.array([0], np.int32)}
    params = _runtime(path, "qwen3").parse_request(sent).params
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 0.95)
    dep = load_deployment(cli.CONFIGS / "qwen3.yaml")
    dep = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "generation_config": "ignore"})
    params = Qwen3Family().build_component("llm", dep, path, "cpu").parse_request(prompt).params
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


@pytest.mark.parametrize("fields, message", [
    ({"top_p": 0.0}, "generation_config.json: top_p: must be in (0, 1], got 0.0"),
    ({"temperature": "hot"}, "generation_config.json: temperature: must be a number, got 'hot'"),
    ({"top_k": 20.5}, "generation_config.json: top_k: must be an integer, got 20.5"),
])
def test_a_generation_config_whose_sampling_values_break_the_rules_is_refused_by_mstar_check(fields, message,
                                                                                             tmp_path, capsys):
    path = _gen_config(build(tmp_path / "ckpt", "qwen3"), **fields)
    code, err = _check(tmp_path, "qwen3", path, capsys)
    assert code != 0 and message in err and "model_kwargs.generation_config: ignore" in err
    raw = yaml.safe_load((cli.CONFIGS / "qwen3.yaml").read_text())
    raw.update(checkpoint=str(path), model_kwargs={**raw["model_kwargs"], "generation_config": "ignore"})
    (tmp_path / "ignored.yaml").write_text(yaml.safe_dump(raw))
    assert cli.main(["check", str(tmp_path / "ignored.yaml")]) == 0


@pytest.mark.parametrize("weight_map", [{"a": 1}, {"a": None}, {"a": ""}])
def test_an_index_whose_weight_map_names_no_files_is_refused_naming_it(tmp_path, weight_map):
    """Values that are not file names got past the index check (a bare TypeError joining a folder and an int),
    which `mstar check` then reported as an unreadable config.json."""
    from mstar_common.safetensors_io import safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not a safetensors index \(TypeError: "
                                         r"weight_map's values are shard file names"):
        safetensors_files(tmp_path)


def test_a_prompt_refusal_names_the_input_that_held_it(tmp_path):
    """The component said `prompt: ...`, a name no direct Triton client sends (the proxy renames it to the client's
    field either way)."""
    import numpy as np

    from mstar_common import wire

    runtime = _runtime(build(tmp_path / "ckpt", "qwen3"), "qwen3")
    try:
        with pytest.raises(ValueError, match=r"^input_ids: must not be empty$"):
            runtime.parse_request({wire.INPUT_IDS: np.zeros(0, np.int32)})
        with pytest.raises(ValueError, match=r"^text_input: must not be empty$"):
            runtime.parse_request({wire.TEXT_INPUT: np.array([b""], dtype=object)})
        long_text = np.array([("hello " * runtime.max_model_len).encode()], dtype=object)
        with pytest.raises(ValueError, match=r"^text_input: \d+ tokens leave no room for output"):
            runtime.parse_request({wire.TEXT_INPUT: long_text})
    finally:
        runtime.engine.shutdown()


def test_a_yarn_checkpoint_serves_the_context_it_scales_to(tmp_path):
    """max_model_len may reach original_max_position_embeddings x factor (it was refused past
    max_position_embeddings, which Qwen3's configs keep at 40,960 under a 131,072 YaRN context), and not past it."""
    import yaml

    from mstar_common.cli import CONFIGS
    from mstar_common.config import DeploymentError, deployment_from_dict
    from mstar_common.families.base import check_position_limit

    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 256}
    path = build(tmp_path / "ckpt", "qwen3", rope_parameters=rope)  # max_position_embeddings 512: 1,024 served
    raw = yaml.safe_load((CONFIGS / "qwen3.yaml").read_text())
    for length, refused in ((1024, False), (1025, True)):
        resources = {**raw["resources"], "max_model_len": length,
                     "kv_cache": {**raw["resources"]["kv_cache"], "num_pages": 2048}}
        dep = deployment_from_dict({**raw, "checkpoint": str(path), "resources": resources}, source="t.yaml")
        if refused:
            with pytest.raises(DeploymentError, match=r"max_model_len: 1025 exceeds the checkpoint's YaRN context"):
                check_position_limit(dep, path, "t.yaml")
        else:
            check_position_limit(dep, path, "t.yaml")
    assert load_qwen3(path)[0].max_position_embeddings == 1024
