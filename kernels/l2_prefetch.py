"""Weights into the L2 cache ahead of the kernels that read them, from a side stream (GPUs of compute
capability >= 9.0).

A one-row decode step reads each weight once, in ~270 short kernels. The GEMVs stream at most a few MB each and
the kernels between them (norms, the attention prologue and split-K attention) leave HBM mostly idle. So, at the
start of each decoder layer, a tiny kernel on a second stream asks the memory system to bring the weights the
layer will read next into L2 (`cp.async.bulk.prefetch.L2`: one instruction per `CHUNK` bytes, fire and forget),
while the layer's own kernels run on the main stream. Prefetching never changes a value: a step computes the
same bits with it or without it.

`prefetch_ranges` covers byte ranges with equal chunks (a range's last chunk ends at the range's end, so it may
overlap the one before it); `L2Prefetcher` launches one layer's chunks on the side stream, forked from the
main stream and joined back at the end of the step, which works eagerly and inside CUDA graph capture alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32768  # bytes per prefetch instruction
BLOCK = 128  # instructions per program


@triton.jit
def _bulk_prefetch_kernel(addr_ptr, sink_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    addr = tl.load(addr_ptr + offs)
    done = tl.inline_asm_elementwise(
        f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK};\n\tmov.u32 $0, 0;",
        "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1,
    )
    tl.store(sink_ptr + offs, done, mask=done != 0)  # never stores; keeps the prefetches live


def chunk_addresses(ranges: list[tuple[int, int]], chunk: int = CHUNK, block: int = BLOCK) -> list[int]:
    """Start addresses of `chunk`-byte pieces covering each `(address, nbytes)` range, padded (by repeating the
    last) to a multiple of `block`. A range of at least `chunk` bytes ends exactly at its end; a smaller one is
    skipped (not worth an instruction, and a whole chunk would run past it)."""
    starts: list[int] = []
    for address, nbytes in ranges:
        if address % 16 or nbytes % 16:
            raise ValueError(f"prefetch range ({address:#x}, {nbytes}) is not 16-byte aligned")
        if nbytes < chunk:
            continue
        last = address + nbytes - chunk
        starts += range(address, last, chunk)
        starts.append(last)
    if starts and len(starts) % block:
        starts += [starts[-1]] * (block - len(starts) % block)
    return starts


def tensor_range(tensor: torch.Tensor) -> tuple[int, int]:
    if not tensor.is_contiguous():
        raise ValueError("only contiguous tensors can be prefetched")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


class L2Prefetcher:
    """Per-slot prefetch lists (a slot: one decoder layer's upcoming weights) and the side stream they run on."""

    def __init__(self, slots: list[list[torch.Tensor]], device: torch.device) -> None:
        self.device = device
        self._addresses = []
        for tensors in slots:
            starts = chunk_addresses([tensor_range(t) for t in tensors])
            self._addresses.append(torch.tensor(starts, dtype=torch.int64, device=device) if starts else None)
        self._sink = torch.zeros(BLOCK, dtype=torch.int32, device=device)
        self._stream = torch.cuda.Stream(device)
        self._forked = False
        self.nbytes = [0 if a is None else a.numel() * CHUNK for a in self._addresses]

    def __len__(self) -> int:
        return len(self._addresses)

    def issue(self, slot: int) -> None:
        """Launch slot `slot`'s prefetches on the side stream, after everything queued so far on the current one."""
        addresses = self._addresses[slot]
        if addresses is None:
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            _bulk_prefetch_kernel[(addresses.numel() // BLOCK,)](addresses, self._sink, CHUNK=CHUNK, BLOCK=BLOCK)
        self._forked = True

    def join(self) -> None:
        """Make the current stream wait for the side stream (required before a graph capture ends)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._forked = False
