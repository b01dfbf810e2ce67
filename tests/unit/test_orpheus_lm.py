"""The Orpheus LM component: greedy audio tokens equal transformers on a tiny random Llama (custom-token
restriction applied to the reference logits too), the head's text rows are -inf, and request refusals."""

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from mstar_common import wire
from mstar_common.cli import CONFIGS
from mstar_common.config import load_deployment
from mstar_common.engine.types import SamplingParams
from mstar_common.families.orpheus.family import OrpheusFamily
from mstar_common.families.orpheus.tiny import build_orpheus_checkpoint

TEXTS = ["Hello there, how are you?", "a", "The quick brown fox jumps over the lazy dog"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    checkpoint = build_orpheus_checkpoint(tmp_path_factory.mktemp("orpheus") / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    return OrpheusFamily().build_component("lm", dep, checkpoint, "cpu"), checkpoint


def _prompts(rt) -> dict[str, list[int]]:
    return {f"r{i}": rt.layout.prompt_ids(rt.tokenizer, text, "tara") for i, text in enumerate(TEXTS)}


def _assert_equal_to_transformers(got, prompts, rt, checkpoint, penalty: float) -> None:
    """Greedy tokens equal transformers `generate` with the reference's -inf mask on the text rows."""
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    start = rt.layout.custom_start

    def restrict(_ids, scores):
        scores[:, :start] = float("-inf")
        return scores

    for rid, prompt in prompts.items():
        with torch.no_grad():
            want = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                      repetition_penalty=penalty, logits_processor=LogitsProcessorList([restrict]),
                                      eos_token_id=rt.layout.stop_token_ids)
        assert got[rid] == want[0, len(prompt):].tolist(), rid
        assert all(t >= start for t in got[rid])


def _run(engine, requests):
    out = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, lambda r, t, f, e: out[r].extend(t))
    while engine.step():
        pass
    return out


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_audio_tokens_equal_transformers_with_the_restriction(runtime, penalty):
    rt, checkpoint = runtime
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=penalty)
    prompts = _prompts(rt)
    got = _run(rt.engine, {rid: (p, greedy) for rid, p in prompts.items()})  # all three batched together
    _assert_equal_to_transformers(got, prompts, rt, checkpoint, penalty)


def test_head_computes_custom_rows_and_sampling_stays_in_them(runtime):
    rt, _ = runtime
    model, layout = rt.engine.runner.model, rt.layout
    hidden = torch.randn(3, model.lm.model.embed_tokens.weight.shape[1])
    logits = model.compute_logits(hidden)
    assert model.logits_offset == layout.custom_start
    assert logits.shape == (3, layout.vocab_size - layout.custom_start)
    full = model.lm.lm_head(hidden)
    torch.testing.assert_close(logits, full[:, layout.custom_start:])
    prompt = layout.prompt_ids(rt.tokenizer, "hi", "leo")
    params = SamplingParams(max_tokens=30, temperature=1.5, top_p=1.0, seed=7, ignore_eos=True)
    tokens = _run(rt.engine, {"s": (prompt, params)})["s"]
    assert len(tokens) == 30 and min(tokens) >= layout.custom_start


def _inputs(text=None, **values):
    inputs = {} if text is None else {wire.TEXT_INPUT: np.array([text.encode()], dtype=object)}
    for name, value in values.items():
        if name == wire.VOICE:
            inputs[name] = np.array([value.encode()], dtype=object)
        else:
            dtype = wire.SAMPLING_INPUTS[name][1]
            inputs[name] = np.array([value], dtype=dtype)
    return inputs


def test_parse_applies_the_reference_sampling_defaults(runtime):
    rt, _ = runtime
    speech = rt.parse_request(_inputs("Hello", voice="zoe", seed=3))
    assert speech.voice == "zoe" and speech.params.seed == 3
    assert (speech.params.temperature, speech.params.top_p) == pytest.approx((0.6, 0.8))
    assert speech.params.repetition_penalty == pytest.approx(1.3) and speech.params.max_tokens == 1200
    assert speech.prompt_ids[-1] == rt.layout.marker(1)  # start_of_speech


