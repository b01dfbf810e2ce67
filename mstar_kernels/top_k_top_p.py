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

The kept sets equal the sorted form's except where a sum lands within rounding of `top_p` (the two add in
different orders) or at exact ties across the cut (the sorted form keeps some of the tied tokens, this keeps
all). `sample_on_device` uses it for windows of up to `MAX_VOCAB` (`MSTAR_TOP_P_KERNEL=0` restores the sort;
H200 timings in docs/deployment.md "Kernel switches").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_VOCAB = 32768
_BITS_OF_ONE = tl.constexpr(0x3F800000)  # 1.0f; every e = exp(logit - max) lies in [0, 1]


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
        # the k-th largest e: the largest bit pattern b with count(e >= float(b)) >= k
        lo = tl.zeros([], dtype=tl.int32)  # count(e >= 0) = vocab >= k
        hi = tl.full([], _BITS_OF_ONE + 1, dtype=tl.int32)  # count(e >= above 1.0) = 0 < k
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            enough = tl.sum((e >= mid.to(tl.float32, bitcast=True)).to(tl.int32), axis=0) >= top_k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        keep = keep & (e >= lo.to(tl.float32, bitcast=True))
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
    """`logits` `[B, V]` fp32 (V <= 32,768), `top_k` `[B]` int (V: off), `top_p` `[B]` float (1.0: off) ->
    the logits with the filtered-out entries at -inf. Graph safe: no host reads."""
    num_rows, vocab = logits.shape
    assert vocab <= MAX_VOCAB, f"the register-resident filter takes at most {MAX_VOCAB} logits per row"
    assert logits.stride(1) == 1 and top_k.shape == top_p.shape == (num_rows,)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(vocab)
    _top_k_top_p_kernel[(num_rows,)](logits, top_k, top_p, out, logits.stride(0), out.stride(0), vocab,
                                     BLOCK=block, num_warps=max(4, min(16, block // 2048)))
    return out


def top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The sorted form (mstar_common/engine/sampler.py), the engine's host path."""
    from mstar_common.engine.sampler import apply_top_k_top_p

    return apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None])
