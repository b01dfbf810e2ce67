"""On the GPU, with flashinfer importable: the FlashInfer backend against ours and the torch reference.

Eager steps must match the Triton backend's attention (same pool, same rows: decode, prefill and mixed), and the
engine's captured graphs (planned before every replay) must give the eager step's greedy tokens. Skipped without
a GPU or without flashinfer (scripts/probe_flashinfer.py says how the device gets FlashInfer 0.2.5).
"""

from __future__ import annotations

import pytest
import torch

from mstar_common.engine.attention import TritonPagedAttention, build_attention_metadata
from tests.gpu.test_graphs_exact import _prompts, generate
from tests.gpu.test_graphs_exact import real_shape as real_shape  # noqa: F401 - fixture
from tests.gpu.test_graphs_exact import separated as separated  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")


@pytest.mark.parametrize("query_lens", [[1] * 9, [37, 5, 64], [1, 1, 30, 1, 7]])
def test_eager_steps_match_the_triton_backend(query_lens):
    from mstar_common.engine.flashinfer_backend import FlashInferAttention

    gen = torch.Generator(device="cuda").manual_seed(len(query_lens))
    heads, kv_heads, dim, page = 16, 8, 128, 16
    context_lens = [n + 40 * i for i, n in enumerate(query_lens)]
    pages_needed = [-(-c // page) for c in context_lens]
    num_pages = sum(pages_needed) + 2
    perm = torch.randperm(num_pages - 1, generator=gen, device="cuda").add(1).tolist()
    tables, used = [], 0
    for n in pages_needed:
        tables.append(perm[used:used + n])
        used += n
    k_cache = torch.randn((num_pages, page, kv_heads, dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    query = torch.randn((sum(query_lens), heads, dim), generator=gen, device="cuda", dtype=torch.bfloat16)
    metadata = build_attention_metadata(query_lens, context_lens, tables, page_size=page, sink_page=0, device="cuda")
    ours = TritonPagedAttention().attend(query, k_cache, v_cache, metadata, dim**-0.5)
    backend = FlashInferAttention()
    backend.prepare(metadata)
    theirs = backend.attend(query, k_cache, v_cache, metadata, dim**-0.5)
    err = float((theirs.float() - ours.float()).norm() / ours.float().norm())
    assert err < 1e-2, err


def test_graphs_equal_the_eager_step_with_flashinfer(real_shape):  # noqa: F811
    prompts = _prompts(8, 64, seed=3)  # one 512-token prefill bucket, then decode bucket 8
    eager = generate(real_shape, prompts, graphs=False, overlap=False, backend="flashinfer")
    assert generate(real_shape, prompts, graphs=True, overlap=True, backend="flashinfer") == eager


def test_mixed_steps_with_flashinfer_agree_with_triton(separated):  # noqa: F811
    prompts = _prompts(8, 48, seed=11)
    eager = generate(separated, prompts, graphs=False, overlap=False, stagger=5, backend="flashinfer")
    assert generate(separated, prompts, graphs=True, overlap=True, stagger=5, backend="flashinfer") == eager
    triton = generate(separated, prompts, graphs=False, overlap=False, stagger=5)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                  for x, y in zip(eager, triton, strict=True)]
    assert sum(n >= 8 for n in first_diff) >= 6, first_diff
