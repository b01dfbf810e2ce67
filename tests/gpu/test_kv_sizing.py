"""On the GPU: `num_pages: auto` sizes the pool from the instance's share of the device, the pool serves as a
counted one does, and a count larger than the free memory is refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from mstar_common.engine import kv_sizing
from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.types import EngineConfig, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3
from tests.gpu.test_graphs_exact import _prompts, real_shape  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu

POOL_BYTES = 4 * kv_sizing.GIB


def _engine(model, vocab: int, **config) -> AREngine:
    # the device as the Triton node names it (backends/node_setup.py); its refusals name it so
    base = {"page_size": 16, "max_num_seqs": 4, "max_batch_tokens": 512, "max_model_len": 1024, "dtype": "bfloat16",
            "device": "cuda:0", "prefix_caching": True}
    return AREngine(model, EngineConfig(**{**base, **config}), eos_token_ids=[], vocab_size=vocab)


def _greedy(engine: AREngine, prompts) -> list[list[int]]:
    got: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                           lambda rid, toks, fin, err: got.setdefault(rid, []).extend(toks))
    while engine.step():
        pass
    return [got[str(i)] for i in range(len(prompts))]


def test_an_auto_pool_takes_its_share_less_what_the_instance_holds_and_serves_as_a_counted_one(real_shape):  # noqa: F811
    model, config = load_qwen3(real_shape, dtype="bfloat16", device="cuda")
    vocab = config["vocab_size"]
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()
    reserve = kv_sizing.step_reserve_bytes(model, 512, 4, vocab, torch.bfloat16)
    share = (held + reserve + POOL_BYTES) / total  # leaves the pool ~4 GiB
    per_page = kv_sizing.bytes_per_page(model.kv_spec, 16, torch.bfloat16)
    expected = int((min(share * total - held, free) - reserve) // per_page) - 1
    assert abs(expected - (POOL_BYTES // per_page - 1)) <= 1
    engine = _engine(model, vocab, num_kv_pages="auto", gpu_memory_share=share)
    assert engine.config.num_kv_pages == engine.kv_cache.num_pages == expected
    assert torch.cuda.memory_reserved() <= share * total  # the pool and the weights, within the share
    prompts = _prompts(4, 200, seed=5)
    tokens = _greedy(engine, prompts)
    del engine
    torch.cuda.empty_cache()
    assert tokens == _greedy(_engine(model, vocab, num_kv_pages=512), prompts)


def test_a_count_larger_than_the_free_memory_is_refused_before_the_pool_is_allocated(real_shape):  # noqa: F811
    model, config = load_qwen3(real_shape, dtype="bfloat16", device="cuda")
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    before = torch.cuda.memory_reserved()
    per_page = kv_sizing.bytes_per_page(model.kv_spec, 16, torch.bfloat16)
    too_many = int(free // per_page) + 1
    with pytest.raises(ValueError, match=rf"resources.kv_cache.num_pages: {too_many} pages of 16 tokens need .* "
                                         r"GiB on cuda:0, .* pages fit .* set it to auto"):
        _engine(model, config["vocab_size"], num_kv_pages=too_many)
    assert torch.cuda.memory_reserved() == before
