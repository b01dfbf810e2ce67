"""Kernel tests: each kernel against its torch reference over a sweep of shapes.

They run on a CUDA GPU (marker `gpu`). With `TRITON_INTERPRET=1` they also run on the CPU through Triton's
interpreter, on the smaller sweep (`SWEEP`), which is how the kernels are checked on a machine with no GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

IS_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if IS_INTERPRETED else "cuda"
GPU_ONLY = [] if IS_INTERPRETED else [pytest.mark.gpu]


# The kernel tests that take more than ~10 s each in the interpreter (sampling statistics and the wide vocabulary's
# search: ~8 of its ~11.5 minutes on a 2-core CPU, 2026-12-04). Marked `slow` there, so scripts/test.sh's CPU stage
# leaves them out; `TRITON_INTERPRET=1 pytest tests/kernels` runs them all, and the GPU runs take them at full size.
SLOW_INTERPRETED = frozenset({
    "test_the_fused_wide_draw_equals_the_filters_composed", "test_flat_top_p_rows_drawn_by_rejection",
    "test_the_fast_path_finishes_the_rows_whose_cut_tokens_it_gathers", "test_the_inverse_cdf_draws_follow_the_softmax",
    "test_the_noise_is_gumbel_and_the_draws_follow_the_softmax", "test_rows_with_no_filter_draw_by_the_inverse_cdf",
    "test_a_search_launch_over_chunk_groups_keeps_what_one_program_a_chunk_keeps",
    "test_a_top_k_past_half_the_blocks_is_bounded_by_the_128_column_maxima",
    "test_a_chunk_crowded_with_likely_tokens_keeps_only_its_own_top_k", "test_tune_keeps_the_kernel_only_where_it_won",
    "test_a_norm_fed_projection_takes_its_norm_inside_or_apart_as_timed",
})


def pytest_collection_modifyitems(config, items):
    if not IS_INTERPRETED:
        return
    for item in items:
        if getattr(item, "originalname", item.name) in SLOW_INTERPRETED:
            item.add_marker(pytest.mark.slow)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def sweep(full: list, small: list) -> list:
    return small if IS_INTERPRETED else full


def normed_projection_inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int, with_residual: bool):
    """A pre-norm block's projection inputs on DEVICE: x, residual (None without), the norm weight (about 1), the
    projection's weight (scaled by 1/sqrt(K)) and bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    gamma = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    return x, residual, gamma, weight, bias
