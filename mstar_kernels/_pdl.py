"""Programmatic Dependent Launch (PDL) for the decode-step kernels, on GPUs of compute capability >= 9.0.

A kernel launched with PDL may start while the kernel before it in the stream still runs. It must call
`gdc_wait()` before it reads anything that kernel writes (or writes anything it reads); what it does before the
wait may only touch memory no unfinished kernel writes: here, a projection's weights, which the GEMV loads
before it waits (mstar_kernels/gemv.py), and a step's inputs (positions, slots, lengths) and older KV. After its
own wait each kernel calls `gdc_launch_dependents()`, so the next one can start its prologue at once; then at most
two kernels overlap: the next one's wait returns only when this one has finished and its writes are visible. The
kinds named in `MSTAR_PDL_AHEAD_OF` (`ahead_of`; by default the attention prologue and the o, gate_up and down
projections) trigger before their wait instead, so a third kernel can be loading ahead of its own wait.

`scripts/probe_pdl.py` on the H200 (2026-12-01): 28 layers of RMSNorm + two 8 MB projections at one row
(84 kernels in a CUDA graph) took 358 us, 338 us with PDL, 263 us with PDL and the weight prefetch; the same bits.

PDL pays where a step is a chain of the shortest kernels. A Qwen3-0.6B decode step replayed on the H200
(`scripts/profile_decode_step.py`, 2026-12-01, replay ms without -> with PDL on every launch): 1 row
1.019 -> 0.905 (1.037 -> 0.868 in another run), 2 rows 1.157 -> 1.208, 4 1.370 -> 1.388, 8 1.481 -> 1.590,
16 1.695 -> 1.871, 64 2.432 -> 2.556. Measured again in one process after the chained GEMV tuning
(`scripts/ab_decode_step.py`, 2026-12-02, PDL at 1 row -> at every row count): 2 rows 1.107 -> 1.018, 4 rows
1.295 -> 1.295, 8 1.398 -> 1.412, 16 1.595 -> 1.626, 64 2.339 -> 2.307. So launches of more than
`MSTAR_PDL_MAX_ROWS` rows (tokens; default 2) go without it. `MSTAR_PDL=0` turns it off. A kernel whose wrapper
does not pass `**pdl_launch(tensor, rows, programs)` launches as before. The switches are read in
mstar_common/pdl_switches.py (no Triton there, so the GEMV cache can key settings by them) and re-exported here.

`MSTAR_PDL_TRIGGER=fit` (default `early`) lets a kernel trigger the next one early only when its grid fits on the
SMs at once. In the same A/B, with PDL at every row count, `fit` against `early`: 1 row +6.7% (the GEMVs' grids
are deeper than the SMs, so they lose the early start), 2 rows +5.7%, 4 +2.7%, 8 -1.4%, 16 -2.9%, 64 +1.7%; its
best, 16 rows at 1.578 ms, is 1.0% under the default's 1.595. Kept as a switch for such A/Bs.

`MSTAR_PDL_TRIGGER=ahead` triggers before the wait instead, so more than two kernels can overlap: each launches as
soon as every program of the one before it has started, and the GEMVs' weight loads (ahead of their waits) can run
several kernels ahead of the chain. `scripts/probe_pdl_depth.py` on the H200 (2026-12-02): 12 kernels of 132
programs all started within 5 us (3 at once with 1,024 programs each). In the one-row Qwen3-0.6B step it was within
1% of `early` (0.8181 -> 0.8137 ms; gate_up's link shorter, the split attention's longer), 7% slower at two rows and
0.8% slower for Llama-3.2-3B, so it stays a switch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mstar_common.pdl_switches import (  # noqa: F401 (the switches, re-exported: kernels read them from here)
    DEFAULT_AHEAD_OF,
    TRIGGER_MODES,
    ahead_of,
    applies,
    enabled,
    max_rows,
    skipped,
    trigger_mode,
)


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(tensor: torch.Tensor, rows: int) -> bool:
    """Whether a kernel of `rows` rows on `tensor`'s device launches with PDL (a Hopper-or-newer GPU, `MSTAR_PDL`
    not 0, at most `MSTAR_PDL_MAX_ROWS` rows or a row count added by `pdl_switches.add_rows`)."""
    if not tensor.is_cuda or not enabled() or not applies(rows):
        return False
    return _supported(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_launch(tensor: torch.Tensor, rows: int, programs: int | None = None, kind: str | None = None) -> dict:
    """Launch keywords for a kernel of `rows` rows (and `programs` programs) with a `USE_GDC` constexpr: `USE_GDC`
    (0: no PDL; 1: wait, then trigger the next kernel; 2: wait only; 3: trigger the next kernel, then wait) and
    Triton's `launch_pdl`. `kind` names the kernel for `MSTAR_PDL_AHEAD_OF`."""
    if not use_pdl(tensor, rows) or kind is not None and kind in skipped():
        return {"USE_GDC": 0}
    mode = trigger_mode()
    if mode == "ahead" or (mode == "early" and kind is not None and kind in ahead_of()):
        return {"USE_GDC": 3, "launch_pdl": True}
    deep = programs is not None and mode == "fit" and programs > _num_sms(tensor.device)
    return {"USE_GDC": 2 if deep else 1, "launch_pdl": True}


@triton.jit
def gdc_start(USE_GDC: tl.constexpr):
    """Under `ahead` (USE_GDC 3), let the kernel after this one start now; a kernel that calls this first (before
    work ahead of its wait) then enters with `gdc_enter(USE_GDC, True)`."""
    if USE_GDC == 3:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr, STARTED: tl.constexpr = False):
    """Wait for the kernel before this one and let the kernel after this one start, in the order USE_GDC says (a
    no-op without PDL). `STARTED`: `gdc_start` already let it start."""
    if USE_GDC:
        if USE_GDC == 3 and not STARTED:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if USE_GDC == 1:
            tl.extra.cuda.gdc_launch_dependents()
