"""Row argmax over a vocabulary, in two short launches: the greedy token of a decode step.

torch's `argmax(dim=-1)` reduces a row in one thread block: on the H200 it takes 28 us for one row of
Llama-3's 128,256 logits, more than a layer's attention (scripts/profile_decode_step.py, 2026-12-01). Here
each program reduces a `BLOCK` chunk of a row to its maximum and that maximum's first index, and a second
kernel picks, per row, the first chunk holding the row's maximum. The result is torch's: the lowest index of
the maximum (ties go left in both steps, and chunks are in column order); a row of -inf gives 0.

`gumbel_argmax` is the sampling draw (mstar_kernels/sampling.py): the argmax of `logits + Gumbel(seed_row, col)`, an
exponential race whose winner is a draw from softmax(logits). The noise is added on load, so the noised
`[B, V]` fp32 logits are never written; a token depends only on (seed, column, logits).

`penalised_argmax` is the greedy token under the repetition penalty (engine/penalty.py): the penalty is applied on
load and the chosen token recorded in the second launch, instead of ~10 elementwise launches over the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch
from mstar_kernels.penalty import penalise

BLOCK = 4096


@triton.jit
def gumbel_noise(seed, start, N: tl.constexpr):
    """Gumbel(0, 1) noise for the `N` columns from `start` (both multiples of 4), from a counter-based RNG keyed by
    the row's seed: column c takes output `c % 4` of Philox at counter `c // 4`, so one Philox call (ten rounds of
    multiplies, most of a draw's work) serves four columns. A column's noise depends on (seed, column) only."""
    u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + tl.arange(0, N // 4))
    u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), [N])  # [q, r, s] -> column 4q + 2r + s
    u = tl.maximum(u, 1.1754943508222875e-38)
    return -tl.log(-tl.log(u))


@triton.jit
def _chunk_max_kernel(x_ptr, seed_ptr, seen_ptr, slot_ptr, factor_ptr, val_ptr, idx_ptr, stride_x, vocab,
                      num_chunks, GUMBEL: tl.constexpr, PENALTY: tl.constexpr, BLOCK: tl.constexpr,
                      USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
    if PENALTY:  # HF's repetition penalty on the ids the row's slot has seen (mstar_kernels/penalty.py)
        x = penalise(x, seen_ptr, slot_ptr, factor_ptr, row, cols, mask, vocab)
    if GUMBEL:
        x = tl.where(mask, x + gumbel_noise(tl.load(seed_ptr + row), chunk * BLOCK, BLOCK), float("-inf"))
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, value)
    tl.store(idx_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _pick_chunk_kernel(val_ptr, idx_ptr, out_ptr, seen_ptr, slot_ptr, num_chunks, vocab, CHUNKS_PAD: tl.constexpr,
                       RECORD: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    values = tl.load(val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(idx_ptr + row * num_chunks + best).to(tl.int64)
    tl.store(out_ptr + row, token)
    if RECORD:  # the slot has now seen this token (rows sharing the scratch slot write the same byte)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.store(seen_ptr + slot * vocab + token, tl.full((), 1, tl.uint8))


def _launch(x: torch.Tensor, seeds: torch.Tensor | None, penalty=None, out: torch.Tensor | None = None) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [B, V] with unit column stride"
    rows, vocab = x.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=x.device)
    assert out.shape == (rows,) and out.dtype in (torch.int32, torch.int64) and out.stride(0) == 1 \
        and out.device == x.device, "out must be [B] int32 or int64, contiguous, on x's device"
    if rows == 0 or vocab == 0:
        return out.zero_()
    seen, slots, factors = penalty if penalty is not None else (x, x, x)
    if penalty is not None:
        assert seen.dtype == torch.uint8 and seen.dim() == 2 and seen.shape[1] == vocab and seen.is_contiguous()
        assert slots.shape == (rows,) and factors.shape == (rows,) and factors.dtype == torch.float32
    num_chunks = triton.cdiv(vocab, BLOCK)
    values = torch.empty((rows, num_chunks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, num_chunks), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows, num_chunks)](x, seeds if seeds is not None else x, seen, slots, factors, values,
                                          indices, x.stride(0), vocab, num_chunks, GUMBEL=seeds is not None,
                                          PENALTY=penalty is not None, BLOCK=BLOCK, num_warps=8,
                                          **pdl_launch(x, rows, rows * num_chunks))
    _pick_chunk_kernel[(rows,)](values, indices, out, seen, slots, num_chunks, vocab,
                                CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), RECORD=penalty is not None,
                                num_warps=1, **pdl_launch(x, rows, rows))
    return out


def row_argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x.argmax(dim=-1)` for `[B, V]` (int64, first index of the maximum). Graph safe. `out` (`[B]` int32 or int64):
    the tokens are stored there, and it is returned (a decode graph's token buffer, without a copy after)."""
    return _launch(x, None, out=out)


def penalised_argmax(x: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor, factors: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy token of each row of `x` `[B, V]` under HF's repetition penalty, recorded: where
    `seen[slots[row], col]` (uint8 `[S, V]`) the logit is divided by `factors[row]` if positive, else multiplied
    (in fp32, rounded as torch's division rounds); then the row's argmax, as `row_argmax`; then
    `seen[slots[row], token] = 1`. The same tokens and mask as `PenaltyState.apply` + argmax + `record`, in the
    two launches of the plain argmax. Graph safe. `out` as `row_argmax`'s."""
    return _launch(x, None, (seen, slots, factors), out)


def gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`(logits + gumbel_noise(seed_row, col)).argmax(-1)` without the noised copy. Graph safe."""
    assert seeds.shape == (logits.shape[0],)
    return _launch(logits, seeds)

