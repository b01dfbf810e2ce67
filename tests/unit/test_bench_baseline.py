"""The HF `generate` baseline of `mstar bench`: fastest-of-N timing and the ratio lines built on it (CPU)."""

from __future__ import annotations

import pytest
import torch

from mstar_common.bench.baseline import hf_generate
from mstar_common.bench.report import comparisons
from mstar_common.families.qwen3.tiny import build_tiny_checkpoint


def test_hf_baseline_takes_the_fastest_of_its_runs(tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path / "qwen3_tiny")
    rows = hf_generate(checkpoint, prompt_len=12, output_len=16, batch_sizes=[1, 3], device="cpu", repeats=3,
                       dtype=torch.float32)
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        assert len(row["runs_tok_per_s"]) == 3
        assert row["output_tok_per_s"] == pytest.approx(max(row["runs_tok_per_s"]))
        assert row["output_tok_per_s"] == pytest.approx(row["batch"] * 16 / row["wall_s"])
    with pytest.raises(ValueError, match="repeats"):
        hf_generate(checkpoint, 12, 16, [1], device="cpu", repeats=0)


def test_ratio_line_is_against_the_fastest_hf_run():
    summary = {"output_tok_per_s": 1000.0, "itl_ms": {"p50": 1.0}}
    model = {"runs": [{"target": "triton", "concurrency": 1, "summary": summary}],
             "hf_generate": [{"batch": 1, "output_tok_per_s": 40.0, "runs_tok_per_s": [25.0, 40.0, 31.0]}]}
    line = next(line for line in comparisons(model) if line.startswith("c=1:"))
    assert "= 25.0x" in line and "fastest of 3 runs: 25, 40, 31" in line


def test_hf_itl_is_the_decode_steps_mean_and_never_negative(tmp_path):
    """Was (fastest run - one 8-token run) / (output_len - 8): a division by zero at 8 tokens, negative below, and
    negative whenever the 8-token run was slower than the fastest whole run."""
    checkpoint = build_tiny_checkpoint(tmp_path / "qwen3_tiny")
    for output_len in (1, 2, 8):
        (row,) = hf_generate(checkpoint, 6, output_len, [1], device="cpu", repeats=2, dtype=torch.float32)
        if output_len == 1:
            assert row["itl_ms"] is None
        else:
            assert 0 <= row["itl_ms"] <= row["wall_s"] * 1e3 / (output_len - 1)


def test_a_level_is_compared_with_hf_only_at_the_lengths_hf_ran():
    """The HF rows always ran --prompt-len/--output-len, and were compared with any served workload (a file's
    prompts, ranged lengths, EOS-stopped requests) as if it were the same work."""
    summary = {"output_tok_per_s": 1000.0, "itl_ms": {"p50": 1.0}}
    hf = [{"batch": 1, "prompt_len": 512, "output_len": 256, "output_tok_per_s": 40.0}]
    fixed = {"prompt_len": 512, "prompt_len_max": None, "output_len": 256, "output_len_max": None, "ignore_eos": True}

    def line(workload):
        model = {"runs": [{"target": "triton", "concurrency": 1, "summary": summary, "workload": workload}],
                 "hf_generate": hf}
        return next(line for line in comparisons(model) if line.startswith("c=1:"))

    assert line(fixed).endswith("= 25.0x")
    assert "not compared" in line({**fixed, "output_len": 128}) and "128-128 out" in line({**fixed, "output_len": 128})
    assert "not compared" in line({**fixed, "prompt_len_max": 1024})
    assert "could stop at an EOS" in line({**fixed, "ignore_eos": False})
    assert "came from f.json" in line({"input_data": "f.json", "prompt_len": [512, 512], "output_len": [256, 256]})
    # a file's workload is compared where every entry is HF's: one length each, ignore_eos true, greedy
    same = {"input_data": "f.json", "prompt_len": [512, 512], "output_len": [256, 256], "ignore_eos": [True],
            "temperature": [0.0]}
    assert line(same).endswith("= 25.0x")
    assert "came from f.json (500-512 tokens" in line({**same, "prompt_len": [500, 512]})
    assert "not every entry sets ignore_eos" in line({**same, "ignore_eos": [None, True]})
    assert "not every entry sets temperature 0" in line({**same, "temperature": [None]})
    assert "not every entry sets temperature 0" in line({**same, "temperature": [0.0, 0.7]})
    assert "some entries stop at a string or token" in line({**same, "stops": True})
    # a level that resent prompts with the prefix cache on: cached prefills, not HF's whole ones
    model = {"runs": [{"target": "triton", "concurrency": 1, "summary": summary, "workload": same,
                       "repeated_prompts": 3}], "hf_generate": hf}
    (only,) = [line for line in comparisons(model) if line.startswith("c=1:")]
    assert "not compared" in only and "3 of its prompts were sent before" in only
    assert line(None).endswith("= 25.0x")  # a results file from before the lengths were recorded


