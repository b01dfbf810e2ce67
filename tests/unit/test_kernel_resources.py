"""Registers, spills and instruction order of decode kernels as Triton compiles them for a Hopper GPU (sm_90), on
the CPU: Triton compiles ahead of time for a named target with the ptxas and cuobjdump it ships
(scripts/probe_kernel_resources.py). Skipped where that Triton is not installed (a CUDA build of torch brings its
own; scripts/setup.sh installs one on a CPU)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _probe():
    from triton.backends import backends

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if os.environ.get("TRITON_INTERPRET") == "1" or "nvidia" not in backends or not cuobjdump.exists():
        pytest.skip("Triton interpreting, or without its NVIDIA backend and bundled cuobjdump")
    path = Path(__file__).parents[2] / "scripts" / "probe_kernel_resources.py"
    spec = importlib.util.spec_from_file_location("probe_kernel_resources", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_split_attention_forms_hold_what_the_prefetch_rule_assumes():
    """The form that holds its first block across the PDL wait must still fit `PREFETCH_PROGRAMS_PER_SM` programs an
    SM (the rule's constant), and fewer than the plain form (else the rule costs nothing to drop); the form that
    asks L2 for the block must hold as many as the plain form, its `prefetch.global.L2` (two a thread: 64 tokens
    x 2 lines x K and V over 128 threads) all ahead of the one `griddepcontrol.wait`."""
    from mstar_kernels.paged_decode_attention import PREFETCH_PROGRAMS_PER_SM

    probe = _probe()
    fits, kernel = [], None
    for prefetch, prefetch_l2 in ((False, False), (True, False), (False, True)):
        kernel = probe.compile_split(2, 128, 64, 16, 4, 2, prefetch, prefetch_l2)
        used = probe.resources(kernel)
        assert used["stack"] == 0, (prefetch, prefetch_l2, used)
        fits.append(probe.ctas_per_sm(used["registers"], 4, used["shared"])["ctas"])
    assert fits[1] >= PREFETCH_PROGRAMS_PER_SM, fits
    assert fits[0] > fits[1], f"the plain form should hold more programs an SM: {fits}"
    assert fits[2] == fits[0], f"the L2 form should hold as many programs an SM as the plain form: {fits}"
    ptx = [line.strip() for line in kernel.asm["ptx"].splitlines()]  # the L2 form's, compiled last
    asked = [i for i, line in enumerate(ptx) if line.startswith("prefetch.global.L2")]
    waits = [i for i, line in enumerate(ptx) if line.startswith("griddepcontrol.wait")]
    assert len(asked) == 2 and len(waits) == 1 and max(asked) < waits[0], (asked, waits)


@pytest.mark.parametrize("rows", [8, 32, 64])
def test_mid_gemm_forms_that_compute_on_their_loads_do_not_spill(rows):
    """The normed and SwiGLU forms of the tens-of-rows GEMM, asked for Qwen3-0.6B's 256 columns of K and 3 stages
    (run at `FOLD_BLOCK_K` columns and `fold_stages`' stages, as launched), compile without spilling registers and
    within an SM's shared memory. At 256 columns they spilled from 32 rows (Triton 3.6)."""
    probe = _probe()
    for form in ("norm", "swiglu"):
        kernel = probe.compile_mid_gemm(rows, 32, 256, 1, 4, 3, form)
        used = probe.resources(kernel)
        assert used["stack"] == 0, (form, used)
        assert probe.ctas_per_sm(used["registers"], 4, used["shared"])["ctas"] >= 1, (form, used)


@pytest.mark.parametrize("group", [2, 3])
def test_grouped_prefill_at_its_default_launch_fits_as_the_plain_form_does(group):
    """The grouped prefill attention as launched by default (`GROUPED_HEADS`, one query head a program, and
    `grouped_launch`'s 64 keys, 4 warps, 2 stages; pages of 64): dots on Hopper's warpgroup MMA, no spills, and at
    least as many programs an SM as the plain form at the same launch."""
    from mstar_kernels.paged_prefill_attention import BLOCK_N, GROUPED_HEADS, grouped_launch

    probe = _probe()
    block_n, warps, stages = grouped_launch(GROUPED_HEADS)
    assert GROUPED_HEADS == 1 and (block_n, warps, stages) == (BLOCK_N, 4, 2)
    fits = []
    for heads in (GROUPED_HEADS, 0):  # 0: the plain form
        kernel = probe.compile_prefill(group, 128, block_n, 64, warps, stages, heads)
        used = probe.resources(kernel)
        assert used["stack"] == 0 and "wgmma" in kernel.asm["ptx"], used
        fits.append(probe.ctas_per_sm(used["registers"], warps, used["shared"])["ctas"])
    assert fits[0] >= fits[1] >= 1, fits


@pytest.mark.parametrize("group", [2, 3])
def test_grouped_prefill_of_two_heads_a_program_keeps_two_programs_an_sm(group):
    """The grouped prefill attention with two query heads a program (`grouped_heads`, 128 rows, `grouped_launch`):
    dots on Hopper's warpgroup MMA, no spills, and two programs an SM, as many warps as the plain form's default
    (Triton 3.6: 115-127 registers at 8 warps and 3 stages; 2 stages would take 139 for a group of 3, 64 keys a
    block 161-170: one program)."""
    from mstar_kernels.paged_prefill_attention import BLOCK_N, grouped_heads, grouped_launch

    probe = _probe()
    heads = grouped_heads(group)
    block_n, warps, stages = grouped_launch(heads)
    assert heads * 64 == 128 and (block_n, warps, stages) == (32, 8, 3)
    fits = []
    for kernel, launch_warps in ((probe.compile_prefill(group, 128, block_n, 64, warps, stages, heads), warps),
                                 (probe.compile_prefill(group, 128, BLOCK_N, 64, 4, 2, 0), 4)):
        used = probe.resources(kernel)
        assert used["stack"] == 0 and "wgmma" in kernel.asm["ptx"], used
        fits.append(probe.ctas_per_sm(used["registers"], launch_warps, used["shared"])["ctas"])
    assert fits[0] >= 2 and fits[0] * warps >= fits[1] * 4, fits
