"""The previous step's sampled tokens into this step's input ids, inside the captured step.

With overlap the host launches step N+1 before it has read step N's tokens, so each decode row's newest input id
is a placeholder that the device fills from step N's output. Done eagerly before the replay, that fill is three
torch launches (two gathers and a scatter) outside the graph. Here it is one launch inside it: the number of rows
to fill is a device value the host writes with the other step inputs, so one captured graph serves any count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_tokens_kernel(ids_ptr, dst_ptr, src_ptr, count_ptr, prev_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    mask = i < tl.load(count_ptr)
    dst = tl.load(dst_ptr + i, mask=mask, other=0)
    src = tl.load(src_ptr + i, mask=mask, other=0)
    token = tl.load(prev_ptr + src, mask=mask, other=0)
    tl.store(ids_ptr + dst, token.to(ids_ptr.dtype.element_ty), mask=mask)


def gather_tokens(input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, count: torch.Tensor,
                  previous: torch.Tensor) -> None:
    """`input_ids[dst[i]] = previous[src[i]]` for `i < count[0]`; `dst`/`src` hold at least that many entries.
    Graph safe (no host read of `count`)."""
    assert dst.shape == src.shape and count.numel() == 1
    block = max(16, triton.next_power_of_2(dst.numel()))
    _gather_tokens_kernel[(1,)](input_ids, dst, src, count, previous, BLOCK=block, num_warps=4)