@pytest.mark.parametrize(("inputs", "message"), [
    (_inputs(None), "text_input: required"),
    (_inputs("   "), "text_input: must not be empty"),
    (_inputs("hi", voice="bob"), "voice: unknown voice 'bob'; available voices: ['tara'"),
    (_inputs("word " * 300), "exceeds the limit of 256 tokens"),
    (_inputs("hi", max_tokens=5000), "max_tokens: 5000"),
    (_inputs("hi", temperature=-1.0), "temperature"),
])
def test_bad_requests_are_refused_naming_the_field(runtime, inputs, message):
    rt, _ = runtime
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        rt.parse_request(inputs)


def test_device_penalty_history_with_graphs_and_overlap_equals_transformers(tmp_path):
    """The GPU configuration on the CPU: replayed steps (the FakeGraph stand-in, graph-safe attention), steps
    launched before the previous one is collected, and the repetition penalty read from device-side masks over
    the custom-token window. Greedy tokens with penalty 1.3 must still equal transformers'."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import TorchStaticAttention
    from mstar_common.engine.cuda_graph import GraphConfig

    checkpoint = build_orpheus_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    rt = OrpheusFamily().build_component("lm", dep, checkpoint, "cpu")
    model = rt.engine.runner.model
    model.attn_backend = TorchStaticAttention()
    graphs = GraphConfig(decode_buckets=[1, 2, 4], token_buckets=[64], capture_sampling=False)
    engine = AREngine(model, rt.engine.config, eos_token_ids=rt.layout.stop_token_ids, vocab_size=rt.layout.vocab_size,
                      graphs=graphs, overlap=True, device_penalty=True)
    penalty = engine.runner.penalty
    assert penalty is not None and penalty.width == rt.layout.vocab_size - model.logits_offset
    prompts = _prompts(rt)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, repetition_penalty=1.3)
    got = _run(engine, {rid: (p, params) for rid, p in prompts.items()})
    assert engine.runner.graphs.num_replays > 0
    assert engine.runner.penalty.num_free == rt.engine.config.max_num_seqs  # every slot given back
    _assert_equal_to_transformers(got, prompts, rt, checkpoint, 1.3)


def test_the_mid_gemm_timing_inputs_run_through_the_lm_with_the_device_penalty(tmp_path):
    """MSTAR_MID_GEMM=auto (the default) times each 5-64-row decode bucket at start-up on inputs of its own
    (`CudaGraphRunner._fill_timing`): the Orpheus LM, whose graphs carry the custom-token window and the device-side
    repetition penalty, must take them (the CPU stand-in re-runs the step) and give every row a token."""
    import torch

    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import TorchStaticAttention
    from mstar_common.engine.cuda_graph import DECODE, GREEDY, GraphConfig

    checkpoint = build_orpheus_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    rt = OrpheusFamily().build_component("lm", dep, checkpoint, "cpu")
    model = rt.engine.runner.model
    model.attn_backend = TorchStaticAttention()
    graphs = GraphConfig(decode_buckets=[1, 8], token_buckets=[64], capture_sampling=False)
    engine = AREngine(model, rt.engine.config, eos_token_ids=rt.layout.stop_token_ids, vocab_size=rt.layout.vocab_size,
                      graphs=graphs, overlap=True, device_penalty=True)
    runner = engine.runner.graphs
    key = (DECODE, 8, GREEDY)
    with torch.inference_mode():  # as in `capture`
        context = runner._fill_timing(key)
        runner.graphs[key].replay()
    assert 0 < context <= 512
    assert runner.buffers.out_tokens[:8].min() >= 0


def test_codec_in_process_decodes_like_the_snac_component(tmp_path):
    import dataclasses

    checkpoint = build_orpheus_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    assert OrpheusFamily().build_component("lm", dep, checkpoint, "cpu").local_codec is None  # the BLS hop by default
    dep = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "codec_in_process": True})
    OrpheusFamily().validate_deployment(dep, "test")
    rt = OrpheusFamily().build_component("lm", dep, checkpoint, "cpu")
    component = OrpheusFamily().build_component("snac", dep, checkpoint, "cpu")
    windows = np.random.default_rng(0).integers(0, 4096, size=(3, 4, 7)).astype(np.int32)
    np.testing.assert_array_equal(rt.local_codec.decode(windows), component.decode(windows))
    bad = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "codec_in_process": "yes"})
    with pytest.raises(Exception, match="codec_in_process: must be true or false"):
        OrpheusFamily().validate_deployment(bad, "test")


def test_an_in_process_codec_is_loaded_before_the_engine_sizes_its_kv_pool(tmp_path, monkeypatch):
    """The engine sized its pool (`auto`: from what the process held then; a fixed count: checked against the
    memory left) before the codec's weights and graphs were loaded into the same process, so they were never
    counted."""
    import dataclasses

    from mstar_common.engine import ar_engine
    from mstar_common.families.orpheus import family as orpheus_family

    order = []
    build_snac, engine_init = orpheus_family._build_snac, ar_engine.AREngine.__init__
    monkeypatch.setattr(orpheus_family, "_build_snac", lambda *a: order.append("codec") or build_snac(*a))
    monkeypatch.setattr(ar_engine.AREngine, "__init__",
                        lambda self, *a, **k: order.append("engine (its KV pool)") or engine_init(self, *a, **k))
    checkpoint = build_orpheus_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    dep = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "codec_in_process": True})
    runtime = OrpheusFamily().build_component("lm", dep, checkpoint, "cpu")
    assert order == ["codec", "engine (its KV pool)"] and runtime.local_codec is not None


def test_first_chunk_frames_reaches_the_runtime_and_is_validated(tmp_path):
    import dataclasses

    checkpoint = build_orpheus_checkpoint(tmp_path / "tiny")
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    assert OrpheusFamily().build_component("lm", dep, checkpoint, "cpu").first_chunk_frames == 3
    dep = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "first_chunk_frames": 1})
    OrpheusFamily().validate_deployment(dep, "test")
    assert OrpheusFamily().build_component("lm", dep, checkpoint, "cpu").first_chunk_frames == 1
    dep = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "first_chunk_frames": "auto"})
    OrpheusFamily().validate_deployment(dep, "test")
    assert OrpheusFamily().build_component("lm", dep, checkpoint, "cpu").first_chunk_frames is None
    for value in (0, 1.5, True, "fast", None):
        bad = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "first_chunk_frames": value})
        with pytest.raises(Exception, match="first_chunk_frames: must be an integer >= 1 or 'auto'"):
            OrpheusFamily().validate_deployment(bad, "test")


def test_a_text_too_long_for_the_input_cap_is_refused_before_tokenizing(runtime, monkeypatch):
    rt, _ = runtime

    def not_called(*args, **kwargs):
        raise AssertionError("tokenized a text that cannot fit")

    monkeypatch.setattr(rt.tokenizer, "encode", not_called)
    with pytest.raises(ValueError, match=r"^text_input: 4000000 bytes cannot fit 256 tokens \(at most \d+ bytes\)"):
        rt.parse_request(_inputs("a" * 4_000_000))


def test_an_lm_config_the_llama_loader_does_not_build_is_refused_before_anything_starts(runtime, tmp_path):
    """Orpheus's LM is a Llama: a config.json the Llama loader refuses (here another model_type) passed `mstar
    check` and failed as the LM loaded inside tritonserver."""
    import json
    import shutil

    from mstar_common.config import DeploymentError

    _, checkpoint = runtime
    copy = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    OrpheusFamily().check_checkpoint(dep, copy, "t.yaml")
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "qwen3_moe"  # the Llama loader builds model_type llama alone
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(DeploymentError, match=r"^t.yaml: checkpoint .*: config.json: .*qwen3_moe"):
        OrpheusFamily().check_checkpoint(dep, copy, "t.yaml")


def test_an_lm_checkpoint_without_its_tokenizer_or_a_shard_is_refused_before_anything_starts(runtime, tmp_path):
    """The LM loads through the Llama loader: a folder missing its tokenizer, or a shard its index names, passed
    `mstar check` and failed as the component loaded inside tritonserver."""
    import json
    import shutil

    from mstar_common.config import DeploymentError

    _, checkpoint = runtime
    dep = load_deployment(CONFIGS / "orpheus.yaml")
    no_tokenizer = Path(shutil.copytree(checkpoint, tmp_path / "no_tokenizer"))
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(DeploymentError, match=r"^t.yaml: checkpoint .*: no tokenizer \(tokenizer.json, "):
        OrpheusFamily().check_checkpoint(dep, no_tokenizer, "t.yaml")
    sharded = Path(shutil.copytree(checkpoint, tmp_path / "sharded"))
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                            "model.norm.weight": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DeploymentError, match=r"names shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        OrpheusFamily().check_checkpoint(dep, sharded, "t.yaml")


def test_a_prompt_that_leaves_no_room_names_the_text_and_a_default_cap_is_fitted_to_the_room(runtime, monkeypatch):
    """A text whose prompt fills max_model_len is refused naming the text, not a max_tokens the client never sent
    (that was `max_tokens: must be in [1, ...], got -6`); a prompt that leaves less room than `default_max_tokens`
    gets that room (ENGINE.md: fitted to the room its prompt leaves)."""
    rt, _ = runtime
    prompt = len(rt.layout.prompt_ids(rt.tokenizer, "Hello there", rt.default_voice))
    monkeypatch.setattr(rt.engine, "max_model_len", prompt)
    with pytest.raises(ValueError, match=rf"^text_input: its {prompt}-token prompt .* leaves no room for audio"):
        rt.parse_request(_inputs("Hello there"))
    monkeypatch.setattr(rt.engine, "max_model_len", prompt + 5)
    assert rt.parse_request(_inputs("Hello there")).params.max_tokens == 5 < rt.default_max_tokens


def test_a_max_input_tokens_that_leaves_no_room_for_a_frame_is_refused_at_startup():
    """A text at the input cap must leave room for one 7-token SNAC frame within max_model_len; a cap of 5000 under
    max_model_len 1536 was accepted and every long text then failed at request time."""
    import dataclasses

    dep = load_deployment(CONFIGS / "orpheus.yaml")
    OrpheusFamily().validate_deployment(dep, "test")
    # 1523 + 7 = 1530 fitted the old rule, but the prompt's 6 framing ids and the voice's prefix come on top
    for kwargs in ({"max_input_tokens": 5000}, {"max_input_tokens": 1530}, {"max_input_tokens": 1523}):
        bad = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, **kwargs})
        with pytest.raises(Exception, match=r"max_input_tokens: \d+ text tokens, the prompt's 6 framing ids and "
                                            r"voice prefix, and one 7-token audio frame need at least \d+ tokens, "
                                            r"more than resources.max_model_len=1536"):
            OrpheusFamily().validate_deployment(bad, "test")
    fits = dataclasses.replace(dep, model_kwargs={**dep.model_kwargs, "max_input_tokens": 1522})
    OrpheusFamily().validate_deployment(fits, "test")
    unset = {k: v for k, v in dep.model_kwargs.items() if k != "max_input_tokens"}  # the default, 1024, fits 1536
    OrpheusFamily().validate_deployment(dataclasses.replace(dep, model_kwargs=unset), "test")
