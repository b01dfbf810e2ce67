"""Top-k and top-p filtering without a sort, for vocabularies (or logit windows) of up to 32,768 entries.

`apply_top_k_top_p` (mstar_common/engine/sampler.py) sorts every row every step: on Orpheus at 256 rows over
its 28,672 audio-token window that sort and its scatter are ~0.7 ms of a 9.1 ms decode step on an H200. Here one
program holds a whole row in registers and finds the two cut-offs by bisection on the float bit patterns
(monotone for the non-negative values searched), 31 passes over registers each:

- top-k: the k-th largest logit `x_k` = the largest value with at least k logits >= it; logits below it go
  (ties with the k-th stay, as in the sorted form);
- top-p over what is left, with `e = exp(logit - max)` and `Z` their sum: a token stays iff the mass of the
  tokens strictly above it is below `top_p * Z` (the sorted form's `mass_above < top_p`); that holds exactly
  for the tokens with `e >= T`, `T` the smallest such `e`, which the bisection finds.

Wider rows (an LM's whole vocabulary: Qwen3's 151,936, Llama-3's 128,256) do not fit one program's registers.
There the same two searches run over chunks of `CHUNK` columns, one program per (row, chunk), as a chain of
launches: each launch totals the previous launch's per-chunk counts (top-k) or masses (top-p) in chunk order,
narrows the row's interval of bit patterns to the part that holds the answer, and counts its chunk against the
`CANDIDATES - 1` patterns that split that part evenly; 8 launches a search instead of 31 passes. A row with both
filters off returns from every launch at once. Only the elements inside the current interval are compared
against each candidate; those above it add to every candidate at once.

Most rows never reach those launches: a fast path (`MSTAR_TOP_P_FAST`, on by default) bounds each row's cut from
below by the maxima of its 512-column blocks (top-k: the k-th largest maximum, as k distinct tokens reach it; the
maxima of its 128-column blocks for a k above half its 512-column blocks, of which Qwen3's 151,936 make 297;
top-p alone: the largest maximum whose maxima at or above it already hold `top_p` of the row's mass), gathers
the few tokens at or above the bound (reading only the blocks whose maximum reaches it; a chunk that gathers too
many under a small top-k keeps only its own k largest) and cuts them in one program a row, which sorts them: the
k-th largest is the k-th, the top-p cut the smallest kept token with less than `top_p * Z` of kept mass above it,
the values the bisections find. A row whose bound does not hold (top-p over a flat row, top-k past the row's
number of 128-column blocks) or whose gathered tokens overflow (more than `FAST_CAP_CHUNK` in a chunk or
`FAST_CAP` in the row) is left to the search, whose launches every finished row leaves at once.

The kept sets equal the sorted form's except where a sum lands within rounding of `top_p` (the two add in
different orders) or at exact ties across the cut (the sorted form keeps some of the tied tokens, this keeps
all). `sample_on_device` uses it at every width (`MSTAR_TOP_P_KERNEL=0` restores the sort; H200 timings in
docs/deployment.md "Kernel switches").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mstar_common.config import env_switch

MAX_VOCAB = 32768
_BITS_OF_ONE = tl.constexpr(0x3F800000)  # 1.0f; every e = exp(logit - max) lies in [0, 1]


@triton.jit
def _largest_reaching(e, need, lo, MASS: tl.constexpr):
    """The largest bit pattern b >= `lo` (which must qualify) with count(e >= float(b)) >= need, or with MASS the
    sum of those e >= need: a 31-step bisection over the patterns of [0, 1.0]."""
    hi = tl.full([], _BITS_OF_ONE + 1, dtype=tl.int32)  # nothing lies above 1.0
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        reached = e >= mid.to(tl.float32, bitcast=True)
        if MASS:
            enough = tl.sum(tl.where(reached, e, 0.0), axis=0) >= need
        else:
            enough = tl.sum(reached.to(tl.int32), axis=0) >= need
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def _top_k_top_p_kernel(logits_ptr, top_k_ptr, top_p_ptr, out_ptr, stride_l, stride_o, vocab,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    in_row = cols < vocab
    logits = tl.load(logits_ptr + row * stride_l + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    keep = in_row & (logits > float("-inf"))
    top = tl.max(logits, axis=0)
    e = tl.where(keep, tl.exp(logits - top), 0.0)  # in [0, 1]; the top token's is 1
    if top_k < vocab:
        # the k-th largest e (count(e >= 0) = vocab >= k)
        k_cut = _largest_reaching(e, top_k, tl.zeros([], dtype=tl.int32), False)
        keep = keep & (e >= k_cut.to(tl.float32, bitcast=True))
        e = tl.where(keep, e, 0.0)
    if top_p < 1.0:
        target = top_p * tl.sum(e, axis=0)
        # the smallest bit pattern b with sum(e > float(b)) < target
        lo = tl.full([], -1, dtype=tl.int32)  # "below 0": the whole mass Z >= target
        hi = tl.full([], _BITS_OF_ONE, dtype=tl.int32)  # sum(e > 1.0) = 0 < target
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            threshold = tl.maximum(mid, 0).to(tl.float32, bitcast=True)
            below_target = tl.sum(tl.where(e > threshold, e, 0.0), axis=0) < target
            below_target = below_target & (mid >= 0)
            hi = tl.where(below_target, mid, hi)
            lo = tl.where(below_target, lo, mid)
        keep = keep & (e >= hi.to(tl.float32, bitcast=True))
    tl.store(out_ptr + row * stride_o + cols, tl.where(keep, logits, float("-inf")), mask=in_row)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`logits` `[B, V]` fp32, `top_k` `[B]` int (V: off), `top_p` `[B]` float (1.0: off) -> the logits with
    the filtered-out entries at -inf. Up to `MAX_VOCAB` columns one program holds a row; wider rows take the
    chunked search. Graph safe: no host reads."""
    num_rows, vocab = logits.shape
    assert logits.stride(1) == 1 and top_k.shape == top_p.shape == (num_rows,)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    if vocab > MAX_VOCAB:
        return top_k_top_p_chunked(logits, top_k, top_p, out)
    block = triton.next_power_of_2(vocab)
    _top_k_top_p_kernel[(num_rows,)](logits, top_k, top_p, out, logits.stride(0), out.stride(0), vocab,
                                     BLOCK=block, num_warps=max(4, min(16, block // 2048)))
    return out


# --- rows wider than one program's registers: the searches over chunks, one launch per narrowing step -----------

CHUNK = 4096  # columns per program
SUB = 512  # columns compared against the candidates at once
FINE = 128  # the blocks whose maxima bound a top-k above half the row's SUB-column blocks ...
FINE_BOUND = env_switch("MSTAR_TOP_K_FINE", True)  # ... unless off (docs/deployment.md "Kernel switches")
CANDIDATES = 16  # patterns per step: the interval shrinks 16-fold a launch
FAST_CAP_CHUNK = 128  # the fast path's gathered tokens a chunk ...
FAST_CAP = 1024  # ... and a row; a row with more is left to the search
FAST_PATH = env_switch("MSTAR_TOP_P_FAST", True)  # docs/deployment.md "Kernel switches"


SEARCH_PROGRAMS_PER_SM = 8  # the default spread of a search launch (H200: 1,056 programs)


def search_groups(num_rows: int, num_chunks: int, device: torch.device) -> int:
    """Programs a row takes in each search launch, each over every `groups`-th chunk. `MSTAR_SEARCH_PROGRAMS=N`
    spreads about N programs over the rows; 0 gives one program a chunk (as before 2026-12-04); unset, 8 a
    streaming multiprocessor on CUDA (one a chunk elsewhere). A launch whose rows the fast path finished still
    starts all its programs: 64 rows x 38 chunks took 160.7 us for a top-k 20 + top-p 0.8 draw on the H200
    against 144.0 at 1,056 programs, and a launch whose rows all search was not slower (docs/benchmarks.md)."""
    raw = os.environ.get("MSTAR_SEARCH_PROGRAMS", "")
    if raw:
        if not raw.isdigit():
            raise ValueError(f"MSTAR_SEARCH_PROGRAMS={raw!r}: expected a non-negative integer")
        target = int(raw)
    elif device.type == "cuda":
        target = SEARCH_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 0
    return num_chunks if target == 0 else max(1, min(num_chunks, -(-target // max(1, num_rows))))


_TOP_K, _TOP_P = 0, 1


def search_steps(width: int = 0x3F800001, candidates: int = CANDIDATES) -> int:
    """Launches until an interval of `width` bit patterns is down to one (each leaves at most ceil(w / S))."""
    steps = 0
    while width > 1:
        width, steps = -(-width // candidates), steps + 1
    return steps


@triton.jit
def row_max(max_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr):
    """The row's largest tempered logit, from its chunks' maxima."""
    c = tl.arange(0, CHUNKS_PAD)
    return tl.max(tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf")), axis=0)


@triton.jit
def _row_e(s_ptr, row, cols, vocab, top):
    """These columns' e = exp(s - row max) of the tempered logits s (0 where s is -inf or past the row)."""
    in_row = cols < vocab
    x = tl.load(s_ptr + row * vocab + cols, mask=in_row, other=float("-inf"))
    keep = in_row & (x > float("-inf"))
    return tl.where(keep, tl.exp(x - top), 0.0), keep


@triton.jit
def _candidates(lo, hi, S: tl.constexpr):
    """`lo + (hi - lo) * j // S` for j < S: j = 0 is `lo` itself, the rest split [lo, hi) evenly."""
    j = tl.arange(0, S).to(tl.int64)
    return (lo.to(tl.int64) + (hi.to(tl.int64) - lo.to(tl.int64)) * j // S).to(tl.int32)


@triton.jit
def _totals(part_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr, S: tl.constexpr):
    """The previous launch's per-chunk partials of this row, added in chunk order: `[S]`."""
    c = tl.arange(0, CHUNKS_PAD)[:, None]
    j = tl.arange(0, S)[None, :]
    parts = tl.load(part_ptr + (row * num_chunks + c) * S + j, mask=c < num_chunks, other=0.0)
    return tl.sum(parts, axis=0)


@triton.jit
def _narrow(part_ptr, state_ptr, row, num_chunks, top_k, target, MODE: tl.constexpr, CHUNKS_PAD: tl.constexpr,
            S: tl.constexpr):
    """The interval the previous launch split (`state` [lo, hi)) narrowed by its totals to the part holding the
    answer. top-k: the largest pattern b with count(e >= b) >= k (lo holds, hi does not); top-p: the smallest b
    >= 0 with mass(e > b) < target (hi holds, lo does not)."""
    lo = tl.load(state_ptr + row * 2)
    hi = tl.load(state_ptr + row * 2 + 1)
    cand = _candidates(lo, hi, S)
    totals = _totals(part_ptr, row, num_chunks, CHUNKS_PAD, S)
    first = tl.arange(0, S) == 0
    later = tl.arange(0, S) > 0
    if MODE == 0:
        holds = (totals >= top_k.to(tl.float32)) | first
        new_lo = tl.max(tl.where(holds, cand, lo), axis=0)
        new_hi = tl.min(tl.where(holds, hi, cand), axis=0)
    else:
        holds = (totals < target) & (cand >= 0) & later
        new_lo = tl.max(tl.where(holds, lo, cand), axis=0)
        new_hi = tl.min(tl.where(holds, cand, hi), axis=0)
    return new_lo, new_hi


@triton.jit
def filters_on(top_k_ptr, top_p_ptr, row, vocab):
    """Whether the row asks for top-k or top-p."""
    return (tl.load(top_k_ptr + row) < vocab) | (tl.load(top_p_ptr + row) < 1.0)


@triton.jit
def needs_fine(top_k, vocab, SUB: tl.constexpr, FINE_BOUND: tl.constexpr):
    """Whether a top-k's bound comes from the maxima of the `FINE`-column blocks: when k is more than half the row's
    `SUB`-column blocks. The k-th largest of B block maxima lies, on logits without order, near the
    `-B ln(1 - k/B)`-th largest token, so the `SUB` blocks' bound gathers 1.4k tokens at k = B/2, 2.6k at 0.9B
    and has none past B, where the `FINE` blocks' (4B of them) gathers 1.07k and 1.15k at k = B/2 and B (2.4k at
    k = 3.5B; the row's `FAST_CAP` stops it first)."""
    return FINE_BOUND and (top_k < vocab) & (2 * top_k > (vocab + SUB - 1) // SUB)


@triton.jit
def _chunk_max_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, max_ptr, sub_max_ptr, fine_max_ptr,
                      chunk_z_ptr, stride_x, vocab, num_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr,
                      FINE: tl.constexpr, FINE_BOUND: tl.constexpr, FAST: tl.constexpr):
    """For the rows that filter (or floor by min-p): each chunk's largest tempered logit `x / T` (rounded as torch
    divides), and for the rows that filter the largest of each `SUB` columns, (a top-k above half the row's
    `SUB`-column blocks) of each `FINE` columns, and (top-p alone) the chunk's `sum(exp(s - chunk max))`, from
    which the fast path bounds the cuts."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    filters = filters_on(top_k_ptr, top_p_ptr, row, vocab)
    if not (filters | (tl.load(min_p_ptr + row) > 0.0)):
        return
    NSUB: tl.constexpr = CHUNK // SUB
    cols = chunk * CHUNK + tl.arange(0, NSUB)[:, None] * SUB + tl.arange(0, SUB)[None, :]
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    s = tl.math.div_rn(x, tl.load(temp_ptr + row))
    sub_max = tl.max(s, axis=1)
    chunk_max = tl.max(sub_max, axis=0)
    tl.store(max_ptr + row * num_chunks + chunk, chunk_max)
    if filters:
        tl.store(sub_max_ptr + (row * num_chunks + chunk) * NSUB + tl.arange(0, NSUB), sub_max)
        if FAST:
            if needs_fine(tl.load(top_k_ptr + row), vocab, SUB, FINE_BOUND):
                NFINE: tl.constexpr = CHUNK // FINE
                fine_max = tl.max(tl.reshape(s, (NFINE, FINE)), axis=1)  # (row-major: block j is columns j*FINE..)
                tl.store(fine_max_ptr + (row * num_chunks + chunk) * NFINE + tl.arange(0, NFINE), fine_max)
            if (tl.load(top_k_ptr + row) >= vocab) & (chunk_max > float("-inf")):
                z = tl.sum(tl.sum(tl.exp(s - chunk_max), axis=1), axis=0)
                tl.store(chunk_z_ptr + row * num_chunks + chunk, z)


@triton.jit
def _bound_kernel(top_k_ptr, top_p_ptr, max_ptr, sub_max_ptr, fine_max_ptr, chunk_z_ptr, bound_ptr, vocab,
                  num_chunks, FAST: tl.constexpr, SUBS_PAD: tl.constexpr, FINES_PAD: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr, NSUB: tl.constexpr, NFINE: tl.constexpr, SUB: tl.constexpr,
                  FINE_BOUND: tl.constexpr):
    """One row: a lower bound on its cut from its `SUB`-column maxima, as an e value (0.0: no fast path). Top-k:
    the k-th largest maximum (k distinct tokens reach it, so the k-th largest token does); above half the row's
    `SUB`-column blocks, the k-th largest of the `FINE`-column maxima (0 past their number). Top-p alone: the
    largest maximum `b` with the mass of the maxima `>= b` at least `top_p * Z` (the tokens `>= b` hold at least
    that much, so the cut is not below `b`), with Z from the chunks' own sums (the exact Z is checked later)."""
    row = tl.program_id(0).to(tl.int64)
    bound = tl.zeros([], dtype=tl.float32)
    if FAST:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
        if ((top_k < vocab) | (top_p < 1.0)) & (top > float("-inf")):
            j = tl.arange(0, SUBS_PAD)
            m = tl.load(sub_max_ptr + row * num_chunks * NSUB + j, mask=j < num_chunks * NSUB, other=float("-inf"))
            e = tl.where(m > float("-inf"), tl.exp(m - top), -1.0)  # -1: counts toward nothing
            lo = tl.zeros([], dtype=tl.int32)
            # (bisections over the bit patterns: 31 reductions over registers measured 4x faster here than
            # ranking the maxima against each other in blocks read back from memory)
            if needs_fine(top_k, vocab, SUB, FINE_BOUND):
                f = tl.arange(0, FINES_PAD)
                fine = tl.load(fine_max_ptr + row * num_chunks * NFINE + f, mask=f < num_chunks * NFINE,
                               other=float("-inf"))
                lo = _largest_reaching(tl.where(fine > float("-inf"), tl.exp(fine - top), -1.0), top_k, lo, False)
            elif top_k < vocab:
                # the k-th largest maximum (0 when there are fewer than k maxima)
                lo = _largest_reaching(e, top_k, lo, False)
            else:
                target = top_p * row_z(max_ptr, chunk_z_ptr, row, num_chunks, top, CHUNKS_PAD)
                if tl.sum(tl.maximum(e, 0.0), axis=0) >= target:
                    lo = _largest_reaching(e, target, lo, True)  # the maxima at or above it hold the target
            bound = lo.to(tl.float32, bitcast=True)
    tl.store(bound_ptr + row, bound)


@triton.jit
def _gather_kernel(x_ptr, temp_ptr, top_k_ptr, max_ptr, sub_max_ptr, bound_ptr, count_ptr, slot_ptr, stride_x, vocab,
                   num_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr, CAP_CHUNK: tl.constexpr,
                   CHUNKS_PAD: tl.constexpr):
    """One chunk of a row with a bound: count its tokens with `e >= bound` and, when they fit, write their e values
    packed (in column order) to the chunk's slots. Only the `SUB` columns whose maximum reaches the bound are read.
    When too many reach it under a top-k of at most `CAP_CHUNK`, the chunk's own k-th largest (which the row's k-th
    largest cannot be below) drops the rest: the likely tokens crowding one chunk, as in a vocabulary ordered by
    frequency, leave the bound of the blocks' maxima loose."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bound = tl.load(bound_ptr + row)
    if bound > 0.0:
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
        count = tl.zeros([], dtype=tl.int32)
        if tl.exp(tl.load(max_ptr + row * num_chunks + chunk) - top) >= bound:
            cols = chunk * CHUNK + tl.arange(0, CHUNK)
            in_row = cols < vocab
            sub_max = tl.load(sub_max_ptr + row * num_chunks * (CHUNK // SUB) + cols // SUB, mask=in_row,
                              other=float("-inf"))
            live = in_row & (tl.exp(sub_max - top) >= bound)
            x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=float("-inf")).to(tl.float32)
            e = tl.where(live & (x > float("-inf")), tl.exp(tl.math.div_rn(x, tl.load(temp_ptr + row)) - top), 0.0)
            hit = e >= bound
            count = tl.sum(hit.to(tl.int32), axis=0)
            top_k = tl.load(top_k_ptr + row)
            if (count > CAP_CHUNK) & (top_k <= CAP_CHUNK):
                # this chunk's k-th largest (the bound's pattern qualifies: more than k reach it)
                chunk_kth = _largest_reaching(e, top_k, bound.to(tl.int32, bitcast=True), False)
                hit = e >= chunk_kth.to(tl.float32, bitcast=True)
                count = tl.sum(hit.to(tl.int32), axis=0)
            if count <= CAP_CHUNK:
                slot = tl.cumsum(hit.to(tl.int32), axis=0) - 1
                tl.store(slot_ptr + (row * num_chunks + chunk) * CAP_CHUNK + slot, e, mask=hit)
        tl.store(count_ptr + row * num_chunks + chunk, count)


@triton.jit
def row_z(max_ptr, chunk_z_ptr, row, num_chunks, top, CHUNKS_PAD: tl.constexpr):
    """The row's `sum(exp(s - top))`, from each chunk's sum relative to its own maximum (chunk order)."""
    c = tl.arange(0, CHUNKS_PAD)
    chunk_max = tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    z = tl.load(chunk_z_ptr + row * num_chunks + c, mask=chunk_max > float("-inf"), other=0.0)
    return tl.sum(z * tl.exp(tl.where(chunk_max > float("-inf"), chunk_max - top, 0.0)), axis=0)


@triton.jit
def _resolve_kernel(top_k_ptr, top_p_ptr, max_ptr, chunk_z_ptr, bound_ptr, count_ptr, slot_ptr, ends_ptr, done_ptr,
                    cut_ptr, vocab, num_chunks, CAP_CHUNK: tl.constexpr, CAP: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                    LOG_CHUNKS_PAD: tl.constexpr):
    """One row with a bound: both cuts from its gathered tokens (every token at or above the bound, so every token
    either cut keeps), sorted in registers. The k-th largest is the k-th of them. The top-p cut is the smallest
    kept token whose kept mass before it in that order is below `top_p * Z`. For tied tokens that mass counts part
    of their own group, but the group's first token, of the same value, counts none of it, so the cut is the
    register row's: the smallest kept value with less than that mass strictly above it. `done` says the row's
    cut is final; a row whose tokens did not fit, or whose bound the exact Z does not confirm, is left to the
    chunked search. (Ranking each token against all the others took 181-193 us a row at top-k 400 on the H200;
    the sort of 1,024 takes 7.5-8.2.)"""
    row = tl.program_id(0).to(tl.int64)
    done = tl.zeros([], dtype=tl.int32)
    cut = tl.zeros([], dtype=tl.float32)
    if tl.load(bound_ptr + row) > 0.0:
        c = tl.arange(0, CHUNKS_PAD)
        counts = tl.load(count_ptr + row * num_chunks + c, mask=c < num_chunks, other=0)
        total = tl.sum(counts, axis=0)
        if (tl.max(counts, axis=0) <= CAP_CHUNK) & (total <= CAP):
            # slot p of the packed row lies in the first chunk whose running count passes p: a binary search
            ends = ends_ptr + row * CHUNKS_PAD
            tl.store(ends + c, tl.cumsum(counts, axis=0))
            tl.debug_barrier()
            p = tl.arange(0, CAP)
            chunk_of = tl.zeros([CAP], dtype=tl.int32)
            for step in tl.static_range(LOG_CHUNKS_PAD):
                passed = tl.load(ends + chunk_of + (CHUNKS_PAD >> (step + 1)) - 1) <= p
                chunk_of = tl.where(passed, chunk_of + (CHUNKS_PAD >> (step + 1)), chunk_of)
            valid = p < total
            start_of = tl.where(chunk_of > 0, tl.load(ends + chunk_of - 1, mask=valid & (chunk_of > 0), other=0), 0)
            e = tl.load(slot_ptr + (row * num_chunks + chunk_of) * CAP_CHUNK + p - start_of, mask=valid, other=-1.0)
            e = tl.sort(e, descending=True)  # the `total` tokens (e > 0) first, the padding (-1) after them
            top_k = tl.load(top_k_ptr + row)
            top_p = tl.load(top_p_ptr + row)
            done = tl.full([], 1, dtype=tl.int32)
            if top_k < vocab:
                cut = tl.sum(tl.where(p == top_k - 1, e, 0.0), axis=0)
                done = (total >= top_k).to(tl.int32)
            if top_p < 1.0:
                kept = valid & (e >= cut)
                mass = tl.where(kept, e, 0.0)
                if top_k < vocab:
                    target = top_p * tl.sum(mass, axis=0)
                else:
                    top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
                    target = top_p * row_z(max_ptr, chunk_z_ptr, row, num_chunks, top, CHUNKS_PAD)
                    done = (tl.sum(mass, axis=0) >= target).to(tl.int32)  # the bound holds
                before = tl.cumsum(mass, axis=0) - mass
                cut = tl.maximum(cut, tl.min(tl.where(kept & (before < target), e, 2.0), axis=0))
            done = done & (cut <= 1.0).to(tl.int32)  # some token met each rule
    tl.store(done_ptr + row, done)
    tl.store(cut_ptr + row, cut)


@triton.jit
def _scaled_copy_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, done_ptr, s_ptr, stride_x, vocab,
                        CHUNK: tl.constexpr):
    """The tempered logits `x / T` of the rows the fast path left to the search, which its launches read."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if filters_on(top_k_ptr, top_p_ptr, row, vocab) & (tl.load(done_ptr + row) == 0):
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        tl.store(s_ptr + row * vocab + cols, tl.math.div_rn(x, tl.load(temp_ptr + row)), mask=in_row)


@triton.jit
def _search_step_kernel(s_ptr, top_k_ptr, top_p_ptr, max_ptr, part_in_ptr, part_out_ptr, state_in_ptr, state_out_ptr,
                        cut_ptr, z_ptr, done_ptr, vocab, num_chunks, MODE: tl.constexpr, FIRST: tl.constexpr,
                        RESOLVE_K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, S: tl.constexpr,
                        CHUNKS_PAD: tl.constexpr):
    """One narrowing step of one search for one row and the chunks `program_id(1)`, `+ num_programs(1)`, ...:
    narrow the row's interval by the last launch's totals (or start it), record it, and write each chunk's counts
    (top-k) or masses (top-p) at its candidates. RESOLVE_K (top-p's first launch): finish the top-k search first
    and record its cut in `cut`. A row the fast path finished returns at once, so a launch whose rows are all done
    costs one program per (row, chunk group), not per (row, chunk)."""
    row = tl.program_id(0).to(tl.int64)
    first_chunk = tl.program_id(1)
    if tl.load(done_ptr + row) != 0:
        return
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    k_cut = tl.zeros([], dtype=tl.int32)
    target = tl.zeros([], dtype=tl.float32)
    if MODE == 0:
        if top_k >= vocab:
            return
    else:
        if RESOLVE_K:
            if top_k < vocab:
                k_cut, _ = _narrow(part_in_ptr, state_in_ptr, row, num_chunks, top_k, target, 0, CHUNKS_PAD, S)
                if first_chunk == 0:
                    tl.store(cut_ptr + row, k_cut)
        if top_p >= 1.0:
            return
        if not RESOLVE_K:
            k_cut = tl.load(cut_ptr + row)
            c = tl.arange(0, CHUNKS_PAD)
            z = tl.sum(tl.load(z_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0), axis=0)
            target = top_p * z
    if FIRST:
        if MODE == 0:
            lo = tl.zeros([], dtype=tl.int32)  # count(e >= 0) counts every column: >= k
            hi = tl.full([], _BITS_OF_ONE + 1, dtype=tl.int32)  # nothing lies above 1.0
        else:
            lo = tl.full([], -1, dtype=tl.int32)  # "below 0": the whole mass, >= target
            hi = tl.full([], _BITS_OF_ONE, dtype=tl.int32)  # mass(e > 1.0) = 0 < target
    else:
        lo, hi = _narrow(part_in_ptr, state_in_ptr, row, num_chunks, top_k, target, MODE, CHUNKS_PAD, S)
    if first_chunk == 0:
        tl.store(state_out_ptr + row * 2, lo)
        tl.store(state_out_ptr + row * 2 + 1, hi)
    cand = _candidates(lo, hi, S)
    lo_f = tl.maximum(lo, 0).to(tl.float32, bitcast=True)
    hi_f = hi.to(tl.float32, bitcast=True)
    k_cut_f = k_cut.to(tl.float32, bitcast=True)
    thresholds = tl.maximum(cand, 0).to(tl.float32, bitcast=True)[:, None]  # [S, 1]; top-k's are never below 0
    top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
    for chunk in range(first_chunk, num_chunks, tl.num_programs(1)):
        inside = tl.zeros([S, SUB], dtype=tl.float32)
        above = tl.zeros([SUB], dtype=tl.float32)
        z_part = tl.zeros([SUB], dtype=tl.float32)
        for start in tl.static_range(0, CHUNK, SUB):
            cols = chunk * CHUNK + start + tl.arange(0, SUB)
            e, keep = _row_e(s_ptr, row, cols, vocab, top)
            # Only the elements inside [lo, hi] tell the candidates apart; those above add to every one of them.
            if MODE == 0:
                above += (e >= hi_f).to(tl.float32)
                window = tl.where((e >= lo_f) & (e < hi_f), e, -1.0)  # -1: below every candidate
                if tl.max(window, axis=0) >= 0.0:
                    inside += (window[None, :] >= thresholds).to(tl.float32)
            else:
                e = tl.where(keep & (e >= k_cut_f), e, 0.0)
                if FIRST:
                    z_part += e
                above += tl.where(e > hi_f, e, 0.0)
                window = tl.where((e >= lo_f) & (e <= hi_f), e, 0.0)  # 0: above no candidate
                if tl.max(window, axis=0) > 0.0:
                    inside += tl.where(window[None, :] > thresholds, window[None, :], 0.0)
        part = tl.sum(inside, axis=1) + tl.sum(above, axis=0)
        tl.store(part_out_ptr + (row * num_chunks + chunk) * S + tl.arange(0, S), part)
        if MODE == 1:
            if FIRST:
                tl.store(z_ptr + row * num_chunks + chunk, tl.sum(z_part, axis=0))


@triton.jit
def row_cut(top_k_ptr, top_p_ptr, part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, row, vocab, num_chunks,
            S: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """After the last search launch: the row's cut as an e value (keep e >= it; 0.0 keeps every finite logit)."""
    if tl.load(done_ptr + row) != 0:
        return tl.load(fast_cut_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    k_cut = tl.zeros([], dtype=tl.int32)
    p_cut = tl.zeros([], dtype=tl.int32)
    if (top_k < vocab) | (top_p < 1.0):
        k_cut = tl.load(cut_ptr + row)
        if top_p < 1.0:
            c = tl.arange(0, CHUNKS_PAD)
            z = tl.sum(tl.load(z_ptr + row * num_chunks + c, mask=c < num_chunks, other=0.0), axis=0)
            _, p_cut = _narrow(part_ptr, state_ptr, row, num_chunks, top_k, top_p * z, 1, CHUNKS_PAD, S)
    return tl.maximum(k_cut, p_cut).to(tl.float32, bitcast=True)


@triton.jit
def _apply_cuts_kernel(x_ptr, temp_ptr, top_k_ptr, top_p_ptr, max_ptr, part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr,
                       fast_cut_ptr, out_ptr,
                       stride_x, stride_o, vocab, num_chunks, CHUNK: tl.constexpr, SUB: tl.constexpr,
                       S: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Finish the top-p search and write the tempered logits with everything below either cut at -inf."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    active = filters_on(top_k_ptr, top_p_ptr, row, vocab)
    cut_f = row_cut(top_k_ptr, top_p_ptr, part_ptr, state_ptr, cut_ptr, z_ptr, done_ptr, fast_cut_ptr, row, vocab,
                    num_chunks, S, CHUNKS_PAD)
    temperature = tl.load(temp_ptr + row)
    top = tl.zeros([], dtype=tl.float32)
    if active:
        top = row_max(max_ptr, row, num_chunks, CHUNKS_PAD)
    for start in tl.static_range(0, CHUNK, SUB):
        cols = chunk * CHUNK + start + tl.arange(0, SUB)
        in_row = cols < vocab
        x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(x, temperature)
        keep = in_row & (x > float("-inf"))
        if active:
            keep = keep & (tl.exp(s - top) >= cut_f)
        tl.store(out_ptr + row * stride_o + cols, tl.where(keep, s, float("-inf")), mask=in_row)


class ChunkedSearch:
    """The buffers and launches of the chunked search over `[B, V]` logits; `run` leaves each filtering row's
    cuts in them for `row_cut` (the tempered top-k/top-p filter, or the fused draw of mstar_kernels/sampling.py).
    With `fast` (the default, `MSTAR_TOP_P_FAST`) the rows whose cut tokens can be gathered take the fast path
    and return from the search's launches at once."""

    def __init__(self, logits: torch.Tensor, fast: bool | None = None) -> None:
        num_rows, vocab = logits.shape
        self.logits, self.vocab = logits, vocab
        self.fast = FAST_PATH if fast is None else fast
        self.num_chunks = triton.cdiv(vocab, CHUNK)
        self.chunks_pad = max(2, triton.next_power_of_2(self.num_chunks))
        self.subs_pad = triton.next_power_of_2(self.num_chunks * (CHUNK // SUB))
        device, f32 = logits.device, torch.float32
        self.row_max = torch.empty((num_rows, self.num_chunks), dtype=f32, device=device)
        self.sub_max = torch.empty((num_rows, self.num_chunks * (CHUNK // SUB)), dtype=f32, device=device)
        self.fines_pad = triton.next_power_of_2(self.num_chunks * (CHUNK // FINE))
        self.fine_max = torch.empty((num_rows, self.num_chunks * (CHUNK // FINE)), dtype=f32, device=device)
        self.chunk_z = torch.empty((num_rows, self.num_chunks), dtype=f32, device=device)
        self.bound = torch.empty(num_rows, dtype=f32, device=device)
        self.counts = torch.empty((num_rows, self.num_chunks), dtype=torch.int32, device=device)
        self.slots = torch.empty((num_rows, self.num_chunks, FAST_CAP_CHUNK), dtype=f32, device=device)
        self.ends = torch.empty((num_rows, self.chunks_pad), dtype=torch.int32, device=device)
        self.done = torch.empty(num_rows, dtype=torch.int32, device=device)
        self.fast_cut = torch.empty(num_rows, dtype=f32, device=device)
        self.scaled = torch.empty((num_rows, vocab), dtype=f32, device=device)  # the search's rows' x / T
        self.parts = [torch.empty((num_rows, self.num_chunks, CANDIDATES), dtype=f32, device=device) for _ in range(2)]
        self.states = [torch.empty((num_rows, 2), dtype=torch.int32, device=device) for _ in range(2)]
        self.k_cut = torch.zeros(num_rows, dtype=torch.int32, device=device)  # top-k off: keep every e >= 0
        self.z = torch.empty((num_rows, self.num_chunks), dtype=f32, device=device)
        self.grid = (num_rows, self.num_chunks)
        self.search_grid = (num_rows, search_groups(num_rows, self.num_chunks, device))
        self.last = 0

    def run(self, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
            after_fast_path=None) -> None:
        """`after_fast_path(self)`, if given, runs after the fast path has marked the rows it finished (`done`) and
        may mark more (mstar_kernels/sampling.py draws some top-p rows by rejection there)."""
        x, num_rows = self.logits, self.logits.shape[0]
        common = dict(CHUNK=CHUNK, SUB=SUB, S=CANDIDATES, CHUNKS_PAD=self.chunks_pad, num_warps=8)
        _chunk_max_kernel[self.grid](x, temperature, top_k, top_p, min_p, self.row_max, self.sub_max, self.fine_max,
                                     self.chunk_z, x.stride(0), self.vocab, self.num_chunks, CHUNK=CHUNK, SUB=SUB,
                                     FINE=FINE, FINE_BOUND=FINE_BOUND, FAST=self.fast, num_warps=8)
        _bound_kernel[(num_rows,)](top_k, top_p, self.row_max, self.sub_max, self.fine_max, self.chunk_z, self.bound,
                                   self.vocab, self.num_chunks, FAST=self.fast, SUBS_PAD=self.subs_pad,
                                   FINES_PAD=self.fines_pad, CHUNKS_PAD=self.chunks_pad, NSUB=CHUNK // SUB,
                                   NFINE=CHUNK // FINE, SUB=SUB, FINE_BOUND=FINE_BOUND, num_warps=4)
        _gather_kernel[self.grid](x, temperature, top_k, self.row_max, self.sub_max, self.bound, self.counts,
                                  self.slots, x.stride(0), self.vocab, self.num_chunks, CHUNK=CHUNK, SUB=SUB,
                                  CAP_CHUNK=FAST_CAP_CHUNK, CHUNKS_PAD=self.chunks_pad, num_warps=8)
        _resolve_kernel[(num_rows,)](top_k, top_p, self.row_max, self.chunk_z, self.bound, self.counts, self.slots,
                                     self.ends, self.done, self.fast_cut, self.vocab, self.num_chunks,
                                     CAP_CHUNK=FAST_CAP_CHUNK, CAP=FAST_CAP, CHUNKS_PAD=self.chunks_pad,
                                     LOG_CHUNKS_PAD=self.chunks_pad.bit_length() - 1, num_warps=8)
        if after_fast_path is not None:
            after_fast_path(self)
        _scaled_copy_kernel[self.grid](x, temperature, top_k, top_p, self.done, self.scaled, x.stride(0), self.vocab,
                                       CHUNK=CHUNK, num_warps=8)
        launch, steps = 0, search_steps()
        for mode in (_TOP_K, _TOP_P):
            for step in range(steps):
                src, dst = launch % 2, (launch + 1) % 2
                _search_step_kernel[self.search_grid](self.scaled, top_k, top_p, self.row_max, self.parts[src],
                                                      self.parts[dst], self.states[src], self.states[dst], self.k_cut,
                                                      self.z, self.done, self.vocab, self.num_chunks, MODE=mode,
                                                      FIRST=step == 0, RESOLVE_K=mode == _TOP_P and step == 0,
                                                      **common)
                launch += 1
        self.last = launch % 2

    def cut_args(self) -> tuple:
        """row_cut's buffers, in its order after the two filter columns: parts, states, k cut, z, done, fast cut."""
        return self.parts[self.last], self.states[self.last], self.k_cut, self.z, self.done, self.fast_cut


def top_k_top_p_chunked(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        out: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                        fast: bool | None = None) -> torch.Tensor:
    """`top_k_top_p` by the chunked search, at any width (`top_k_top_p` takes it above `MAX_VOCAB`); with
    `temperature` `[B]` the logits are divided by it first (as torch divides); `fast=False` sends every row
    through the search's launches. Graph safe."""
    num_rows, vocab = logits.shape
    assert logits.stride(1) == 1 and top_k.shape == top_p.shape == (num_rows,)
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    if temperature is None:
        temperature = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    search = ChunkedSearch(logits, fast)
    search.run(temperature, top_k, top_p, torch.zeros_like(temperature))
    _apply_cuts_kernel[search.grid](logits, temperature, top_k, top_p, search.row_max, *search.cut_args(), out,
                                    logits.stride(0), out.stride(0), vocab, search.num_chunks, CHUNK=CHUNK, SUB=SUB,
                                    S=CANDIDATES, CHUNKS_PAD=search.chunks_pad, num_warps=8)
    return out


def top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sorted form (mstar_common/engine/sampler.py), the engine's host path."""
    from mstar_common.engine.sampler import apply_top_k_top_p

    return apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None])