def test_a_sampled_or_prefix_cached_level_is_not_compared_with_greedy_whole_prompt_hf():
    """HF generate runs greedy and prefills every prompt whole; a sampled level (9-11% slower) or one whose shared
    prefix the server's cache skipped was still given the ratio, as if it were the same work."""
    summary = {"output_tok_per_s": 1000.0, "itl_ms": {"p50": 1.0}}
    hf = [{"batch": 1, "prompt_len": 512, "output_len": 256, "output_tok_per_s": 40.0}]
    fixed = {"prompt_len": 512, "prompt_len_max": None, "output_len": 256, "output_len_max": None, "ignore_eos": True,
             "temperature": 0.0, "top_p": 1.0, "top_k": 0, "shared_prefix_len": 0}

    def line(workload, prefix_caching=False):
        model = {"runs": [{"target": "triton", "concurrency": 1, "summary": summary, "workload": workload}],
                 "hf_generate": hf, "prefix_caching": prefix_caching}
        return next(line for line in comparisons(model) if line.startswith("c=1:"))

    assert line(fixed).endswith("= 25.0x")
    sampled = line({**fixed, "temperature": 0.8})
    assert "not compared" in sampled and "HF ran greedy" in sampled
    cached = line({**fixed, "shared_prefix_len": 448}, prefix_caching=True)
    assert "not compared" in cached and "first 448 tokens" in cached
    assert line({**fixed, "shared_prefix_len": 448}).endswith("= 25.0x")  # no cache: every prompt prefilled whole


def _safetensors(folder, tensors: dict, tied: bool | None):
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    if tied is not None:
        (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    return folder


def test_the_floors_bytes_are_what_a_decode_step_reads(tmp_path):
    """Counted as stored, a tied checkpoint that also stores the head counted the embedding twice (a floor ~26% high
    at Qwen3-0.6B's shape), RoPE's tables counted as weights, and an fp32 file served in bf16 doubled the floor."""
    from mstar_common.bench.baseline import weight_bytes

    embed = torch.zeros(100, 8, dtype=torch.bfloat16)
    layer = {"model.layers.0.mlp.down_proj.weight": torch.zeros(8, 16, dtype=torch.bfloat16),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4, dtype=torch.float32)}
    tied = _safetensors(tmp_path / "tied", {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(),
                                            **layer}, tied=True)
    assert weight_bytes(tied) == (100 * 8 + 8 * 16) * 2
    untied = _safetensors(tmp_path / "untied", {"model.embed_tokens.weight": embed,
                                                "lm_head.weight": torch.zeros(50, 8, dtype=torch.bfloat16), **layer},
                          tied=False)
    assert weight_bytes(untied) == (50 * 8 + 8 * 16) * 2  # the head whole, the embedding a row a token
    fp32 = _safetensors(tmp_path / "fp32", {"model.embed_tokens.weight": embed.float(),
                                            "model.norm.weight": torch.zeros(8, dtype=torch.float32)}, tied=True)
    assert weight_bytes(fp32) == (100 * 8 + 8) * 4
    assert weight_bytes(fp32, "bfloat16") == (100 * 8 + 8) * 2
    ids = _safetensors(tmp_path / "ids", {"model.norm.weight": torch.zeros(8, dtype=torch.bfloat16),
                                          "position_ids": torch.zeros(3, dtype=torch.int64)}, tied=None)
    assert weight_bytes(ids, "float32") == 8 * 4 + 3 * 8  # an integer buffer keeps its size (it raised KeyError)


def test_levels_that_resent_an_input_data_files_prompts_say_so():
    """perf_analyzer files hold 16 prompts; a level past them resends prompts, and with the server's prefix cache
    on their prefills are cache hits: the report says which levels, not full prefills as the figures suggest."""
    from mstar_common.bench.report import repeat_lines

    summary = {"num_requests": 128}
    model = {"runs": [{"target": "triton", "concurrency": 1, "summary": {"num_requests": 12}},
                      {"target": "triton", "concurrency": 64, "summary": summary, "repeated_prompts": 128}]}
    (only,) = repeat_lines(model)
    assert only.startswith("triton c=64: 128 of 128 prompts were sent before") and "cache hits" in only
