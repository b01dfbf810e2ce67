"""The serving components' environment switches (docs/deployment.md), all checked when any model loads
(backends/node_setup.py `load_node`) and again when an autoregressive engine is built (one environment serves a
whole deployment).

Most of them are read where they act: at each launch, so at a graph's capture, or at a step of some row count. A
misspelt value would then fail only there: on the CPU, or without captured graphs, at a user's request. The
engine instead reads every one of them when it is built, through the same parser the code uses, so the model is
refused at load with each bad switch named beside its rule (`check_switches`). Kernel switches are checked where
Triton imports (elsewhere their kernels never run). `MSTAR_DECODE_FORM` is already read at load (when
mstar_common/engine/attention.py is imported). `mstar serve` calls `check_switches` too, before it starts anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mstar_common.config import env_switch

# `0`/`1` switches read with `env_switch(name, default)`, and their defaults (tests/unit/test_switches.py keeps this
# list in step with the code's calls)
BOOLEAN_SWITCHES = {
    "MSTAR_PDL": True,
    "MSTAR_GEMV_HEADS": True,
    "MSTAR_GEMV_WIDE": True,
    "MSTAR_GEMV_STEP_PLANS": True,
    "MSTAR_GEMV_CHAINED": True,
    "MSTAR_GEMV_NORM_ONE_READ": True,
    "MSTAR_EMBED_KERNEL": True,
    "MSTAR_READBACK_NATIVE": True,
    "MSTAR_ZERO_COPY_STEP_IO": True,
    "MSTAR_STEP_TIMES": False,
    "MSTAR_PUMP_FIRST_LAST": True,
    "MSTAR_PARALLEL_COMPILE": False,
    "MSTAR_ENGINE_PROCESS": False,
    "MSTAR_REQUIRE_ACCELERATOR_GRAPHS": False,
    "MSTAR_DECODE_PREFETCH": True,
    "MSTAR_DECODE_PREFETCH_ANY_GRID": False,
    "MSTAR_DECODE_PREFETCH_L2": False,
    "MSTAR_PROLOGUE_AHEAD": True,
    "MSTAR_TOP_P_REJECT": True,
    "MSTAR_TOP_P_KERNEL": True,
    "MSTAR_TOP_P_FAST": True,
    "MSTAR_TOP_K_FINE": True,
    "MSTAR_DENOISE_EXACT_BATCHES": True,
    "MSTAR_DIFFUSION_KERNELS": True,
    "MSTAR_FP8_FP16_DOTS": False,
    "MSTAR_SNAC_RESIDUAL_KERNEL": False,
    "MSTAR_SNAC_CUDNN_DEPTHWISE": False,
    "MSTAR_TIMINGS": False,
    "MSTAR_GC_FREEZE": True,
    "MSTAR_ALLOW_REMOTE": False,
}


def _engine_process_on() -> bool:
    """MSTAR_ENGINE_PROCESS (a bad value is refused by the boolean loop already: not named twice)."""
    from mstar_common.engine import engine_process

    try:
        return engine_process.enabled()
    except ValueError:
        return False


def _parsers() -> list[Callable[[], object]]:
    """The parsers of the switches that take more than 0 or 1, as the code calls them."""
    from mstar_common import config, gc_policy, gil, images, native_backtrace, pdl_switches, stall_watch
    from mstar_common.diffusion import attention as dit_attention
    from mstar_common.engine import engine_process, flashinfer_backend, output_pump
    from mstar_common.layers import decoder, linear

    parsers = [gil.switch_interval_s, dit_attention.sdpa_backends, stall_watch.stall_exit_s, stall_watch.stack_dump_s,
               pdl_switches.max_rows, pdl_switches.trigger_mode, linear.mid_gemm_rows,
               linear.mid_gemm_kinds, linear.mid_gemm_folds, linear.gemv_max_rows, linear.forced_gemv_settings,
               decoder.fused_mlp_rows, decoder.fused_mlp_options, decoder.norm_gemv_mode,
               flashinfer_backend.prefill_kernel_family, output_pump.pump_shards, images.png_encoder,
               gc_policy.gc_log_ms, config.bls_hold_s, native_backtrace.library_path,
               lambda: engine_process.chosen_python() if _engine_process_on() else None]
    try:
        import triton  # noqa: F401
    except ImportError:
        return parsers
    from mstar_kernels import paged_decode_attention, paged_prefill_attention, top_k_top_p

    return parsers + [lambda: paged_decode_attention.decode_num_stages(1, 1, 1),
                      lambda: paged_decode_attention.rope_in_attention(1),
                      paged_prefill_attention.prefill_form,
                      lambda: top_k_top_p.search_groups(1, 1, torch.device("cpu"))]  # asks no GPU anything


def check_switches(model: torch.nn.Module | None = None) -> None:
    """Read every switch above; raise one ValueError naming each refused value and its rule. With the `model`,
    also warn of each kernel kind named in `MSTAR_PDL_AHEAD_OF` or `MSTAR_PDL_SKIP` that none of its layers
    launches (a warning: in a deployment of several models it may name another model's kernel)."""
    problems = []
    if model is not None:
        from mstar_common import pdl_switches

        names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear)}
        for item in pdl_switches.unknown_kinds(names):
            logging.getLogger(__name__).warning(
                "%s names no kernel of %s (its kinds: %s, mid:<projection>, gemv:NxK)", item, type(model).__name__,
                ", ".join(sorted(pdl_switches.FIXED_KINDS | names)))
    for name, default in BOOLEAN_SWITCHES.items():
        try:
            env_switch(name, default)
        except ValueError as exc:
            problems.append(str(exc))
    try:
        parsers = _parsers()
    except ValueError as exc:  # a kernel module reads its 0/1 switches at import: refused above already
        parsers = []
        if str(exc) not in problems:
            problems.append(str(exc))
    for parse in parsers:
        try:
            parse()
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("environment switches refused (docs/deployment.md): " + "; ".join(problems))
