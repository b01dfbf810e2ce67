"""A captured step's inputs pulled from page-locked host memory, and its tokens pushed back there, inside the graph.

Served, each step used to put two copies on the stream around its replay: the step inputs host -> device before
it, the sampled tokens device -> host after it. Each is an operation of its own between two graphs, a few
microseconds of the GPU's time whatever its size. Here the graph's first kernel reads the inputs straight from the
host mirror (mapped, page-locked memory: the GPU reads it over the bus) into the static device buffers, and its
last kernel writes the tokens into a page-locked host array, so nothing runs on the stream between two replays.

The host fills one of two mirrors while the other may still be read, so each kernel takes the mirror (and the
token array) of the parity a device counter holds; the publishing kernel flips it at the end of the step. The host
keeps the same count (engine/cuda_graph.py `CudaGraphRunner`): both flip once per replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mstar_kernels._pdl import gdc_enter, pdl_launch

BLOCK = 1024  # int32 words per program


@triton.jit
def _pull_kernel(host_ptr, dev_ptr, parity_ptr, num_words, parity_stride, BLOCK: tl.constexpr,
                 USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    parity = tl.load(parity_ptr).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_words
    words = tl.load(host_ptr + parity * parity_stride + offs, mask=mask)
    tl.store(dev_ptr + offs, words, mask=mask)


@triton.jit
def _publish_kernel(tokens_ptr, host_ptr, parity_ptr, rows, parity_stride, ROWS: tl.constexpr,
                    USE_GDC: tl.constexpr):
    gdc_enter(USE_GDC)
    parity = tl.load(parity_ptr)
    i = tl.arange(0, ROWS)
    mask = i < rows
    tokens = tl.load(tokens_ptr + i, mask=mask)
    tl.store(host_ptr + parity.to(tl.int64) * parity_stride + i, tokens.to(host_ptr.dtype.element_ty), mask=mask)
    tl.store(parity_ptr, parity ^ 1)


def pull_inputs(host_pair: torch.Tensor, device: torch.Tensor, parity: torch.Tensor, num_words: int,
                rows: int = 1) -> None:
    """`device[:num_words] = host_pair[parity[0], :num_words]` (int32 words; `host_pair` `[2, N]`, page-locked on a
    GPU, `device` `[N]`); `rows`: the step's, for PDL. Graph safe."""
    assert host_pair.dim() == 2 and host_pair.shape[0] == 2 and host_pair.stride(1) == 1 and device.is_contiguous()
    assert host_pair.dtype == device.dtype and num_words <= min(host_pair.shape[1], device.numel())
    if num_words == 0:
        return
    programs = triton.cdiv(num_words, BLOCK)
    _pull_kernel[(programs,)](host_pair, device, parity, num_words, host_pair.stride(0), BLOCK=BLOCK, num_warps=4,
                              **pdl_launch(device, rows, programs))


def publish_tokens(tokens: torch.Tensor, host_pair: torch.Tensor, parity: torch.Tensor) -> None:
    """`host_pair[parity[0], :rows] = tokens`, then `parity[0] ^= 1` (one program: the flip follows every read of the
    parity in this step). Graph safe."""
    assert tokens.dim() == 1 and tokens.is_contiguous() and host_pair.dim() == 2 and host_pair.shape[0] == 2
    rows = tokens.numel()
    assert rows <= host_pair.shape[1]
    _publish_kernel[(1,)](tokens, host_pair, parity, rows, host_pair.stride(0),
                          ROWS=max(16, triton.next_power_of_2(max(rows, 1))), num_warps=1,
                          **pdl_launch(tokens, max(rows, 1), 1))
