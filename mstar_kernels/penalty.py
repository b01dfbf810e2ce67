"""HF's repetition penalty for a sampling step in one launch, and the sampled tokens recorded in one more.

engine/penalty.py keeps each penalised sequence's token history as a `seen` mask on the device, so that sampled
steps with the penalty replay captured graphs. Written with torch ops, a sampled step paid for the penalty on every
row, penalised or not: the fp32 copy of the logits, a gather of each row's mask row, and the compare, divide,
multiply and two selects, each a pass over `[rows, vocab]` (at Qwen3's 151,936 columns and 64 rows, 39 MB of fp32
a pass); then four launches to record the tokens. The engine keeps the history on the device on CUDA, so every
served sampled step paid that, where the greedy step applies the penalty as its argmax loads the logits
(mstar_kernels/argmax.py `penalised_argmax`). Served on the H200 (Qwen3-0.6B, 512/256, temperature 0.7, no row
penalised; docs/benchmarks.md, 2026-12-03), these two launches took the c=64 run from 2.79-2.84 to 2.64 ms of GPU
a step (greedy's: 2.61-2.64) and from 20,665 to 22,346 tok/s, and c=1 from 0.879 to 0.849 ms.

`penalised_logits` reads the logits in the model's dtype once and writes the penalised fp32 logits the sampler
reads: a row whose factor is 1.0 skips its mask row. The arithmetic is torch's (`logits.float()`, then where seen:
divided by the factor when positive, else multiplied, rounded as torch rounds), so the eager path, which calls it
too, and the captured step draw the same tokens. `record_seen` marks each row's token in its slot's mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch

BLOCK = 4096


@triton.jit
def penalise(x, seen_ptr, slot_ptr, factor_ptr, row, cols, mask, vocab):
    """These columns' fp32 logits `x` of `row` under HF's repetition penalty, rounded as torch rounds it: where the
    row's slot has seen the id, divided by the row's factor if positive, else multiplied. A row at factor 1.0 (the
    scratch slot of rows without the penalty) is left as it is (x / 1 == x * 1 == x) and its mask is not read."""
    factor = tl.load(factor_ptr + row)
    if factor != 1.0:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        seen = tl.load(seen_ptr + slot * vocab + cols, mask=mask, other=0) != 0
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, factor), x * factor), x)
    return x


@triton.jit
def _penalised_kernel(x_ptr, seen_ptr, slot_ptr, factor_ptr, out_ptr, stride_x, vocab, BLOCK: tl.constexpr,
                      USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * vocab + cols, penalise(x, seen_ptr, slot_ptr, factor_ptr, row, cols, mask, vocab),
             mask=mask)


@triton.jit
def _record_kernel(seen_ptr, slot_ptr, token_ptr, rows, vocab, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + r, mask=r < rows, other=0).to(tl.int64)
    token = tl.load(token_ptr + r, mask=r < rows, other=0).to(tl.int64)
    # Rows sharing a slot (the scratch slot of rows without the penalty) write the same byte.
    keep = (r < rows) & (token >= 0) & (token < vocab)
    tl.store(seen_ptr + slot * vocab + token, tl.full([BLOCK], 1, tl.uint8), mask=keep)


def _check(seen: torch.Tensor, slots: torch.Tensor, rows: int, vocab: int) -> None:
    assert seen.dtype == torch.uint8 and seen.dim() == 2 and seen.shape[1] == vocab and seen.is_contiguous()
    assert slots.shape == (rows,)


def penalised_logits(x: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """`x` `[B, V]` (any float dtype, unit column stride), `seen` uint8 `[S, V]`, `slots` `[B]` int, `factors` `[B]`
    fp32 -> fp32 `[B, V]`: where `seen[slots[row], col]`, the logit divided by `factors[row]` if positive, else
    multiplied; elsewhere the logit. Equal to engine/penalty.py's torch form. Graph safe."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [B, V] with unit column stride"
    rows, vocab = x.shape
    _check(seen, slots, rows, vocab)
    assert factors.shape == (rows,) and factors.dtype == torch.float32
    out = torch.empty((rows, vocab), dtype=torch.float32, device=x.device)
    if rows and vocab:
        programs = (rows, triton.cdiv(vocab, BLOCK))
        _penalised_kernel[programs](x, seen, slots, factors, out, x.stride(0), vocab, BLOCK=BLOCK, num_warps=8,
                                    **pdl_launch(x, rows, programs[0] * programs[1]))
    return out


def record_seen(seen: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor) -> None:
    """`seen[slots[row], tokens[row]] = 1` for every row (a token outside `[0, V)` is skipped). Graph safe."""
    rows = tokens.shape[0]
    _check(seen, slots, rows, seen.shape[1])
    if rows:
        block = max(16, min(1024, triton.next_power_of_2(rows)))
        _record_kernel[(triton.cdiv(rows, block),)](seen, slots, tokens, rows, seen.shape[1], BLOCK=block, num_warps=1,
                                                    **pdl_launch(tokens, rows, 1))
