"""The Programmatic Dependent Launch switches (mstar_kernels/_pdl.py has the launches and what they measured),
readable without Triton: the GEMV cache keys its step-timed settings by them (`signature`)."""

from __future__ import annotations

import os
import re

from mstar_common.config import env_switch


def enabled() -> bool:
    return env_switch("MSTAR_PDL", True)


MID_GEMM_PDL_ROWS = 64  # PDL's default rows with MSTAR_MID_GEMM=all or kinds (mstar_common/layers/linear.py)


def max_rows() -> int:
    """`MSTAR_PDL_MAX_ROWS`: launches of at most this many rows go with PDL. Default 2; with `MSTAR_MID_GEMM` at
    `all` or kinds, 64, so that steps of 5-64 rows, whose projections then run on Triton kernels, run their whole
    chain under PDL (`MSTAR_MID_GEMM=auto`, the default, adds the row counts it chose instead: `add_rows`).
    On the H200 that is what made them faster (Qwen3-0.6B, 8 rows: 1.345 -> 1.199 ms; 64 rows, since the decode
    attention's prefetch rule of 2026-12-04: 2.339 -> 2.207 ms, docs/benchmarks.md 2026-12-05)."""
    mid_gemm = os.environ.get("MSTAR_MID_GEMM", "") not in ("", "0", "auto")
    default = str(MID_GEMM_PDL_ROWS if mid_gemm else 2)
    raw = os.environ.get("MSTAR_PDL_MAX_ROWS", default) or default
    if not raw.isdigit():
        raise ValueError(f"MSTAR_PDL_MAX_ROWS={raw!r}: expected a non-negative integer")
    return int(raw)


_EXTRA_ROWS: dict[int, int] = {}  # row count -> how many models asked for PDL there (`add_rows`)


def add_rows(rows: int) -> None:
    """Launches of exactly `rows` rows go with PDL too, whatever `max_rows()` says, until as many `remove_rows`
    calls: the row counts at which a model chose its projections on Triton kernels (MSTAR_MID_GEMM=auto)."""
    _EXTRA_ROWS[rows] = _EXTRA_ROWS.get(rows, 0) + 1


def remove_rows(rows: int) -> None:
    if _EXTRA_ROWS.get(rows, 0) <= 1:
        _EXTRA_ROWS.pop(rows, None)
    else:
        _EXTRA_ROWS[rows] -= 1


def applies(rows: int) -> bool:
    """Whether a launch of `rows` rows goes with PDL (when `enabled()`): up to `max_rows()`, or at an added count."""
    return rows <= max_rows() or rows in _EXTRA_ROWS


TRIGGER_MODES = ("early", "fit", "ahead")


def trigger_mode() -> str:
    """`MSTAR_PDL_TRIGGER`: when a PDL kernel lets the next one start. `early` (default): each program right after
    its wait. `fit`: so only if the grid fits on the GPU's SMs at once; a deeper grid's programs do not trigger,
    so the next kernel starts when this one ends (else the next kernel's programs, launched early, wait on SMs
    that this kernel's later waves need). `ahead`: each program as it starts, before its wait, so a chain of
    kernels can be resident at once, each loading its weights ahead while the ones before it run.

    `ahead` is safe for the same reason as the others: a kernel's wait returns only when the kernel before it has
    finished, which it did only after its own wait, so the order holds transitively; and a kernel launches only
    once every program of the one before it has started, so all but the newest launched kernel are wholly
    resident and none can wait on SMs that an older one still needs."""
    mode = os.environ.get("MSTAR_PDL_TRIGGER", "early") or "early"
    if mode not in TRIGGER_MODES:
        raise ValueError(f"MSTAR_PDL_TRIGGER={mode!r}: expected one of {', '.join(TRIGGER_MODES)}")
    return mode


