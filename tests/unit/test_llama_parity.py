"""Llama parity with transformers on tiny random checkpoints (plain and Llama-3 RoPE): logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.types import EngineConfig, SamplingParams
from mstar_common.families.llama.loader import load_llama
from mstar_common.families.llama.tiny import build_tiny_llama
from tests.unit.test_qwen3_parity import PagedRunner

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[True, False], ids=["llama3-rope", "plain-rope"])
def checkpoint(request, tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.getbasetemp() / f"llama_tiny_{request.param}", llama3_rope=request.param)


def test_logits_match_transformers_over_a_long_prompt_and_decode(checkpoint):
    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model, _ = load_llama(checkpoint)
    ids = torch.randint(3, 400, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    runner = PagedRunner(model)
    table = runner.new_table(200)
    got = torch.cat([runner.forward([(table, ids[:100], 0)]), runner.forward([(table, ids[100:149], 100)]),
                     runner.forward([(table, ids[149:], 149)])])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_match_generate(checkpoint):
    hf = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model, config = load_llama(checkpoint)
    prompts = [[5, 9, 100], list(range(20, 90))]
    engine = AREngine(model, EngineConfig(num_kv_pages=64, page_size=8, max_num_seqs=4, max_batch_tokens=64),
                      eos_token_ids=[], vocab_size=config["vocab_size"])
    got: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           lambda rid, toks, fin, err: got.setdefault(rid, []).extend(toks))
    while engine.step():
        pass
    for i, ids in enumerate(prompts):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert got[str(i)] == out[0, len(ids):].tolist()
