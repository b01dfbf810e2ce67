"""On-device sampling for captured steps: per-row parameters live in device buffers, no host reads.

`sample_on_device` applies temperature, top-k, top-p and min-p to every row (a row with them off passes through
unchanged), then draws by an exponential race whose noise comes from a counter-based RNG keyed by the row's
seed: `argmax(logits - log(-log(U)))`, `U = rand(seed_row, token)`. The host sets each row's seed to a mix of
the request's seed and the row's output index, so a token depends only on (seed, step, logits), never on the
batch or on whether the step was replayed from a graph. Greedy rows take the argmax of the raw logits.
Both argmaxes are mstar_kernels/argmax.py's; the draw adds the noise as it reads the filtered logits.

Past `MAX_VOCAB` columns (an LM's whole vocabulary) the filters do not write a filtered copy: the chunked search
(mstar_kernels/top_k_top_p.py) leaves each row's cut in its buffers, and one draw pass reads the raw logits, divides
by the temperature, drops what is below the top-k/top-p cut or min-p's floor, adds the noise, and takes each chunk's
maximum, the greedy rows' raw maximum in the same pass. A row that filters nothing costs the search no pass. The
tokens are those of the composed form (the same divisions, cuts, floor and noise).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mstar_common.engine.sampler import apply_min_p, apply_top_k_top_p
from mstar_kernels import argmax
from mstar_kernels.argmax import gumbel_argmax, gumbel_noise, row_argmax
from mstar_kernels.top_k_top_p import (
    CANDIDATES,
    MAX_VOCAB,
    SUB,
    ChunkedSearch,
    filters_on,
    row_cut,
    row_max,
    top_k_top_p,
)

_SORT_FREE_FILTER = os.environ.get("MSTAR_TOP_P_KERNEL", "1") != "0"  # docs/deployment.md "Kernel switches"


def sample_on_device(logits: torch.Tensor, is_greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row; every argument is a device tensor of `[B]` (logits `[B, V]` fp32). Graph safe."""
    if _SORT_FREE_FILTER and logits.shape[1] > MAX_VOCAB and logits.stride(1) == 1:
        return sample_wide(logits, is_greedy, temperature, top_k, top_p, min_p, seeds)
    greedy = row_argmax(logits.contiguous())
    scaled = logits / temperature[:, None]
    if _SORT_FREE_FILTER:  # mstar_kernels/top_k_top_p.py: no sort; a row with both filters off costs no pass
        filtered = top_k_top_p(scaled, top_k, top_p)
    else:
        filtered = apply_top_k_top_p(scaled, top_k[:, None].long(), top_p[:, None])
    filtered = apply_min_p(filtered, min_p[:, None])
    sampled = gumbel_argmax(filtered.contiguous(), seeds)
    return torch.where(is_greedy, greedy, sampled)