def ahead_of() -> frozenset[str]:
    """`MSTAR_PDL_AHEAD_OF`: the kinds of kernel (separated by `,` or `+`) that, under the `early` trigger, let the
    next kernel start before their own wait, as `ahead` does for all: `prologue`, `split`, `merge`, a GEMV by its
    projection's name (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`, ...; `gemv:NxK` for an unnamed one),
    mstar_kernels/mid_gemm.py's launches as `mid:o_proj` and so on.
    Unset: `prologue`, `o_proj`, `gate_up_proj` and `down_proj`. After the prologue, the split attention then loads
    its first block of context while the qkv projection still computes; after o, gate_up streams its weights while
    o computes; and so on. (Those kernels' own loads ahead of their waits are step inputs and weights, and the
    kernel before them has its weights in registers by then.) `none`: no kernel. Read at each launch, so at
    capture. H200, Qwen3-0.6B one-row step replay (scripts/ab_decode_step.py, 2026-12-04): none 0.7784 ms,
    prologue 0.7523 (the split, merge, qkv, gate_up or down added to it: 0.749-0.754), prologue + o 0.7232-0.7296,
    + down 0.7127, + gate_up and down 0.7060; two rows 0.955-0.958 for each set against 1.0012 without;
    Llama-3.2-3B one row 2.2514 -> 2.2151 ms with the prologue (o and gate_up added: 2.2151 / 2.2212); timed alone
    later that day, the default set 2.1855 ms, the prologue alone 2.2084, none 2.2425."""
    raw = os.environ.get("MSTAR_PDL_AHEAD_OF", "").strip()
    if not raw:  # unset or empty (as every switch): the default set; `none` names no kernel
        return DEFAULT_AHEAD_OF
    kinds = (kind.strip() for kind in raw.replace("+", ",").split(","))
    return frozenset(kind for kind in kinds if kind and kind != "none")


DEFAULT_AHEAD_OF = frozenset({"prologue", "o_proj", "gate_up_proj", "down_proj"})


def skipped() -> frozenset[str]:
    """`MSTAR_PDL_SKIP` (unset: none; for A/Bs): the kinds of kernel, named as for `ahead_of`, that launch without
    PDL even where it applies. Such a kernel starts when the one before it has finished, and neither waits nor
    triggers, so the kernel after it starts at its end too."""
    raw = os.environ.get("MSTAR_PDL_SKIP", "")
    return frozenset(kind.strip() for kind in raw.replace("+", ",").split(",") if kind.strip())


FIXED_KINDS = frozenset({"prologue", "split", "merge"})


def unknown_kinds(projections: set[str]) -> list[str]:
    """The kinds that `MSTAR_PDL_AHEAD_OF` or `MSTAR_PDL_SKIP`, where set, name but that name no kernel of a model
    with these `projections` (the last part of each linear layer's name: `qkv_proj`, `lm_head`, ...): not a fixed
    kind, not a projection or `mid:` one, not `gemv:NxK`. Such a kind leaves an A/B measuring nothing (or names a
    kernel of another model of the deployment)."""
    known = FIXED_KINDS | projections | {f"mid:{name}" for name in projections}
    found = []
    for switch, kinds in (("MSTAR_PDL_AHEAD_OF", ahead_of()), ("MSTAR_PDL_SKIP", skipped())):
        if not os.environ.get(switch, "").strip():
            continue
        found += [f"{switch}: {kind}" for kind in sorted(kinds)
                  if kind not in known and not re.fullmatch(r"gemv:\d+x\d+", kind)]
    return found


def signature(rows: int | None = None) -> str:
    """The switches a decode step (of `rows` rows: `off` where PDL does not apply) is captured under: `off`, or the
    trigger mode and the kinds that trigger before their wait, e.g. `early/down_proj+gate_up_proj+o_proj+prologue`."""
    if not enabled() or rows is not None and not applies(rows):
        return "off"
    skip = f"/skip={'+'.join(sorted(skipped()))}" if skipped() else ""
    return f"{trigger_mode()}/{'+'.join(sorted(ahead_of())) or 'none'}{skip}"
