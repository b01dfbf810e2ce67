"""On-device sampling for captured steps: per-row parameters live in device buffers, no host reads.

`sample_on_device` applies temperature, top-k, top-p and min-p to every row (a row with them off passes through
unchanged), then draws by an exponential race whose noise comes from a counter-based RNG keyed by the row's
seed: `argmax(logits - log(-log(U)))`, `U = rand(seed_row, token)`. The host sets each row's seed to a mix of
the request's seed and the row's output index, so a token depends only on (seed, step, logits), never on the
batch or on whether the step was replayed from a graph. Greedy rows take the argmax of the raw logits.
Both argmaxes are mstar_kernels/argmax.py's; the draw adds the noise as it reads the filtered logits.

Past `MAX_VOCAB` columns (an LM's whole vocabulary) the filters do not write a filtered copy: the chunked search
(mstar_kernels/top_k_top_p.py) leaves each row's cut in its buffers, and one draw pass reads the raw logits (in the
model's dtype, no fp32 copy), divides by the temperature, drops what is below the top-k/top-p cut or min-p's floor,
adds the noise, and takes each chunk's maximum, the greedy rows' raw maximum in the same pass. A filtering row's
tokens are those of the composed form (the same divisions, cuts, floor and noise); a row that filters nothing
costs the search no pass. A row with no filter at all (temperature alone) draws by the inverse of its softmax's CDF
instead of the race, which needs no noise for 151,936 columns: the same pass keeps each chunk's maximum `m` and
`z = sum(exp(s - m))`, and one program a row turns one 53-bit uniform `u` into the chunk where `u * Z` falls and
then, by a prefix sum over that chunk alone (in fp64), the token. Both are exact draws from the softmax; which one
a row takes depends on its own parameters only, so a token still depends only on (seed, step, logits).
`filters=False` (the engine's `temperature alone` graph variant, when no row of a step filters) skips the search's
launches altogether.

By default (`MSTAR_TOP_P_REJECT=0` turns it off), a row with top-p alone (min-p allowed) that the search's fast path
declines, a flat row whose nucleus holds thousands of tokens, is drawn by rejection instead of the search:
`REJECT_CANDIDATES` tokens drawn from the whole softmax by the inverse CDF, one pass that sums the mass strictly
above each, and the first candidate with less than `top_p * Z` above it (and at or above min-p's floor) is the
token, an exact draw from the nucleus. A row whose candidates all fall outside it (probability at most
`(1 - top_p) ** REJECT_CANDIDATES`) takes the search. On the H200 (scripts/sweep_sampling.py --vocab 151936, flat
rows, top-p 0.8, 2026-12-03) the sampler took 47 / 63 / 127 / 372 us at 1 / 16 / 64 / 256 rows, against the
search's 95 / 196 / 624 / 2,442.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_common.config import env_switch
from mstar_common.engine.sampler import apply_min_p, apply_top_k_top_p
from mstar_kernels import argmax
from mstar_kernels._pdl import gdc_enter, pdl_launch
from mstar_kernels.argmax import gumbel_argmax, gumbel_noise, row_argmax
from mstar_kernels.top_k_top_p import (
    CANDIDATES,
    MAX_VOCAB,
    SUB,
    ChunkedSearch,
    filters_on,
    row_cut,
    row_max,
    row_z,
    top_k_top_p,
)

_SORT_FREE_FILTER = env_switch("MSTAR_TOP_P_KERNEL", True)  # docs/deployment.md "Kernel switches"
_REJECT = env_switch("MSTAR_TOP_P_REJECT", True)  # docs/deployment.md "Kernel switches"
REJECT_CANDIDATES = 8


def sample_on_device(logits: torch.Tensor, is_greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor,
                     filters: bool = True) -> torch.Tensor:
    """One token per row; every argument is a device tensor of `[B]` (logits `[B, V]`, fp32 or the model's dtype;
    `is_greedy` bool or int, nonzero for greedy).
    `filters=False` promises that no row asks for top-k, top-p or min-p (the filters' launches are left out; the
    tokens are the same). Graph safe."""
    if _SORT_FREE_FILTER and logits.shape[1] > MAX_VOCAB and logits.stride(1) == 1:
        return sample_wide(logits, is_greedy, temperature, top_k, top_p, min_p, seeds, filters)
    logits, is_greedy = logits.float(), is_greedy != 0
    greedy = row_argmax(logits.contiguous())
    filtered = logits / temperature[:, None]
    if filters and _SORT_FREE_FILTER:  # mstar_kernels/top_k_top_p.py: no sort; a row with both off costs no pass
        filtered = apply_min_p(top_k_top_p(filtered, top_k, top_p), min_p[:, None])
    elif filters:
        filtered = apply_min_p(apply_top_k_top_p(filtered, top_k[:, None].long(), top_p[:, None]), min_p[:, None])
    sampled = gumbel_argmax(filtered.contiguous(), seeds)
    return torch.where(is_greedy, greedy, sampled)


UNIFORM_COUNTER = tl.constexpr(0x7FFFFFFF)  # Philox counter of a row's inverse-CDF uniform (the noise: column / 4)


@triton.jit
def uniform53(seed, index):
    """The row's `index`-th uniform in [0, 1) with 53 random bits (fp64), from Philox keyed by the row's seed at
    counter `UNIFORM_COUNTER - index`."""
    a, b, _, _ = tl.randint4x(seed, tl.full([], UNIFORM_COUNTER, dtype=tl.int32) - index)
    high = (a >> 5).to(tl.float64)  # 27 bits
    low = (b >> 6).to(tl.float64)  # 26 bits
    return (high * 67108864.0 + low) * 1.1102230246251565e-16  # 2^-53


@triton.jit
def _plain_e(x_ptr, temp_ptr, row, cols, stride_x, vocab):
    """These columns' tempered logits `s = x / T` (-inf where masked or past the row): the draw's and the pick's
    identical form, so that both compute the same `exp(s - m)`."""
    in_row = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, tl.load(temp_ptr + row))
    return tl.where(in_row & (x > float("-inf")), s, float("-inf"))


@triton.jit
def _is_plain(greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab, FILTERS: tl.constexpr):
    """Whether the row samples with no filter at all (temperature alone): it draws by the inverse CDF."""
    plain = tl.load(greedy_ptr + row) == 0
    if FILTERS:
        plain = plain & ~filters_on(top_k_ptr, top_p_ptr, row, vocab) & (tl.load(min_p_ptr + row) == 0.0)
    return plain


@triton.jit
def _draw_filtered(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, max_ptr, sub_max_ptr, part_ptr,
                   state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, val_ptr, idx_ptr, stride_x, vocab, num_chunks,
                   row, chunk, sampled, BLOCK: tl.constexpr, SUB: tl.constexpr, S: tl.constexpr,
                   CHUNKS_PAD: tl.constexpr):
    """A greedy row's chunk (its raw maximum), or a filtering or min-p row's (its noised kept maximum)."""
    NSUB: tl.constexpr = BLOCK // SUB
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
        floor = top + tl.log(tl.load(min_p_ptr + row))  # min-p: apply_min_p's floor, max + log(min_p)
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
        if sampled:  # many tokens past the cut, or min-p alone
            s = tl.math.div_rn(x, tl.load(temp_ptr + row))
            top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
            keep = in_row & (x > float("-inf")) & (s >= top + tl.log(tl.load(min_p_ptr + row)))
            if filters:
                keep = keep & (tl.exp(s - top) >= cut)
            x = tl.where(keep, s + gumbel_noise(tl.load(seed_ptr + row), chunk * BLOCK, BLOCK), float("-inf"))
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + row * num_chunks + chunk, value)
        tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _draw_chunk_kernel(x_ptr, greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, max_ptr, sub_max_ptr,
                       part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, val_ptr, idx_ptr, chunk_z_ptr,
                       chosen_ptr, stride_x, vocab, num_chunks, BLOCK: tl.constexpr, SUB: tl.constexpr,
                       S: tl.constexpr, CHUNKS_PAD: tl.constexpr, FILTERS: tl.constexpr, REJECT: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """One chunk of one row: its largest raw logit (a greedy row) or noised kept tempered logit (a filtering row),
    and that value's first column, as mstar_kernels/argmax.py's chunk kernel leaves them for its pick; for a row
    with no filter, the chunk's largest tempered logit `m` and `sum(exp(s - m))` for the inverse-CDF pick. A row with
    a top-k/top-p cut that only a few `SUB` columns of the chunk reach reads just those (none below it is kept).
    Without FILTERS no row filters and the search's buffers are not read."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    sampled = tl.load(greedy_ptr + row) == 0
    if _is_plain(greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab, FILTERS):
        s = _plain_e(x_ptr, temp_ptr, row, chunk * BLOCK + tl.arange(0, BLOCK), stride_x, vocab)
        m = tl.max(s, axis=0)
        e = tl.where(s > float("-inf"), tl.exp(s - m), 0.0)
        tl.store(val_ptr + row * num_chunks + chunk, m)
        tl.store(chunk_z_ptr + row * num_chunks + chunk, tl.sum(e.to(tl.float64), axis=0))  # fp64: exact boundaries
    elif FILTERS:
        todo = True
        if REJECT:
            todo = tl.load(chosen_ptr + row) < 0  # not drawn by rejection
        if todo:
            _draw_filtered(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, max_ptr, sub_max_ptr, part_ptr,
                           state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, val_ptr, idx_ptr, stride_x, vocab,
                           num_chunks, row, chunk, sampled, BLOCK, SUB, S, CHUNKS_PAD)
    else:  # a greedy row
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(val_ptr + row * num_chunks + chunk, value)
        tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _inverse_cdf(x_ptr, temp_ptr, values, z, u, row, stride_x, vocab, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """The column at uniform `u` of the row's softmax over `s = x / T`, from each chunk's largest `s` (`values`) and
    its mass `z = sum(exp(s - that max))` (`[CHUNKS_PAD]`): the chunk where `u * Z` falls among the chunks' masses
    `z * exp(m - M)`, then the column where the same fraction of that chunk's own mass falls, by a prefix sum of its
    `exp(s - m)` in fp64. Only columns of positive probability can come out. Returns (column, its `s`)."""
    c = tl.arange(0, CHUNKS_PAD)
    top = tl.max(values, axis=0)
    w = tl.where(values > float("-inf"), z.to(tl.float64) * tl.exp((values - top).to(tl.float64)), 0.0)
    cum = tl.cumsum(w, axis=0)
    target = u * tl.max(cum, axis=0)
    last = tl.max(tl.where(w > 0.0, c, 0), axis=0)  # no chunk past the last one with mass
    pick = tl.minimum(tl.sum((cum <= target).to(tl.int32), axis=0), last)
    mass = tl.sum(tl.where(c == pick, w, 0.0), axis=0)
    fraction = (target - tl.sum(tl.where(c < pick, w, 0.0), axis=0)) / tl.where(mass > 0.0, mass, 1.0)
    fraction = tl.minimum(tl.maximum(fraction, 0.0), 1.0)
    m = tl.max(tl.where(c == pick, values, float("-inf")), axis=0)
    j = tl.arange(0, BLOCK)
    s = _plain_e(x_ptr, temp_ptr, row, pick * BLOCK + j, stride_x, vocab)
    e = tl.where(s > float("-inf"), tl.exp(s - m), 0.0)
    prefix = tl.cumsum(e.to(tl.float64), axis=0)
    within = tl.sum((prefix <= fraction * tl.max(prefix, axis=0)).to(tl.int32), axis=0)
    within = tl.minimum(within, tl.max(tl.where(e > 0.0, j, 0), axis=0))
    return pick * BLOCK + within, tl.max(tl.where(j == within, s, float("-inf")), axis=0)


@triton.jit
def _pick_draw_kernel(val_ptr, idx_ptr, chunk_z_ptr, chosen_ptr, x_ptr, greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr,
                      min_p_ptr, seed_ptr, out_ptr, stride_x, vocab, num_chunks, BLOCK: tl.constexpr,
                      CHUNKS_PAD: tl.constexpr, FILTERS: tl.constexpr, REJECT: tl.constexpr, USE_GDC: tl.constexpr):
    """One row's token from its chunks: the first chunk holding the largest value (a greedy or filtering row), the
    inverse CDF at the row's uniform (a row with no filter; `_inverse_cdf`), or the token rejection drew."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    values = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    if _is_plain(greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row, vocab, FILTERS):
        z = tl.load(chunk_z_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)
        token, _ = _inverse_cdf(x_ptr, temp_ptr, values, z, uniform53(tl.load(seed_ptr + row), 0), row, stride_x, vocab,
                                BLOCK, CHUNKS_PAD)
    else:
        _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        token = tl.load(idx_ptr + row * num_chunks + best)
        if REJECT:
            chosen = tl.load(chosen_ptr + row)
            token = tl.where(chosen >= 0, chosen, token)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _rejects(greedy_ptr, top_k_ptr, top_p_ptr, done_ptr, row, vocab):
    """Whether a row is drawn by rejection: sampled, top-p alone, and not finished by the search's fast path."""
    return ((tl.load(greedy_ptr + row) == 0) & (tl.load(top_k_ptr + row) >= vocab) & (tl.load(top_p_ptr + row) < 1.0)
            & (tl.load(done_ptr + row) == 0))


@triton.jit
def _propose_kernel(x_ptr, greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, max_ptr, chunk_z_ptr, done_ptr,
                    cand_ptr, cand_e_ptr, stride_x, vocab, num_chunks, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                    K: tl.constexpr):
    """Candidate `k` of a rejection row: the inverse CDF of its whole softmax at its `k`-th uniform, from the fast
    path's chunk maxima and chunk masses; with its `e = exp(s - row max)`."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    if _rejects(greedy_ptr, top_k_ptr, top_p_ptr, done_ptr, row, vocab):
        c = tl.arange(0, CHUNKS_PAD)
        values = tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
        z = tl.load(chunk_z_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0)  # read where values > -inf
        column, s = _inverse_cdf(x_ptr, temp_ptr, values, z, uniform53(tl.load(seed_ptr + row), k), row, stride_x,
                                 vocab, BLOCK, CHUNKS_PAD)
        tl.store(cand_ptr + row * K + k, column)
        tl.store(cand_e_ptr + row * K + k, tl.exp(s - tl.max(values, axis=0)))


@triton.jit
def _mass_above_kernel(x_ptr, greedy_ptr, temp_ptr, top_k_ptr, top_p_ptr, max_ptr, done_ptr, cand_e_ptr, part_ptr,
                       stride_x, vocab, num_chunks, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr, K: tl.constexpr):
    """One chunk of a rejection row: the mass `e` of its tokens strictly above each candidate's."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if _rejects(greedy_ptr, top_k_ptr, top_p_ptr, done_ptr, row, vocab):
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
        s = _plain_e(x_ptr, temp_ptr, row, chunk * BLOCK + tl.arange(0, BLOCK), stride_x, vocab)
        e = tl.where(s > float("-inf"), tl.exp(s - top), 0.0)
        for k in tl.static_range(K):
            above = tl.sum(tl.where(e > tl.load(cand_e_ptr + row * K + k), e, 0.0), axis=0)
            tl.store(part_ptr + (row * num_chunks + chunk) * K + k, above)


@triton.jit
def _accept_kernel(greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, max_ptr, chunk_z_ptr, done_ptr, cand_ptr, cand_e_ptr,
                   part_ptr, chosen_ptr, vocab, num_chunks, CHUNKS_PAD: tl.constexpr, K: tl.constexpr):
    """A rejection row's token: its first candidate with less than `top_p * Z` of mass strictly above it (the kept
    rule of mstar_kernels/top_k_top_p.py) and at or above min-p's floor; the row is then done for the search. -1
    where none passed (or the row is not drawn by rejection)."""
    row = tl.program_id(0).to(tl.int64)
    chosen = tl.full([], -1, dtype=tl.int32)
    if _rejects(greedy_ptr, top_k_ptr, top_p_ptr, done_ptr, row, vocab):
        c = tl.arange(0, CHUNKS_PAD)
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
        target = tl.load(top_p_ptr + row) * row_z(max_ptr, chunk_z_ptr, row, num_chunks, top, CHUNKS_PAD)
        floor = tl.load(min_p_ptr + row)  # min-p keeps e = exp(s - max) >= min_p
        for k in tl.static_range(K):
            above = tl.sum(tl.load(part_ptr + (row * num_chunks + c) * K + k, mask=c < num_chunks, other=0.0), axis=0)
            passed = (above < target) & (tl.load(cand_e_ptr + row * K + k) >= floor) & (chosen < 0)
            chosen = tl.where(passed, tl.load(cand_ptr + row * K + k), chosen)
        if chosen >= 0:
            tl.store(done_ptr + row, 1)
    tl.store(chosen_ptr + row, chosen)


def sample_wide(logits: torch.Tensor, is_greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, filters: bool = True) -> torch.Tensor:
    """`sample_on_device` for rows wider than `MAX_VOCAB`: the chunked search (unless `filters` is False), then one
    fused draw pass and one pick a row. Graph safe."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, argmax.BLOCK)
    chunks_pad = max(2, triton.next_power_of_2(num_chunks))
    row_args = (is_greedy, temperature, top_k, top_p, min_p)
    search = ChunkedSearch(logits) if filters else None
    reject = search is not None and _REJECT and search.fast  # rejection needs the fast path's chunk masses
    chosen = torch.empty(num_rows, dtype=torch.int32, device=logits.device) if reject else logits  # rejection's tokens
    if search is not None:
        search.run(temperature, top_k, top_p, min_p,
                   (lambda search: _reject(logits, row_args, seeds, search, chosen)) if reject else None)
        assert num_chunks == search.num_chunks, "the draw's chunks must be the search's (argmax.BLOCK == CHUNK)"
        cut_args = (search.row_max, search.sub_max, *search.cut_args())
    else:
        cut_args = (logits,) * 8  # not read
    values = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    chunk_z = torch.empty((num_rows, num_chunks), dtype=torch.float64, device=logits.device)
    _draw_chunk_kernel[(num_rows, num_chunks)](logits, *row_args, seeds, *cut_args, values, indices, chunk_z, chosen,
                                               logits.stride(0), vocab, num_chunks, BLOCK=argmax.BLOCK, SUB=SUB,
                                               S=CANDIDATES, CHUNKS_PAD=chunks_pad, FILTERS=filters, REJECT=reject,
                                               num_warps=8, **pdl_launch(logits, num_rows, num_rows * num_chunks))
    _pick_draw_kernel[(num_rows,)](values, indices, chunk_z, chosen, logits, *row_args, seeds, out, logits.stride(0),
                                   vocab, num_chunks, BLOCK=argmax.BLOCK, CHUNKS_PAD=chunks_pad, FILTERS=filters,
                                   REJECT=reject, num_warps=8, **pdl_launch(logits, num_rows, num_rows))
    return out


def _reject(logits: torch.Tensor, row_args: tuple, seeds: torch.Tensor, search: ChunkedSearch,
            chosen: torch.Tensor) -> None:
    """Draw the top-p rows the fast path declined by rejection (`MSTAR_TOP_P_REJECT`): candidates, the mass above
    each, the first one inside the nucleus into `chosen`; the rows it draws are marked done for the search."""
    is_greedy, temperature, top_k, top_p, min_p = row_args
    num_rows, vocab = logits.shape
    num_chunks, k = search.num_chunks, REJECT_CANDIDATES
    candidates = torch.empty((num_rows, k), dtype=torch.int32, device=logits.device)
    candidate_e = torch.empty((num_rows, k), dtype=torch.float32, device=logits.device)
    above = torch.empty((num_rows, num_chunks, k), dtype=torch.float32, device=logits.device)
    common = dict(BLOCK=argmax.BLOCK, CHUNKS_PAD=search.chunks_pad, K=k, num_warps=8)
    _propose_kernel[(num_rows, k)](logits, is_greedy, temperature, top_k, top_p, seeds, search.row_max,
                                   search.chunk_z, search.done, candidates, candidate_e, logits.stride(0), vocab,
                                   num_chunks, **common)
    _mass_above_kernel[(num_rows, num_chunks)](logits, is_greedy, temperature, top_k, top_p, search.row_max,
                                               search.done, candidate_e, above, logits.stride(0), vocab, num_chunks,
                                               **common)
    _accept_kernel[(num_rows,)](is_greedy, top_k, top_p, min_p, search.row_max, search.chunk_z, search.done,
                                candidates, candidate_e, above, chosen, vocab, num_chunks,
                                CHUNKS_PAD=search.chunks_pad, K=k, num_warps=4)


def sample_on_device_ref(logits, is_greedy, temperature, top_k, top_p, min_p, seeds):
    """The same filters with torch's own RNG (statistically equal, not bit-equal, to `sample_on_device`)."""
    greedy = logits.argmax(dim=-1)
    filtered = apply_min_p(apply_top_k_top_p(logits / temperature[:, None], top_k[:, None].long(), top_p[:, None]),
                           min_p[:, None])
    noise = torch.empty_like(filtered).exponential_().clamp_min_(torch.finfo(torch.float32).tiny).log()
    return torch.where(is_greedy, greedy, (filtered - noise).argmax(dim=-1))


@triton.jit
def _uniforms_kernel(seed_ptr, out_ptr, index):
    row = tl.program_id(0)
    tl.store(out_ptr + row, uniform53(tl.load(seed_ptr + row), index))


def row_uniforms(seeds: torch.Tensor, index: int = 0) -> torch.Tensor:
    """Each row's `index`-th uniform (fp64 `[B]`), as the draw takes it from the row's seed: 0 for the inverse CDF of
    a row with no filter, 0 .. `REJECT_CANDIDATES - 1` for the candidates of a top-p row drawn by rejection."""
    out = torch.empty(seeds.shape[0], dtype=torch.float64, device=seeds.device)
    if seeds.shape[0]:
        _uniforms_kernel[(seeds.shape[0],)](seeds, out, index)
    return out


def inverse_cdf_ref(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token at each row's uniform `u` of softmax(logits / T) (divided in fp32, as torch divides), in fp64: the
    first column whose cumulative probability exceeds `u`, among the columns of positive probability."""
    s = (logits.float() / temperature[:, None]).double()
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values).nan_to_num(0.0)
    cum = e.cumsum(dim=-1)
    token = torch.searchsorted(cum, (uniforms * cum[:, -1])[:, None], right=True)[:, 0]
    cols = torch.arange(logits.shape[1], device=logits.device)
    return torch.minimum(token, torch.where(e > 0, cols, 0).max(dim=-1).values)

