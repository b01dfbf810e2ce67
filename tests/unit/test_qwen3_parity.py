"""Qwen3 parity with transformers on the tiny checkpoint: prefill, packed rows, paged decode, loader coverage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar_common.engine.attention import build_attention_metadata
from mstar_common.engine.kv_cache import KVCache, PageAllocator, PageTable
from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
from mstar_common.families.qwen3.tiny import build_tiny_checkpoint
from mstar_common.layers.rotary import rope_theta_from_config

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.getbasetemp() / "qwen3_tiny")


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_qwen3(checkpoint, dtype="float32", device="cpu")[0]


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]


class PagedRunner:
    """Drives the model directly over a paged pool: each call computes the next chunk of each sequence."""

    def __init__(self, model, page_size: int = 4, num_pages: int = 64) -> None:
        self.model, self.page_size = model, page_size
        self.cache = KVCache(model.kv_spec, num_pages, page_size, torch.float32, "cpu")
        self.allocator = PageAllocator(num_pages, page_size)

    def new_table(self, max_tokens: int) -> PageTable:
        table = PageTable()
        self.allocator.allocate(table, self.allocator.pages_for(max_tokens))
        return table

    @torch.no_grad()
    def forward(self, chunks: list[tuple[PageTable, list[int], int]]) -> torch.Tensor:
        """chunks: (table, new token ids, tokens already cached) per row -> logits of every packed token."""
        ids, positions = [], []
        for table, new_ids, start in chunks:
            self.allocator.grow(table, start + len(new_ids))
            ids += new_ids
            positions += range(start, start + len(new_ids))
        metadata = build_attention_metadata(
            [len(n) for _, n, _ in chunks], [s + len(n) for _, n, s in chunks], [t.pages for t, _, _ in chunks],
            page_size=self.page_size, sink_page=self.cache.sink_page, device="cpu",
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), metadata, self.cache)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("length", [1, 7, 64])
def test_prefill_logits_match_transformers(model, hf_model, length):
    ids = _prompt(length, seed=length)
    runner = PagedRunner(model)
    logits = runner.forward([(runner.new_table(length), ids, 0)])
    torch.testing.assert_close(logits, _hf_logits(hf_model, ids), atol=ATOL, rtol=0)


def test_packed_rows_match_separate_forwards(model, hf_model):
    prompts = [_prompt(n, seed=n) for n in (5, 1, 23)]
    runner = PagedRunner(model)
    logits = runner.forward([(runner.new_table(len(p)), p, 0) for p in prompts])
    expected = torch.cat([_hf_logits(hf_model, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_full_forward(model, hf_model):
    """Prefill in uneven chunks, then feed tokens one at a time through the paged KV (page size 3)."""
    ids = _prompt(40, seed=3)
    full = _hf_logits(hf_model, ids)
    runner = PagedRunner(model, page_size=3)
    table = runner.new_table(len(ids))
    pieces, start = [], 0
    for size in (5, 11, 2):  # chunked prefill of the first 18 tokens
        pieces.append(runner.forward([(table, ids[start: start + size], start)]))
        start += size
    for position in range(start, len(ids)):  # decode
        pieces.append(runner.forward([(table, [ids[position]], position)]))
    torch.testing.assert_close(torch.cat(pieces), full, atol=ATOL, rtol=0)


def test_untied_checkpoint_loads_and_matches(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "untied", seed=1, tie_word_embeddings=False)
    model, config = load_qwen3(path)
    assert config["tie_word_embeddings"] is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _prompt(12, seed=5)
    runner = PagedRunner(model)
    torch.testing.assert_close(runner.forward([(runner.new_table(12), ids, 0)]), _hf_logits(hf, ids), atol=ATOL,
                               rtol=0)


def test_tied_checkpoint_shares_the_embedding(model, checkpoint):
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert read_eos_token_ids(checkpoint) == [2, 0]


def test_sharded_checkpoint_loads(hf_model, checkpoint, model, tmp_path):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    loaded, _ = load_qwen3(sharded)
    for name, param in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], param, atol=0, rtol=0)


def _copy_checkpoint(checkpoint: Path, dst: Path, edit) -> Path:
    shutil.copytree(checkpoint, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_loader_refuses_a_missing_tensor(checkpoint, tmp_path):
    name = "model.layers.1.self_attn.k_norm.weight"
    path = _copy_checkpoint(checkpoint, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing parameters {name}; unused checkpoint tensors none"):
        load_qwen3(path)


def test_loader_refuses_an_extra_tensor(checkpoint, tmp_path):
    path = _copy_checkpoint(checkpoint, tmp_path / "extra",
                            lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    expected = r"missing parameters none; unused checkpoint tensors model.layers.0.mlp.extra"
    with pytest.raises(ValueError, match=expected):
        load_qwen3(path)


def test_loader_refuses_a_tied_head_that_differs(checkpoint, tmp_path):
    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0

    path = _copy_checkpoint(checkpoint, tmp_path / "tied_differs", add_head)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_qwen3(path)


def test_loader_refuses_a_wrong_shape(checkpoint, tmp_path):
    name = "model.norm.weight"
    path = _copy_checkpoint(checkpoint, tmp_path / "shape", lambda t: t.update({name: torch.ones(3)}))
    with pytest.raises(ValueError, match=rf"{name} has shape \(3,\)"):
        load_qwen3(path)


def test_loader_refuses_a_rope_that_scales_with_the_length(checkpoint, tmp_path):
    path = tmp_path / "dynamic"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_parameters.rope_type='dynamic' is not supported"):
        load_qwen3(path)


@pytest.mark.parametrize("section", [
    {"factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's model cards
    {"factor": 4.0},  # original from max_position_embeddings
    {"factor": 8.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"factor": 2.0, "original_max_position_embeddings": 8192, "attention_factor": 1.25, "beta_fast": 8,
     "beta_slow": 2, "truncate": False},
    {"factor": 1.0, "original_max_position_embeddings": 8192},  # no scaling: an attention factor of 1
    {"factor": None, "original_max_position_embeddings": 10240},  # the ratio of the two lengths, as transformers
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(section):
    """The NTK-by-parts frequencies bit for bit, and the factor transformers multiplies cos and sin by."""
    from mstar_common.layers.rotary import RotaryEmbedding, attention_factor, rope_from_config

    config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **section}}
    theta, scaling = rope_from_config(config)
    theirs = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(transformers.Qwen3Config.from_dict(config))
    assert torch.equal(RotaryEmbedding(128, theta, scaling).inv_freq(torch.device("cpu")), theirs.inv_freq)
    assert attention_factor(scaling) == pytest.approx(theirs.attention_scaling, rel=1e-12)


def test_yarn_serves_the_context_it_scales_to():
    """Qwen3's configs keep max_position_embeddings 40,960 and scale 32,768 by 4: 131,072 positions, as vLLM
    derives them; the other RoPEs keep max_position_embeddings."""
    from mstar_common.layers.rotary import position_limit

    yarn = {"max_position_embeddings": 40960, "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert position_limit(yarn) == 131072
    assert position_limit({**yarn, "rope_scaling": None}) == 40960
    assert position_limit({"max_position_embeddings": 8192, "rope_theta": 1e4,
                           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == 8192


def test_rope_config_forms():
    assert rope_theta_from_config({"rope_theta": 10000.0, "rope_scaling": None}) == 10000.0
    assert rope_theta_from_config({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}) == 5.0
    with pytest.raises(ValueError, match="rope_scaling.rope_type='llama3'"):
        rope_theta_from_config({"rope_theta": 1.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.parametrize("rope", [
    {},  # Llama 2's configs name no base: transformers takes 10,000 (it was refused)
    {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default", "rope_theta": 500000.0}},  # the section's base
    {"rope_theta": 500000.0, "partial_rotary_factor": None},  # null: full width (it was refused)
    {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1,
                                              "high_freq_factor": 4, "original_max_position_embeddings": 8192},
     "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},  # both, agreeing
])
def test_rope_frequencies_equal_transformers_for_the_configs_it_reads(rope):
    from mstar_common.layers.rotary import RotaryEmbedding, rope_from_config

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, **rope}
    theta, scaling = rope_from_config(config)
    ours = RotaryEmbedding(64, theta, scaling)
    positions = torch.tensor([0, 1, 8191, 8192, 8193, 20000, 131071])
    cos, sin = ours(positions, torch.float32)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(config))
    their_cos, their_sin = theirs(torch.zeros(1, 7, 64), positions[None])
    assert torch.equal(cos, their_cos[0]) and torch.equal(sin, their_sin[0])


def test_rope_sections_that_disagree_are_refused_not_one_silently_picked():
    """transformers reads rope_scaling over rope_parameters; this reader took rope_parameters: other frequencies."""
    from mstar_common.layers.rotary import rope_from_config

    with pytest.raises(ValueError, match=r"rope_scaling and rope_parameters disagree on \['factor', 'rope_type'\]"):
        rope_from_config({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                          "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}})


def test_bfloat16_forward_tracks_float32(checkpoint, model):
    bf16, _ = load_qwen3(checkpoint, dtype="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _prompt(16, seed=9)
    runner32, runner16 = PagedRunner(model), PagedRunner(bf16)
    runner16.cache = KVCache(bf16.kv_spec, 64, 4, torch.bfloat16, "cpu")
    logits32 = runner32.forward([(runner32.new_table(16), ids, 0)])
    logits16 = runner16.forward([(runner16.new_table(16), ids, 0)]).float()
    assert torch.nn.functional.cosine_similarity(logits16, logits32, dim=-1).min() > 0.99


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_match_transformers_at_that_precision(checkpoint, hf_model, dtype):
    """The GPU deployments serve bf16 (fp16 is accepted): over a 320-token prompt our logits stay as close to
    transformers' at the same dtype as transformers' own are to its fp32 ones. RoPE angles taken in bf16 (exact only
    for small positions) are 4.4 off here; the cosine test above cannot see them on its 16 tokens."""
    torch_dtype = getattr(torch, dtype)
    ours, _ = load_qwen3(checkpoint, dtype=dtype)
    ids = _prompt(320, seed=3)
    runner = PagedRunner(ours, page_size=16, num_pages=32)
    runner.cache = KVCache(ours.kv_spec, 32, 16, torch_dtype, "cpu")
    logits = runner.forward([(runner.new_table(len(ids)), ids, 0)]).float()
    theirs = _hf_logits(transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype).eval(),
                        ids).float()
    rounding = (theirs - _hf_logits(hf_model, ids)).abs().max()  # the dtype's own error, in transformers
    assert (logits - theirs).abs().max() <= rounding
    assert (logits.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.95


def test_norm_gemv_switch(checkpoint, monkeypatch):
    """`MSTAR_NORM_GEMV` (auto by default, or 1) marks each decoder layer's (norm, qkv) and (norm, gate_up) pairs as
    candidates for one launch (the GEMV tuning then times them so); 0 and fused ops off leave them apart; a bad
    value is refused, naming the switch."""
    model, _ = load_qwen3(checkpoint, dtype="float32", device="cpu")
    layer = model.model.layers[0]
    pairs = [(layer.input_layernorm, layer.self_attn.qkv_proj),
             (layer.post_attention_layernorm, layer.mlp.gate_up_proj)]
    for value in ("", "auto", "1"):
        monkeypatch.setenv("MSTAR_NORM_GEMV", value)
        model.enable_fused_ops(True)
        assert layer.norm_gemv_pairs() == pairs
    monkeypatch.setenv("MSTAR_NORM_GEMV", "0")
    model.enable_fused_ops(True)
    assert all(layer.norm_gemv_pairs() == [] for layer in model.model.layers)
    monkeypatch.delenv("MSTAR_NORM_GEMV")
    model.enable_fused_ops(False)
    assert layer.norm_gemv_pairs() == []
    monkeypatch.setenv("MSTAR_NORM_GEMV", "yes")
    with pytest.raises(ValueError, match="MSTAR_NORM_GEMV='yes': expected one of auto, 1, 0"):
        model.enable_fused_ops(True)


def test_fused_mlp_switch(checkpoint, monkeypatch):
    """`MSTAR_FUSED_MLP_ROWS=N` gives every decoder layer the persistent MLP kernel for steps of <= N rows; 0 by
    default and with fused ops off; off CUDA the layer keeps the eager ops (the same logits); a bad value is
    refused with its name."""
    model, _ = load_qwen3(checkpoint, dtype="float32", device="cpu")
    model.enable_fused_ops(True)
    assert all(layer.fused_mlp_rows == 0 for layer in model.model.layers)
    monkeypatch.setenv("MSTAR_FUSED_MLP_ROWS", "2")
    model.enable_fused_ops(True)
    assert all(layer.fused_mlp_rows == 2 for layer in model.model.layers)
    layer = model.model.layers[0]
    width = layer.mlp.down_proj.out_features
    hidden, residual = torch.randn(1, width), torch.randn(1, width)
    assert layer._fused_mlp(hidden, residual) is None  # a CPU tensor: the eager ops
    model.enable_fused_ops(False)
    assert layer.fused_mlp_rows == 0
    monkeypatch.setenv("MSTAR_FUSED_MLP_OPTIONS", "num_warps=16,tile=8192")
    model.enable_fused_ops(True)
    assert layer.fused_mlp_options == {"num_warps": 16, "tile": 8192}
    for bad in ("warps=16", "num_warps=0", "tile=big"):
        monkeypatch.setenv("MSTAR_FUSED_MLP_OPTIONS", bad)
        with pytest.raises(ValueError, match="MSTAR_FUSED_MLP_OPTIONS"):
            model.enable_fused_ops(True)
    monkeypatch.delenv("MSTAR_FUSED_MLP_OPTIONS")
    for bad in ("9", "one"):
        monkeypatch.setenv("MSTAR_FUSED_MLP_ROWS", bad)
        with pytest.raises(ValueError, match="MSTAR_FUSED_MLP_ROWS"):
            model.enable_fused_ops(True)


@pytest.mark.parametrize("section, rule", [
    ({"factor": 0.5}, r"rope_parameters.factor must be a number >= 1 for rope_type 'yarn', got 0.5"),
    ({"factor": "4"}, r"rope_parameters.factor must be a number >= 1"),
    ({"factor": 4.0, "original_max_position_embeddings": 0},
     r"rope_parameters.original_max_position_embeddings must be a number > 0 \(the context rope_type 'yarn' scales\), "
     r"got 0"),
    ({"factor": 4.0, "mscale": "1", "mscale_all_dim": 1.0}, r"rope_parameters.mscale must be a number, got '1'"),
    ({"factor": 4.0, "beta_fast": -2}, r"rope_parameters.beta_fast must be a number > 0, got -2"),
    ({"factor": 4.0, "attention_factor": "big"}, r"rope_parameters.attention_factor must be a number > 0"),
    ({"factor": 4.0, "attention_factor": 0}, r"rope_parameters.attention_factor must be a number > 0"),
])
def test_a_yarn_section_that_cannot_be_served_is_refused_naming_the_key(section, rule):
    from mstar_common.layers.rotary import rope_from_config

    with pytest.raises(ValueError, match=rule):
        rope_from_config({"max_position_embeddings": 4096,
                          "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **section}})


@pytest.mark.parametrize("section, rule", [
    # a factor of 0 gave infinite frequencies: NaN attention on every request, accepted at load
    ({"rope_type": "linear", "factor": 0}, r"rope_scaling.factor must be a number >= 1, got 0"),
    ({"rope_type": "linear", "factor": None}, r"rope_scaling.factor must be a number >= 1, got None"),
    ({"rope_type": "llama3", "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4},
     r"rope_scaling.factor must be a number >= 1, got 0"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": None, "high_freq_factor": 4},
     r"rope_scaling.low_freq_factor must be a number > 0, got None"),  # was float()'s own TypeError
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 4},  # a zero-width band: 0/0
     r"rope_scaling.high_freq_factor must be a number > low_freq_factor \(4\), got 4"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": True},
     r"rope_scaling.high_freq_factor must be a number > low_freq_factor \(1\), got True"),
])
def test_a_linear_or_llama3_section_that_cannot_be_served_is_refused_naming_the_key(section, rule):
    from mstar_common.layers.rotary import rope_from_config

    with pytest.raises(ValueError, match=rule):
        rope_from_config({"max_position_embeddings": 8192, "rope_theta": 5e5, "rope_scaling": section})


@pytest.mark.parametrize("top_level, section", [
    (2048, {"original_max_position_embeddings": 1024}),  # transformers takes the top level's (it read the section's)
    (None, {}),  # neither: max_position_embeddings, as transformers (it was refused)
])
def test_llama3_original_context_is_read_where_transformers_reads_it(top_level, section):
    from mstar_common.layers.rotary import RotaryEmbedding, rope_from_config

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               **section}}
    if top_level is not None:
        config["original_max_position_embeddings"] = top_level
    theta, scaling = rope_from_config(config)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(config))
    assert torch.equal(RotaryEmbedding(64, theta, scaling).inv_freq(torch.device("cpu")), theirs.inv_freq)


@pytest.mark.parametrize("rope", [{"rope_theta": 1e6}, {"rope_theta": 5e5, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}}])
def test_a_config_without_max_position_embeddings_is_refused_at_read(rope):
    """It was a KeyError (unscaled) or None reaching the engine's max_model_len check as a TypeError (llama3)."""
    from mstar_common.layers.causal_lm import DenseLMConfig

    config = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, **rope}
    with pytest.raises(ValueError, match=r"^max_position_embeddings: missing"):
        DenseLMConfig.read_hf(config, qk_norm=False, scaled_rope=True)
    for bad in ("abc", 0, True, 4096.5):  # "abc" was int()'s own message under YaRN, naming no key
        with pytest.raises(ValueError, match=rf"^max_position_embeddings must be an integer >= 1 .*got {bad!r}"):
            DenseLMConfig.read_hf({**config, "max_position_embeddings": bad}, qk_norm=False, scaled_rope=True)
    assert DenseLMConfig.read_hf({**config, "max_position_embeddings": 4096}, qk_norm=False,
                                 scaled_rope=True).max_position_embeddings == 4096


