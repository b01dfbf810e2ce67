"""The KV pool's size: `num_pages: auto` from an instance's share of its GPU, and explicit counts checked against
the GPU's free memory (engine/kv_sizing.py). The GPU's memory is given, so these run on the CPU; the GPU test
(tests/gpu/test_kv_sizing.py) sizes a real pool on a real device."""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_common.engine import kv_sizing
from mstar_common.engine.kv_cache import KVCache, KVSpec, pages_for
from mstar_common.engine.kv_sizing import GIB, GpuMemory, bytes_per_page, pool_pages, step_reserve_bytes

SPEC = KVSpec(num_layers=28, num_kv_heads=8, head_dim=128)  # Qwen3-0.6B
PAGE = 16
PER_PAGE = 28 * 2 * PAGE * 8 * 128 * 2  # bf16: 1.75 MiB a page
CUDA = torch.device("cuda", 0)  # only named: the memory below is given, no GPU is touched


def _pages(requested="auto", *, free=135 * GIB, total=140 * GIB, held=2 * GIB, reserve=GIB, share=0.9,
           seqs=32, model_len=4096, prefixes=True, device=CUDA):
    return pool_pages(requested, spec=SPEC, page_size=PAGE, kv_dtype=torch.bfloat16, reserve=reserve,
                      max_num_seqs=seqs, max_model_len=model_len, caches_prefixes=prefixes, share=share,
                      device=device, memory=lambda _device: GpuMemory(free, total, held))


def test_a_page_holds_k_and_v_of_every_layer_as_the_pool_allocates_them():
    assert bytes_per_page(SPEC, PAGE, torch.bfloat16) == PER_PAGE
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8)
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        pool = KVCache(spec, 5, 4, dtype, "cpu")._pool
        assert pool.numel() * pool.element_size() == 6 * bytes_per_page(spec, 4, dtype)  # 5 pages and the sink


def test_auto_takes_the_instance_share_less_what_it_holds_and_the_steps_reserve():
    # 0.9 x 140 = 126 GiB, less 2 held and 1 reserved: 123 GiB, one page of it the sink.
    assert _pages() == int(123 * GIB // PER_PAGE) - 1
    # Two instances on one GPU, 0.45 each: 63 - 2 - 1 = 60 GiB.
    assert _pages(share=0.45) == int(60 * GIB // PER_PAGE) - 1


def test_auto_takes_no_more_than_is_free_on_the_gpu():
    # Another process holds most of the GPU: 20 GiB free, less the 1 GiB reserve.
    assert _pages(free=20 * GIB) == int(19 * GIB // PER_PAGE) - 1


def test_auto_without_a_prefix_cache_stops_at_every_request_at_full_length():
    needed = 32 * pages_for(4096, PAGE)
    assert _pages(prefixes=False) == needed
    assert _pages(prefixes=True) > needed


def test_auto_too_small_for_the_cap_refuses_to_start_naming_the_key_and_the_numbers():
    with pytest.raises(ValueError) as info:
        _pages(free=3 * GIB, seqs=256, model_len=4096)
    message = str(info.value)
    for fragment in ("resources.kv_cache.num_pages: auto leaves 1169 pages", "max_concurrent_requests=256",
                     "need >= 65536", "3.00 GiB is free", "holds 2.00 GiB", "gpu_memory_fraction"):
        assert fragment in message, message
    with pytest.raises(ValueError, match="auto leaves 0 pages"):
        _pages(free=GIB // 2)  # less than the reserve itself


def test_auto_needs_a_gpu_and_a_share_in_range():
    with pytest.raises(ValueError, match="'auto' sizes the pool from GPU memory; on cpu give a number of pages"):
        _pages(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="gpu_memory_share must be in"):
        _pages(share=1.5)


def test_an_explicit_count_larger_than_the_free_memory_is_refused_with_what_fits():
    with pytest.raises(ValueError) as info:
        _pages(60_000, free=100 * GIB)  # 102.5 GiB
    message = str(info.value)
    fits = int(99 * GIB // PER_PAGE) - 1
    for fragment in ("resources.kv_cache.num_pages: 60000 pages of 16 tokens need 102.54 GiB on cuda:0",
                     "100.00 GiB free", f"about {fits} pages fit", "set it to auto"):
        assert fragment in message, message


def test_an_explicit_count_that_fits_is_kept_and_one_eating_the_reserve_warns(caplog):
    assert _pages(8192) == 8192
    with caplog.at_level(logging.WARNING, logger=kv_sizing.__name__):
        assert _pages(58_000, free=100 * GIB) == 58_000  # 99.1 GiB: fits, with less than the 1 GiB reserve left
    assert "less than the 1.00 GiB estimated for the steps" in caplog.text
    assert _pages(10**9, device=torch.device("cpu")) == 10**9  # host memory is not checked


def test_the_steps_reserve_counts_the_widest_projection_and_the_logits_not_the_vocabulary():
    vocab = 1000
    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.zeros(vocab, 64))  # vocabulary-wide: not an activation width
    model.up = torch.nn.Parameter(torch.zeros(384, 64))
    model.down = torch.nn.Parameter(torch.zeros(64, 192))
    model.norm = torch.nn.Parameter(torch.zeros(64))
    reserve = step_reserve_bytes(model, max_batch_tokens=2048, max_num_seqs=8, vocab_size=vocab,
                                 dtype=torch.bfloat16)
    assert reserve == 2 * (2048 * 6 * 384 * 2 + 8 * vocab * (2 + 8)) + GIB


def test_auto_at_the_edge_counts_the_sink_page_and_rounds_down():
    """The cap needs 32 x 256 = 8192 pages; with the sink page the pool is 8193 pages of bytes. Exactly that much
    left after the reserve starts with 8192 pages, one byte less refuses, and a page's worth more than the cap is
    cut back to it when no prefix cache can use the rest."""
    needed = 32 * pages_for(4096, PAGE)
    edge = (needed + 1) * PER_PAGE + GIB  # the pool and the sink page, and the 1 GiB reserve
    assert _pages(free=edge, held=0) == needed
    with pytest.raises(ValueError, match=f"auto leaves {needed - 1} pages"):
        _pages(free=edge - 1, held=0)
    assert _pages(free=edge + PER_PAGE, held=0) == needed + 1
    assert _pages(free=edge + PER_PAGE, held=0, prefixes=False) == needed
    # the share binds the same way: 0.9 of the total, less what the instance holds, is the budget
    total = int((edge + 2 * GIB) / 0.9) + 1
    assert _pages(free=140 * GIB, total=total, held=2 * GIB) == needed


def test_auto_stops_at_the_int32_page_ids_an_explicit_count_is_held_to():
    """A toy model on a large GPU: 1-layer, 1-head, 1-dim pages of 1 token are 4 bytes, so 140 GiB would be ~37e9
    pages, past the block tables' int32 ids."""
    tiny = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
    pages = pool_pages("auto", spec=tiny, page_size=1, kv_dtype=torch.bfloat16, reserve=GIB, max_num_seqs=1,
                       max_model_len=16, caches_prefixes=True, share=0.9, device=CUDA,
                       memory=lambda _device: GpuMemory(135 * GIB, 140 * GIB, 0))
    assert pages == 2**31 - 1