@triton.jit
def _draw_chunk_kernel(x_ptr, greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_log_ptr, seed_ptr, max_ptr, sub_max_ptr,
                       part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, val_ptr, idx_ptr, stride_x, vocab,
                       num_chunks, BLOCK: tl.constexpr, SUB: tl.constexpr, S: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """One chunk of one row: its largest raw logit (a greedy row) or noised kept tempered logit (a sampled row),
    and that value's first column, as mstar_kernels/argmax.py's chunk kernel leaves them for its pick. A row with a
    top-k/top-p cut that only a few `SUB` columns of the chunk reach reads just those (none below it is kept)."""
    NSUB: tl.constexpr = BLOCK // SUB
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    sampled = tl.load(greedy_ptr + row) == 0
    filters = sampled & filters_on(top_k_ptr, top_p_ptr, row, vocab)
    top = tl.zeros([], dtype=tl.float32)
    cut = tl.zeros([], dtype=tl.float32)
    live = tl.full([], NSUB, dtype=tl.int32)
    if filters:
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
        cut = row_cut(top_k_ptr, top_p_ptr, part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, row, vocab,
                      num_chunks, S, CHUNKS_PAD)
        sub_max = tl.load(sub_max_ptr + (row * num_chunks + chunk) * NSUB + tl.arange(0, NSUB))
        live = tl.sum((tl.exp(sub_max - top) >= cut).to(tl.int32), axis=0)
    if filters & (live <= NSUB // 4):
        temperature = tl.load(temp_ptr + row)
        floor = top + tl.load(min_p_log_ptr + row)  # min-p: apply_min_p's floor, max + log(min_p)
        seed = tl.load(seed_ptr + row)
        best = tl.full([], float("-inf"), dtype=tl.float32)
        best_col = chunk * BLOCK
        for j in tl.static_range(NSUB):
            if tl.exp(tl.load(sub_max_ptr + (row * num_chunks + chunk) * NSUB + j) - top) >= cut:
                cols = chunk * BLOCK + j * SUB + tl.arange(0, SUB)
                in_row = cols < vocab
                x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=float("-inf")).to(tl.float32)
                s = tl.math.div_rn(x, temperature)
                keep = in_row & (x > float("-inf")) & (s >= floor) & (tl.exp(s - top) >= cut)
                x = tl.where(keep, s + gumbel_noise(seed, chunk * BLOCK + j * SUB, SUB), float("-inf"))
                value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
                best_col = tl.where(value > best, chunk * BLOCK + j * SUB + index, best_col)  # the first one wins
                best = tl.maximum(best, value)
        tl.store(val_ptr + row * num_chunks + chunk, best)
        tl.store(idx_ptr + row * num_chunks + chunk, best_col)
    else:
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        if sampled:
            s = tl.math.div_rn(x, tl.load(temp_ptr + row))
            min_p_log = tl.load(min_p_log_ptr + row)
            keep = in_row & (x > float("-inf"))
            if filters | (min_p_log > float("-inf")):
                top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
                keep = keep & (s >= top + min_p_log)
                if filters:
                    keep = keep & (tl.exp(s - top) >= cut)
            x = tl.where(keep, s + gumbel_noise(tl.load(seed_ptr + row), chunk * BLOCK, BLOCK), float("-inf"))
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + row * num_chunks + chunk, value)
        tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


def sample_wide(logits: torch.Tensor, is_greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`sample_on_device` for rows wider than `MAX_VOCAB`: the chunked search, then one fused draw pass. Graph safe."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    search = ChunkedSearch(logits)
    search.run(temperature, top_k, top_p, min_p)
    num_chunks = triton.cdiv(vocab, argmax.BLOCK)
    assert num_chunks == search.num_chunks, "the draw's chunks must be the search's (argmax.BLOCK == CHUNK)"
    values = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    _draw_chunk_kernel[(num_rows, num_chunks)](logits, is_greedy, temperature, top_k, top_p, min_p.log(), seeds,
                                               search.row_max, search.sub_max, *search.cut_args(), values, indices,
                                               logits.stride(0), vocab, num_chunks, BLOCK=argmax.BLOCK, SUB=SUB,
                                               S=CANDIDATES, CHUNKS_PAD=search.chunks_pad, num_warps=8)
    argmax._pick_chunk_kernel[(num_rows,)](values, indices, out, out, out, num_chunks, vocab,
                                           CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), RECORD=False,
                                           USE_GDC=False, num_warps=1)
    return out


def sample_on_device_ref(logits, is_greedy, temperature, top_k, top_p, min_p, seeds):
    """The same filters with torch's own RNG (statistically equal, not bit-equal, to `sample_on_device`)."""
    greedy = logits.argmax(dim=-1)
    filtered = apply_min_p(apply_top_k_top_p(logits / temperature[:, None], top_k[:, None].long(), top_p[:, None]),
                           min_p[:, None])
    noise = torch.empty_like(filtered).exponential_().clamp_min_(torch.finfo(torch.float32).tiny).log()
    return torch.where(is_greedy, greedy, (filtered - noise).argmax(dim=-1))