def test_a_yarn_context_taken_from_max_position_embeddings_is_named_as_that_key():
    """It was named rope_scaling.original_max_position_embeddings, a key the config never had."""
    from mstar_common.layers.rotary import rope_from_config

    for bad in (0, "abc"):
        with pytest.raises(ValueError, match=rf"^max_position_embeddings must be a number > 0 .*got {bad!r}"):
            rope_from_config({"max_position_embeddings": bad, "rope_theta": 1e6,
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"^rope_scaling.original_max_position_embeddings must be .*got None"):
        rope_from_config({"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match=r"^original_max_position_embeddings must be .*got -1"):  # the top level's
        rope_from_config({"max_position_embeddings": 4096, "original_max_position_embeddings": -1, "rope_theta": 1e6,
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_a_yarn_section_stands_in_for_a_missing_max_position_embeddings():
    from mstar_common.layers.causal_lm import DenseLMConfig

    config = {"vocab_size": 64, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
              "num_attention_heads": 4, "rope_theta": 1e6, "rope_scaling": {
                  "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert DenseLMConfig.read_hf(config, qk_norm=True, scaled_rope=True).max_position_embeddings == 131072


@pytest.mark.parametrize("where, theta, shown", [
    ("top", 0, r"^rope_theta must be a number > 0, got 0"),  # a base of 0: infinite frequencies, NaN attention
    ("top", True, r"^rope_theta must be a number > 0, got True"),  # was read as 1.0
    ("top", "abc", r"^rope_theta must be a number > 0, got 'abc'"),  # was float()'s own message, naming no key
    ("section", -1.0, r"^rope_parameters.rope_theta must be a number > 0, got -1.0"),
])
def test_a_rope_base_that_is_no_positive_number_is_refused_naming_it(where, theta, shown):
    from mstar_common.layers.rotary import rope_from_config, rope_theta_from_config

    config = ({"max_position_embeddings": 4096, "rope_theta": theta} if where == "top" else
              {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": theta}})
    for read in (rope_from_config, rope_theta_from_config):
        with pytest.raises(ValueError, match=shown):
            read(config)


def test_generation_stops_at_the_tokenizers_eos_beside_the_checkpoints(checkpoint, tmp_path):
    """As vLLM: a generation_config.json naming only another id (an older Llama-3 fine-tune's <|end_of_text|>, its
    turns ending in <|eot_id|>) ran past the turn's end to max_tokens."""
    from transformers import AutoTokenizer

    from mstar_common.families.qwen3.family import _eos_ids

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    assert _eos_ids(checkpoint, config, tokenizer) == [2, 0]  # the tokenizer's 2 listed already: no repeat
    path = tmp_path / "other_eos"
    shutil.copytree(checkpoint, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert _eos_ids(path, config, tokenizer) == [0, 2]
    (path / "generation_config.json").unlink()
    assert _eos_ids(path, {**config, "eos_token_id": None}, tokenizer) == [2]
