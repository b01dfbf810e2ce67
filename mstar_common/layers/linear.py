"""Helpers for packed projections (several HF linears served as one GEMM)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from mstar_common.config import env_switch


@torch.no_grad()
def concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input, same dtype/device)."""
    first = linears[0]
    has_bias = first.bias is not None
    weight = torch.cat([lin.weight for lin in linears], dim=0)
    packed = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, device="meta")
    packed.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        packed.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return packed


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it once, at import, too


class GemvLinear(nn.Linear):
    """An `nn.Linear` that runs the row counts in its `gemv_plan` through the skinny-GEMM kernel
    (mstar_kernels/gemv.py) on CUDA, with the plan's (BLOCK_N, BLOCK_K), and everything else through `F.linear`.
    `use_gemv` turns a model's linears into these in place (same parameters and names); `tune_gemv` keeps a
    row count in the plan only where the kernel beat cuBLAS on this GPU."""

    gemv_plan: dict[int, tuple[int, ...]] = {}  # rows -> mstar_kernels/gemv.py gemv_with setting
    # rows at which a projection that could take its pre-norm inside (`norm_gemv`) runs after the norm kernel
    # instead: with MSTAR_NORM_GEMV=auto every row count until `tune_gemv` times the fold faster
    norm_apart: frozenset[int] = frozenset()
    # the projection's attribute name (`o_proj`, ...): its kind for MSTAR_PDL_AHEAD_OF (mstar_kernels/_pdl.py)
    pdl_kind: str | None = None
    # rows at which the projection runs on mstar_kernels/mid_gemm.py: what MSTAR_MID_GEMM=auto chose (`set_mid_rows`)
    mid_rows: frozenset[int] = frozenset()
    # rows at which it also takes its fold (`MID_GEMM_FOLDED_KINDS`): what MSTAR_MID_GEMM_FOLD=auto chose
    mid_fold_rows: frozenset[int] = frozenset()

    def gemv_blocks_for(self, x: torch.Tensor) -> tuple[int, ...] | None:
        if x.is_cuda and x.dim() == 2 and x.stride(1) == 1:
            return self.gemv_plan.get(x.shape[0])
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.gemv_blocks_for(x)
        if blocks is not None:
            from mstar_kernels.gemv import gemv_with

            return gemv_with(x, self.weight, self.bias, blocks, kind=self.pdl_kind)
        setting = self.mid_gemm_setting_for(x)
        if setting is not None:
            from mstar_kernels.mid_gemm import mid_gemm

            mid_gemm_counters(x)
            return mid_gemm(x, self.weight, self.bias, *setting, kind=f"mid:{self.pdl_kind}")
        return super().forward(x)

    def mid_gemm_normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(self(rms_norm(x + residual)), x + residual)` as one mstar_kernels/mid_gemm.py launch
        (`mid_gemm_norm`), where this step's projection runs on that kernel and takes its fold (`mid_folds`); else
        None."""
        setting = self.mid_gemm_setting_for(x) if self.pdl_kind in NORM_FOLDED and self.mid_folds(x) else None
        if setting is None:
            return None
        from mstar_kernels.mid_gemm import mid_gemm_norm

        mid_gemm_counters(x)
        return mid_gemm_norm(x, norm_weight, eps, self.weight, self.bias, residual, *setting,
                             kind=f"mid:{self.pdl_kind}")

    def mid_folds(self, x: torch.Tensor) -> bool:
        """Whether a step of `x`'s rows folds this projection's neighbour into it on mid_gemm (the pre-norm into qkv
        and gate_up, the activation into down): `MSTAR_MID_GEMM_FOLD` names the fold, or `auto` chose it here."""
        fold = MID_GEMM_FOLDED_KINDS.get(self.pdl_kind)
        return fold is not None and (fold in mid_gemm_folds() or x.shape[0] in self.mid_fold_rows)

    def mid_gemm_setting_for(self, x: torch.Tensor) -> tuple[int, ...] | None:
        if not (x.is_cuda or INTERPRETED):  # on the CPU only in Triton's interpreter (the kernel tests)
            return None
        rows = x.shape[0]
        low, high = mid_gemm_rows()
        if rows not in self.mid_rows and (not low <= rows <= high or self.pdl_kind not in mid_gemm_kinds()):
            return None
        from mstar_kernels.mid_gemm import readable

        if not readable(x, self.weight, self.bias):
            return None
        return MID_GEMM_SHAPE_SETTINGS.get((self.out_features, self.in_features), MID_GEMM_SETTINGS[self.pdl_kind])


# `MSTAR_MID_GEMM` (docs/deployment.md): `auto` (the default, below) chooses per model and row count whether the
# decoder's projections of steps of `MID_GEMM_ROWS` rows run through mstar_kernels/mid_gemm.py, under PDL, instead of
# cuBLAS; `all` or `KIND[+KIND...]` (`,` too; of qkv_proj, o_proj, gate_up_proj, down_proj) puts those everywhere in
# the range, and PDL's default rows become 32 (mstar_common/pdl_switches.py), so that such a step's whole chain of
# launches can start under PDL, which cuBLAS's cannot; `0` keeps cuBLAS. Settings, by shape, else by kind: (BLOCK_N,
# BLOCK_K, SPLIT_K, warps, stages), scripts/sweep_mid_gemm.py's best at 64 rows (2026-12-03; Qwen3-0.6B's by kind,
# down's is o's; 2 stages, not 3, where the tile loaded ahead of the PDL wait would not fit). Alone each ties cuBLAS.
# In a step, on the H200 (scripts/ab_decode_step.py, 2026-12-04, docs/benchmarks.md "The projections of 8-32-row
# steps under PDL"): Qwen3-0.6B 8 rows 1.345 -> 1.199 ms, 16 rows 1.527 -> 1.359, 32 rows 1.842 -> 1.743, and
# served at c=8 5,565 -> 6,241 tok/s; Llama-3.2-3B 16 rows 2.811 -> 2.783. At 64 rows PDL first made the step
# slower (2026-12-04: Qwen3 2.329 -> 2.428, Llama 3.635 -> 4.294); since the decode attention's prefetch rule
# (`prefetch_fits`) Qwen3's 64-row step is 2.339 -> 2.207 ms (2026-12-05), while Llama's is 3.591 -> 4.120, hence
# the rows reach 64. The gain is the shape's, hence `auto` by default: served, Qwen3-0.6B's start-up chose
# mid_gemm at 8-64 rows (64: 1.991 against 2.117 ms a replay) and Llama-3.2-3B's cuBLAS at 8-32.
MID_GEMM_SETTINGS = {"qkv_proj": (32, 256, 1, 4, 3), "o_proj": (32, 256, 4, 4, 3),
                     "gate_up_proj": (64, 256, 1, 4, 2), "down_proj": (32, 256, 4, 4, 3)}
# Llama-3.2-3B's (N, K): the sweep's best at 64 rows (qkv at 2 stages), down's a guess
MID_GEMM_SHAPE_SETTINGS = {(5120, 3072): (64, 256, 1, 4, 2), (3072, 3072): (32, 256, 1, 4, 3),
                           (16384, 3072): (64, 128, 1, 4, 3), (3072, 8192): (32, 256, 2, 4, 3)}
MID_GEMM_ROWS = (5, 64)


def mid_gemm_rows() -> tuple[int, int]:
    """The row counts `MSTAR_MID_GEMM` covers: `MID_GEMM_ROWS`, the top raised or lowered by
    `MSTAR_MID_GEMM_MAX_ROWS` (for A/Bs; PDL's rows follow only where `pdl_switches.max_rows()` says)."""
    raw = os.environ.get("MSTAR_MID_GEMM_MAX_ROWS", "") or str(MID_GEMM_ROWS[1])
    if not raw.isdigit():
        raise ValueError(f"MSTAR_MID_GEMM_MAX_ROWS={raw!r}: expected a non-negative integer")
    return MID_GEMM_ROWS[0], int(raw)


def mid_gemm_kinds() -> frozenset[str]:
    """The projection kinds `MSTAR_MID_GEMM` puts on the kernel at every row count of `MID_GEMM_ROWS` (none for
    `auto`, the default, which decides per model and row count: `choose_mid_form`; none for `0`)."""
    raw = os.environ.get("MSTAR_MID_GEMM", "")
    if raw in ("", "0", "auto"):
        return frozenset()
    kinds = frozenset(MID_GEMM_SETTINGS) if raw == "all" else frozenset(raw.replace("+", ",").split(","))
    if not kinds <= MID_GEMM_SETTINGS.keys():
        raise ValueError(f"MSTAR_MID_GEMM={raw!r}: expected auto, 0, all or a list (joined by , or +) of "
                         f"{', '.join(MID_GEMM_SETTINGS)}")
    return kinds


def mid_gemm_counters(x: torch.Tensor) -> None:
    """Makes `x`'s device's split-K counters for mstar_kernels/mid_gemm.py before any graph capture needs them."""
    from mstar_kernels.mid_gemm import counters

    if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        counters(x.device)  # its split-K counters made outside any graph's memory pool


MID_GEMM_FOLDS = ("norm", "swiglu")
MID_GEMM_FOLDED_KINDS = {"qkv_proj": "norm", "gate_up_proj": "norm", "down_proj": "swiglu"}
NORM_FOLDED = frozenset(kind for kind, fold in MID_GEMM_FOLDED_KINDS.items() if fold == "norm")


def mid_gemm_folds() -> frozenset[str]:
    """`MSTAR_MID_GEMM_FOLD` (default none; for A/Bs: on the H200 every fold made the step slower, 2026-12-05): what the
    decoder folds into the projections that run on mstar_kernels/mid_gemm.py (`MSTAR_MID_GEMM`), joined by `,` or `+`:
    `norm`, the pre-norm's residual add + RMSNorm into qkv and gate_up (`mid_gemm_norm`, one launch fewer each);
    `swiglu`, the activation into down (the kernel's SwiGLU load; `silu_mul`'s launch saved). Same roundings as the
    launches they replace (the mean of squares summed in another order: an ulp here and there). Read at each step, so at
    capture. `auto` names none here: with `MSTAR_MID_GEMM=auto` the graph runner times both folds as a third form of
    each bucket (`mid_fold_auto`)."""
    raw = os.environ.get("MSTAR_MID_GEMM_FOLD", "")
    if raw == "auto":
        return frozenset()
    folds = frozenset(filter(None, raw.replace("+", ",").split(",")))
    if not folds <= set(MID_GEMM_FOLDS):
        raise ValueError(f"MSTAR_MID_GEMM_FOLD={raw!r}: expected auto, or a list (joined by , or +) of "
                         f"{', '.join(MID_GEMM_FOLDS)}, or nothing")
    return folds


def mid_fold_auto() -> bool:
    """`MSTAR_MID_GEMM_FOLD=auto` (with `MSTAR_MID_GEMM=auto`): each decode bucket `auto` times is also captured with
    both folds on mid_gemm, and the folds are kept where that step was `MID_MIN_GAIN` shorter than without them."""
    mid_gemm_folds()  # a bad value is refused here too
    return os.environ.get("MSTAR_MID_GEMM_FOLD", "") == "auto"


# MSTAR_MID_GEMM=auto: the graph runner captures each decode bucket of MID_GEMM_ROWS rows twice, its projections on
# cuBLAS and on mid_gemm under PDL, times the replays (rows reading MID_TIMING_CONTEXT tokens of KV each), and keeps
# mid_gemm where its step is at least MID_MIN_GAIN shorter. The choice is stored in the GEMV cache by the model's
# projection shapes, so that every process on the machine (an engine without graphs too) runs the same kernels.
MID_MIN_GAIN = 0.02
MID_TIMING_CONTEXT = 512


def mid_gemm_auto() -> bool:
    """`MSTAR_MID_GEMM` unset or `auto`: the graph runner chooses (on a GPU; stored choices are applied anywhere)."""
    mid_gemm_kinds()  # a bad value is refused here too
    return os.environ.get("MSTAR_MID_GEMM", "") in ("", "auto")


def mid_projections(model: nn.Module) -> list[GemvLinear]:
    """The model's projections the kernel may take (the decoder's qkv, o, gate_up and down)."""
    return [m for m in model.modules() if isinstance(m, GemvLinear) and m.pdl_kind in MID_GEMM_SETTINGS]


def mid_choice_key(model: nn.Module, rows: int) -> str | None:
    """The GEMV cache's key for the choice at `rows` rows: the model's projection shapes (kind, N x K, dtype, bias;
    how many of each) and the PDL switches; None where the model has no such projection."""
    from mstar_common import pdl_switches

    shapes: dict[str, int] = {}
    for m in mid_projections(model):
        name = (f"{m.pdl_kind}={m.out_features}x{m.in_features}:{str(m.weight.dtype).removeprefix('torch.')}"
                f":bias={m.bias is not None}")
        shapes[name] = shapes.get(name, 0) + 1
    if not shapes:
        return None
    layers = "+".join(f"{name}*{count}" for name, count in sorted(shapes.items()))
    folds = ":folds=auto" if mid_fold_auto() else ""  # a choice timed with the folds is not one timed without
    return f"mid:{layers}:rows={rows}:pdl={pdl_switches.signature()}{folds}"


def set_mid_rows(model: nn.Module, rows: int, on: bool, fold: bool = False) -> None:
    """Put the model's projections of `rows`-row steps on mid_gemm (and such launches under PDL), with their folds
    (`fold`) or without, or back on cuBLAS."""
    from mstar_common import pdl_switches

    projections = mid_projections(model)
    was = bool(projections) and rows in projections[0].mid_rows
    for m in projections:
        m.mid_rows = m.mid_rows | {rows} if on else m.mid_rows - {rows}
        m.mid_fold_rows = m.mid_fold_rows | {rows} if on and fold else m.mid_fold_rows - {rows}
    if on and not was:
        pdl_switches.add_rows(rows)
    elif was and not on:
        pdl_switches.remove_rows(rows)


def known_mid_choices(model: nn.Module, cache: Path | None) -> dict[int, bool]:
    """The stored choices for this model (rows -> on mid_gemm), applied to it, folds included; with
    MSTAR_MID_GEMM=auto (the default) only."""
    if not mid_gemm_auto() or cache is None or not cache.is_file():
        return {}
    known = json.loads(cache.read_text())
    choices = {}
    low, high = mid_gemm_rows()
    for rows in range(low, high + 1):
        entry = known.get(mid_choice_key(model, rows) or "")
        if isinstance(entry, dict) and "on" in entry:
            choices[rows] = bool(entry["on"])
            set_mid_rows(model, rows, choices[rows], bool(entry.get("fold")))
    return choices


MID_FORMS = ("cuBLAS", "mid_gemm", "mid_gemm with the folds")


def choose_mid_form(model: nn.Module, rows: int, cublas_ms: float, mid_ms: float, cache: Path | None,
                    fold_ms: float | None = None) -> str:
    """One of `MID_FORMS` for `rows`-row steps, by their timed steps: the folds where timed (`fold_ms`) and at least
    `MID_MIN_GAIN` shorter than mid_gemm without them; then mid_gemm (with or without) where at least `MID_MIN_GAIN`
    shorter than cuBLAS. Applied to the model and stored."""
    fold = fold_ms is not None and fold_ms < mid_ms * (1 - MID_MIN_GAIN)
    on = (fold_ms if fold else mid_ms) < cublas_ms * (1 - MID_MIN_GAIN)
    fold = fold and on
    set_mid_rows(model, rows, on, fold)
    key = mid_choice_key(model, rows)
    if cache is not None and key is not None:
        entry = {"on": on, "cublas_ms": round(cublas_ms, 4), "mid_ms": round(mid_ms, 4)}
        if fold_ms is not None:
            entry |= {"fold": fold, "fold_ms": round(fold_ms, 4)}
        update_cache(cache, {key: entry})
    return MID_FORMS[2] if fold else MID_FORMS[1] if on else MID_FORMS[0]


GEMV_MAX_OUT = 32768  # a wider projection is a vocabulary head: it joins the tuning only with MSTAR_GEMV_HEADS
GEMV_MAX_ROWS = 8  # mstar_kernels/gemv.py's MAX_ROWS


def gemv_heads() -> bool:
    """`MSTAR_GEMV_HEADS` (default 1): the vocabulary heads (more than `GEMV_MAX_OUT` outputs) are tuned like the
    other projections, and run on the skinny GEMM where it beat cuBLAS; 0 keeps them on cuBLAS. On the H200
    (scripts/sweep_gemv.py, cold weights, 2026-12-04) the kernel with (8, 1024, 4 warps) streamed Qwen3-0.6B's
    311 MB head in 72.4 us at one row against cuBLAS's 77.1 (4.30 against 4.04 TB/s; cuBLAS also launches a
    memset first), Llama-3.2-3B's 788 MB in 177.2 against 187.5 us; at two rows cuBLAS won both."""
    return env_switch("MSTAR_GEMV_HEADS", True)


def use_gemv(model: nn.Module, max_rows: int) -> int:
    """Route `model`'s projections through `GemvLinear` for steps of <= `max_rows` rows with the kernel's default
    blocks (0: undo); with `MSTAR_GEMV_HEADS=0` the vocabulary heads get an empty plan (cuBLAS). Returns how many
    linears have a plan."""
    if not 0 <= max_rows <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv rows must be in [0, {GEMV_MAX_ROWS}], got {max_rows}")
    from mstar_common.layers.decoder import norm_gemv_mode
    from mstar_kernels.gemv import gemv_blocks

    # auto: a pre-norm goes into the kernel only where `tune_gemv` timed that faster; 1: wherever the kernel runs
    norm_apart = frozenset(range(1, max_rows + 1)) if norm_gemv_mode() == "auto" else frozenset()
    heads = gemv_heads()
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.__class__ = GemvLinear
            module.pdl_kind = name.rsplit(".", 1)[-1]
            planned = heads or module.out_features <= GEMV_MAX_OUT
            module.gemv_plan = {rows: gemv_blocks(rows, module.out_features, module.in_features)
                                for rows in range(1, max_rows + 1)} if planned else {}
            module.norm_apart = norm_apart
            count += bool(module.gemv_plan)
    return count


# Settings tried per shape besides the default: (BLOCK_N, BLOCK_K) with the default warps and no pipelining,
# and (BLOCK_N, BLOCK_K, num_warps, num_stages) with the K loop software-pipelined. scripts/sweep_gemv.py's
# winners on the H200 with cold weights (2026-12-01): (8, 1024, 4, 3) for Llama-3B's o and SwiGLU down at one
# row, 3.26 TB/s against cuBLAS's 2.57 (down) and 1.87 (o).
GEMV_CANDIDATES = ((1, 1024), (2, 1024), (4, 1024), (1, 4096), (2, 4096), (4, 2048),
                   (4, 1024, 4, 3), (8, 1024, 4, 3), (8, 512, 4, 4), (16, 512, 4, 3), (2, 2048, 4, 3),
                   (8, 1024, 4, 1))


# Wider programs that hold a whole K slice (0: the next power of two of K) and so load all of their weights before
# their PDL wait. scripts/probe_gemv_chain.py on the H200 (2026-12-02): the one-row chain of 112 Qwen3-0.6B
# projections 512.6 -> 476.0 us with (8, whole K, 8 warps) for all four. Their tile may hold up to
# 4 x TILE_ELEMENTS products. In the tuned decode step (ab_decode_step.py, same process, 2026-12-02, later) they won
# Qwen3-0.6B's one-row SwiGLU down (10.1 -> 5.6 us against cuBLAS; 6.3 with the pipelined setting), and the step
# went 0.847 -> 0.829 ms; Llama-3.2-3B took none of them. Tried by default; MSTAR_GEMV_WIDE=0 leaves them out.
GEMV_WIDE_CANDIDATES = ((8, 0, 8, 1), (16, 0, 8, 1))


def _wide_candidates() -> bool:
    return env_switch("MSTAR_GEMV_WIDE", True)


def _whole_k(k: int) -> int:
    """The BLOCK_K that covers a K of `k` in one iteration (what a whole-K setting's 0 stands for)."""
    return max(64, 1 << (k - 1).bit_length())


GEMV_MARGIN = 0.95  # the kernel must beat cuBLAS by 5% to take a shape: near-ties keep cuBLAS
GEMV_MARGIN_US = 2.0  # ... or by this many microseconds, whichever is less (a vocabulary head's ~75 us)


def gemv_bar(cublas_us: float) -> float:
    """The time a skinny-GEMM setting must beat to replace cuBLAS on a shape: 5% under cuBLAS's, or 2 us under it
    where that is less. The margin keeps near-ties of the few-microsecond projections on cuBLAS, where timing noise
    is a few percent; a vocabulary head's ~75 us is timed to well under 1%, and its ~6% win at one row (4.3 against
    4.0 TB/s, docs/benchmarks.md) fell on either side of 5% from one start to the next."""
    return max(cublas_us * GEMV_MARGIN, cublas_us - GEMV_MARGIN_US)


@torch.no_grad()
def gemv_candidates(rows: int, n: int, k: int) -> list[tuple[int, ...]]:
    """The skinny-GEMM settings `tune_gemv` tries for an [n, k] weight at `rows` rows: the default blocks, the
    candidates, and (`MSTAR_GEMV_WIDE`, default on) the whole-K ones, less those whose K block exceeds K's power of
    two or whose tile holds too many products, and pipelined ones with a single iteration."""
    from mstar_kernels.gemv import TILE_ELEMENTS, gemv_blocks

    whole_k = _whole_k(k)
    wide = {(block_n, whole_k, *rest) for block_n, _, *rest in GEMV_WIDE_CANDIDATES} if _wide_candidates() else set()
    kept = []
    for setting in sorted({gemv_blocks(rows, n, k), *GEMV_CANDIDATES} | wide):
        block_n, block_k = setting[:2]
        tile_cap = (4 if setting in wide else 2) * TILE_ELEMENTS
        if block_k > whole_k or block_n * block_k * rows > tile_cap:
            continue
        if len(setting) > 2 and setting[3] > 1 and block_k >= k:  # one iteration: nothing to pipeline
            continue
        kept.append(setting)
    return kept


def parallel_compile() -> bool:
    """`MSTAR_PARALLEL_COMPILE` (default 0): `tune_gemv` compiles every setting it will time on a thread pool first."""
    return env_switch("MSTAR_PARALLEL_COMPILE", False)


def _shape_key(weight: torch.Tensor, bias: torch.Tensor | None, swiglu: bool, norm, try_apart: bool) -> str:
    """The part of a tuning decision's key that names the projection (`_decision_key` adds the rows)."""
    n, k = weight.shape
    key = f"{n}x{k}:{str(weight.dtype).removeprefix('torch.')}:bias={bias is not None}:swiglu={swiglu}"
    # a norm-fed decision: the norm inside the kernel or cuBLAS (MSTAR_NORM_GEMV=1: ":norm"), or also the norm
    # kernel + the plain kernel (auto: ":norm(in|apart)")
    return key + ((":norm(in|apart)" if try_apart else ":norm") if norm is not None else "")


def _decision_key(shape_key: str, weight: torch.Tensor, norm, rows: int) -> str:
    from mstar_kernels._pdl import use_pdl

    # with PDL the kernel's weight prefetch overlaps the kernel before it: a decision of its own
    key = f"{shape_key}:rows={rows}" + (":pdl" if use_pdl(weight, rows) else "")
    key += ":wide" if _wide_candidates() else ""  # a decision taken over more candidates
    return key + (":chained" if _is_chained(weight, rows, norm) else "")


def _untuned(plans: list[tuple], known: dict):
    """(module, swiglu, norm, rows) for each planned row bucket of `plans` without a decision in `known`."""
    for module, swiglu, norm, shape_key in plans:
        for rows in sorted({_row_bucket(r) for r in module.gemv_plan}):
            if _decision_key(shape_key, module.weight, norm, rows) not in known:
                yield module, swiglu, norm, rows


def precompile_gemv_candidates(plans: list[tuple], known: dict, try_apart: bool, log) -> int:
    """Compile each skinny-GEMM kernel that `tune_gemv` is about to time, on a thread pool, before it times any
    (`MSTAR_PARALLEL_COMPILE=1`). Timing compiles each setting at its first call, one after another: on a fresh
    machine most of a start's tuning time. Here every setting's call runs once under Triton's `AsyncCompileMode`
    with mstar_kernels/gemv.py's `compile_only`, which hands each compile to the pool and launches nothing; the
    timing then finds them compiled. A failure is logged and the timing compiles what is missing itself. Returns
    the number of calls made."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import triton

    from mstar_kernels import gemv as gemv_kernels

    async_mode = getattr(triton, "AsyncCompileMode", None)
    if async_mode is None:
        log(f"gemv tune: no parallel compile (triton {triton.__version__} has no AsyncCompileMode)")
        return 0
    calls = []
    for module, swiglu, norm, rows in _untuned(plans, known):
        weight, bias = module.weight, module.bias
        n, k = weight.shape
        x = torch.randn(rows, 2 * k if swiglu else k, device=weight.device, dtype=weight.dtype)
        residual = torch.randn_like(x) if norm is not None else None
        for setting in gemv_candidates(rows, n, k):
            if norm is not None:  # the norm inside the kernel
                calls.append(functools.partial(gemv_kernels.norm_gemv_with, x, norm.weight, norm.eps, weight, bias,
                                               residual, setting))
            if norm is None or try_apart:  # the plain kernel (after the norm kernel, for a norm-fed projection)
                calls.append(functools.partial(gemv_kernels.gemv_with, x, weight, bias, setting, swiglu=swiglu))
    if not calls:
        return 0
    threads = max(1, min(16, os.cpu_count() or 1))
    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="gemv-compile") as pool, async_mode(pool), \
                gemv_kernels.compile_only():
            for call in calls:
                call()
    except Exception:  # noqa: BLE001 - the timing compiles serially whatever is missing
        logging.getLogger(__name__).warning("gemv tune: the parallel compile failed; the timing compiles instead",
                                            exc_info=True)
        _drop_pending_compiles(gemv_kernels._gemv_kernel)
        return len(calls)
    log(f"gemv tune: {len(calls)} candidate calls compiled on {threads} threads in "
        f"{time.perf_counter() - started:.1f} s")
    return len(calls)


def _drop_pending_compiles(kernel) -> None:
    """Take unfinished async compiles out of a Triton kernel's in-memory cache, so that its next launch compiles
    (from Triton's disk cache where the compile got that far) instead of asking a failed one for its result."""
    for caches in getattr(kernel, "device_caches", {}).values():
        try:
            compiled = caches[0]
            for key, value in list(compiled.items()):
                if type(value).__name__ == "FutureKernel" and getattr(value, "kernel", None) is None:
                    del compiled[key]
        except Exception:  # noqa: BLE001 - another Triton's layout: nothing to drop there
            continue


def tune_gemv(model: nn.Module, timer=None, log=None, cache: Path | None = None,
              precompile: bool | None = None) -> list[dict]:
    """Time each distinct `GemvLinear` shape at each planned power-of-two row count against cuBLAS (the down
    projection of a fused SwiGLU MLP against silu_mul + cuBLAS, as it would otherwise run), keep the kernel
    with its fastest setting only where it beats `gemv_bar`, and give the other row counts the plan of the
    next power of two. A projection that a decoder layer runs with its norm in the GEMM's load
    (`norm_gemv_pairs()`, mstar_kernels/gemv.py `norm_gemv`) is timed so, against the norm kernel + cuBLAS and against
    the norm kernel + the plain kernel; the decision says which (`norm_apart`: the rows that keep the norm kernel).
    `timer(fns) -> microseconds per call` (default: inside a captured CUDA graph); `fns`
    are the same call on the weight and on copies of it (`cold_copies`: a decode step reads each layer's
    weights from HBM, never from L2, and the timing must too). Decisions are kept
    in `cache` (JSON; default: one file per GPU model under the mstar cache directory when timing on CUDA), so
    every process on a machine (a restarted server, the benchmark's eager check) runs the same kernels and
    gives the same bits. `precompile` (default: with the default timer, where `MSTAR_PARALLEL_COMPILE=1`) first
    compiles every setting to be timed on a thread pool (`precompile_gemv_candidates`). Returns one record per
    decision taken now."""
    from mstar_common.bench.gpu_timing import cold_copies
    from mstar_common.layers.decoder import norm_gemv_mode

    cold = timer is None
    if timer is None:
        from mstar_common.bench.gpu_timing import graph_time_us as timer

        if cache is None:
            cache = default_gemv_cache()
    log = log or logging.getLogger(__name__).info
    known: dict[str, list[int] | dict | None] = json.loads(cache.read_text()) if cache and cache.is_file() else {}
    fresh: dict[str, list[int] | dict | None] = {}  # this call's decisions, merged into the file at the end
    swiglu_downs = {id(m.down_proj) for m in model.modules()
                    if getattr(m, "gate_up_proj", None) is not None and getattr(m, "use_kernel", False)}
    norm_fed = {id(linear): norm for m in model.modules() if hasattr(m, "norm_gemv_pairs")
                for norm, linear in m.norm_gemv_pairs()}
    try_apart = norm_gemv_mode() == "auto"
    records = []
    step_logged: set[tuple] = set()
    plans = []  # (module, swiglu, norm, shape_key) for each projection with a plan
    for module in model.modules():
        if isinstance(module, GemvLinear) and module.gemv_plan:
            swiglu, norm = id(module) in swiglu_downs, norm_fed.get(id(module))
            plans.append((module, swiglu, norm, _shape_key(module.weight, module.bias, swiglu, norm, try_apart)))
    if precompile if precompile is not None else cold and parallel_compile():
        precompile_gemv_candidates(plans, known, try_apart, log)
    for module, swiglu, norm, shape_key in plans:
        weight, bias = module.weight, module.bias
        n, k = weight.shape
        weights = None

        for rows in sorted({_row_bucket(r) for r in module.gemv_plan}):
            key = _decision_key(shape_key, weight, norm, rows)
            if key in known:
                continue
            if weights is None:
                weights = cold_copies(weight) if cold else [weight]
            x = torch.randn(rows, 2 * k if swiglu else k, device=weight.device, dtype=weight.dtype)
            residual = torch.randn_like(x) if norm is not None else None
            chained = _is_chained(weight, rows, norm)
            cublas_us = timer(_timed_calls(x, weights, bias, None, swiglu, norm, residual, chained))
            best, best_us, apart = None, gemv_bar(cublas_us), False
            fastest_us = float("inf")  # the kernel's best time, under the bar or not (for the log)
            for setting in gemv_candidates(rows, n, k):
                us = timer(_timed_calls(x, weights, bias, setting, swiglu, norm, residual, chained))
                fastest_us = min(fastest_us, us)
                if us < best_us:
                    best, best_us, apart = setting, us, False
                if norm is not None and try_apart:  # the norm kernel (add + norm), then the plain kernel
                    us = timer(_timed_calls(x, weights, bias, setting, swiglu, norm, residual, norm_apart=True))
                    fastest_us = min(fastest_us, us)
                    if us < best_us:
                        best, best_us, apart = setting, us, True
            if best is None:
                known[key] = None
            elif norm is not None and try_apart:
                known[key] = {"blocks": list(best), "norm": "apart" if apart else "in"}
            else:
                known[key] = list(best)
            fresh[key] = known[key]
            records.append({"n": n, "k": k, "swiglu": swiglu, "norm": norm is not None, "rows": rows,
                            "cublas_us": round(cublas_us, 2), "gemv_us": round(best_us, 2) if best else None,
                            "blocks": best, "norm_apart": apart})
            prologue = " (swiglu)" if swiglu else " (norm)" if norm is not None else ""
            form = " after the norm kernel" if apart else " with the norm inside" if norm is not None else ""
            log(f"gemv tune: {n}x{k}{prologue} rows {rows}: cuBLAS {cublas_us:.2f} us, "
                + (f"kernel {best_us:.2f} us with blocks {best}{form}" if best
                   else f"kernel {fastest_us:.2f} us at best, not under {gemv_bar(cublas_us):.2f} us: cuBLAS"))
        plan, norm_apart = {}, set()
        for rows in module.gemv_plan:
            bucket = _row_bucket(rows)
            decision = known[_decision_key(shape_key, weight, norm, bucket)]
            if isinstance(decision, dict):
                if decision["norm"] == "apart":
                    norm_apart.add(rows)
                decision = decision["blocks"]
            step = step_setting(known, weight, bias, bucket)
            if step is not None:  # timed in whole steps: it replaces the setting, the norm's place stays
                step_logged.add((n, k, bucket, step))
                decision = step
            if decision is not None:
                plan[rows] = tuple(decision)
        module.gemv_plan = plan
        module.norm_apart = frozenset(norm_apart)
        del weights
    for n, k, rows, setting in sorted(step_logged):
        log(f"gemv tune: {n}x{k} rows {rows}: the step-timed setting {setting} (scripts/tune_step_gemv.py "
            "--write-cache; MSTAR_GEMV_STEP_PLANS=0 ignores it)")
    if cache and fresh:
        update_cache(cache, fresh)
    return records


def _write_cache(cache: Path, known: dict) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    tmp.replace(cache)  # atomic: a concurrent reader sees the old file or the new one


def update_cache(cache: Path, updates: dict, remove: tuple[str, ...] = ()) -> None:
    """Merges `updates` into the GEMV cache file (and drops the keys in `remove`) under an exclusive lock: the file
    is read again inside it, so processes that tune at the same time (a deployment's instances starting together)
    keep each other's decisions instead of the last writer's snapshot winning."""
    import fcntl

    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = json.loads(cache.read_text()) if cache.is_file() else {}
        known.update(updates)
        for key in remove:
            known.pop(key, None)
        _write_cache(cache, known)


def step_setting_key(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> str:
    """The GEMV cache's key for the setting that whole captured decode steps chose (scripts/tune_step_gemv.py
    `--write-cache`) for every projection with this weight's shape, dtype and bias at `rows` rows (a bucket), under
    this process's PDL switches (mstar_common/pdl_switches.py `signature`): which kernels overlap which decides the
    step's best setting, so a setting timed under other triggers is not taken."""
    from mstar_common import pdl_switches

    n, k = weight.shape
    return (f"step:{n}x{k}:{str(weight.dtype).removeprefix('torch.')}:bias={bias is not None}:rows={rows}"
            f":pdl={pdl_switches.signature(rows)}")


def step_setting(known: dict, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> tuple[int, ...] | None:
    """The step-timed setting in the GEMV cache's decisions `known` for this projection at `rows` rows, if any and
    `MSTAR_GEMV_STEP_PLANS` (default 1) is on. `tune_gemv` times each projection behind one norm launch; in a step
    it runs between other kernels whose programs hold registers and stream bytes of their own, so a setting timed
    in the whole step can beat the one timed alone (Qwen3-0.6B's o projection at one row, H200: the step 1.1-2.3%
    shorter before the early PDL triggers, none better after them; docs/benchmarks.md)."""
    if not env_switch("MSTAR_GEMV_STEP_PLANS", True):
        return None
    setting = known.get(step_setting_key(weight, bias, rows))
    return tuple(setting) if setting is not None else None


def write_step_settings(cache: Path, settings: dict[str, list[int] | None]) -> None:
    """Merges step-timed settings (`step_setting_key` -> setting; None removes the key) into the GEMV cache file
    that every server process on this machine reads (`default_gemv_cache`)."""
    bad = [key for key in settings if not key.startswith("step:")]
    if bad:
        raise ValueError(f"not step-setting keys: {bad}")
    update_cache(cache, {key: [int(v) for v in setting] for key, setting in settings.items() if setting is not None},
                 remove=tuple(key for key, setting in settings.items() if setting is None))


def _is_chained(weight: torch.Tensor, rows: int, norm) -> bool:
    """Whether a projection is timed behind a norm launch (`_timed_calls`): at row counts that launch with PDL,
    unless it carries its own norm or `MSTAR_GEMV_CHAINED=0` (the projection alone, as before 2026-12-02)."""
    from mstar_kernels._pdl import use_pdl

    return norm is None and use_pdl(weight, rows) and env_switch("MSTAR_GEMV_CHAINED", True)


def _timed_calls(x, weights, bias, setting, swiglu, norm, residual, chained: bool = False,
                 norm_apart: bool = False) -> list:
    """One projection call per weight copy, as a step would run it: cuBLAS after the op in front of it (SiLU*up or
    the norm kernel) where `setting` is None, else the skinny GEMM with that op in its load (`norm_apart`: the norm
    kernel, then the skinny GEMM).

    `chained` (a row count that launches with PDL): each call is preceded by an RMSNorm launch that produces its
    input, as in a decode step, where a kernel always runs before a projection. Under PDL the skinny GEMM starts
    streaming its weights while that kernel runs and cuBLAS does not; timed alone, a projection hides this. (On the
    H200 a one-row gate_up 5% slower alone took 40 us more per Qwen3-0.6B step on cuBLAS, 2026-12-02.)"""
    import torch.nn.functional as F

    from mstar_kernels.gemv import gemv_with, norm_gemv_with

    if chained:
        from mstar_kernels.rmsnorm import rms_norm

        gamma = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)

        def feed():
            return rms_norm(x, gamma, 1e-6)
    else:
        def feed():
            return x

    if setting is not None and norm is not None and norm_apart:  # the norm kernel, then the plain kernel
        from mstar_kernels.rmsnorm import rms_norm

        return [lambda w=w: gemv_with(rms_norm(x, norm.weight, norm.eps, residual), w, bias, setting) for w in weights]
    if setting is not None and norm is not None:
        return [lambda w=w: norm_gemv_with(x, norm.weight, norm.eps, w, bias, residual, setting) for w in weights]
    if setting is not None:
        return [lambda w=w: gemv_with(feed(), w, bias, setting, swiglu=swiglu) for w in weights]
    if swiglu:
        from mstar_kernels.silu_mul import silu_mul

        return [lambda w=w: F.linear(silu_mul(feed()), w, bias) for w in weights]
    if norm is not None:
        from mstar_kernels.rmsnorm import rms_norm

        return [lambda w=w: F.linear(rms_norm(x, norm.weight, norm.eps, residual), w, bias) for w in weights]
    return [lambda w=w: F.linear(feed(), w, bias) for w in weights]


def _row_bucket(rows: int) -> int:
    """The power of two a step of `rows` rows is timed at (3 rows pad to 4 as the graphs' buckets do)."""
    return 1 << (rows - 1).bit_length()


@functools.cache
def kernels_fingerprint(root: Path | None = None) -> str:
    """A digest of the kernel sources (`root`, default the mstar_kernels package: its .py, .cu and .cuh files). The GEMV
    cache's decisions and step-timed settings were timed against these kernels and the ones around them in a step,
    so the cache file is named by it: a changed kernel starts a new file (re-tuned at the next start) instead of
    keeping settings that may now be slower (on 2026-12-04 an o setting stored before the early PDL triggers cost
    ~2% a one-row step after them, docs/benchmarks.md)."""
    if root is None:
        import mstar_kernels

        root = Path(mstar_kernels.__file__).parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("*.cu"), *root.glob("*.cuh")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def default_gemv_cache() -> Path:
    import triton

    from mstar_common.checkpoints import cache_dir

    name = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name())
    # v4: the bar is 5% or 2 us under cuBLAS (v3: 5%; a PDL row count is timed behind a norm launch; v2: each
    # projection alone; v1: on L2-resident weights)
    return (cache_dir() / "gemv" / f"v4-{name}-torch{torch.__version__.split('+')[0]}-triton{triton.__version__}"
            f"-kernels{kernels_fingerprint()}.json")


def use_gemv_from_env(model: nn.Module) -> None:
    """`use_gemv` with `MSTAR_GEMV_MAX_ROWS` rows (default 4; 0: cuBLAS throughout), then, on CUDA, `tune_gemv`,
    so that a projection takes the kernel only at the row counts where it beat cuBLAS on this GPU."""
    rows = gemv_max_rows()
    forced = forced_gemv_settings()
    if rows and use_gemv(model, rows) and next(model.parameters()).is_cuda:
        tune_gemv(model)
        force_gemv_settings(model, forced, rows)
        if mid_gemm_auto():
            choices = known_mid_choices(model, default_gemv_cache())
            if choices:
                logging.getLogger(__name__).info(
                    "mid_gemm (MSTAR_MID_GEMM=auto, stored): rows %s", {r: "mid_gemm" if on else "cuBLAS"
                                                                        for r, on in sorted(choices.items())})


def gemv_max_rows() -> int:
    """`MSTAR_GEMV_MAX_ROWS` (default 4; 0: cuBLAS throughout): decode steps of at most this many rows may run their
    projections on the skinny GEMM."""
    raw = os.environ.get("MSTAR_GEMV_MAX_ROWS", "") or "4"
    if not raw.isdigit() or int(raw) > GEMV_MAX_ROWS:
        raise ValueError(f"MSTAR_GEMV_MAX_ROWS: must be an integer in [0, {GEMV_MAX_ROWS}], got {raw!r}")
    return int(raw)


def forced_gemv_settings() -> dict[int, tuple[int, ...]]:
    """`MSTAR_GEMV_FORCE` (an A/B switch, unset by default): `ROWS:BLOCK_N/BLOCK_K/WARPS/STAGES[;...]`, e.g.
    `1:8/0/8/1` (BLOCK_K 0: the whole K in one iteration), puts every skinny-GEMM projection on that setting at that
    row count after the tuning, whatever it decided (cuBLAS included), so that a whole step can be timed with one
    setting throughout (scripts/probe_gemv_chain.py's chain preferred such a plan to the per-projection tuning)."""
    raw = os.environ.get("MSTAR_GEMV_FORCE", "")
    forced = {}
    for item in filter(None, raw.split(";")):
        rows, _, setting = item.partition(":")
        values = setting.split("/")
        ok = rows.isdigit() and 1 <= int(rows) <= GEMV_MAX_ROWS and len(values) == 4 and all(map(str.isdigit, values))
        if ok:
            block_n, block_k, warps, stages = map(int, values)
            ok = (_power_of_two(block_n) and block_n <= 64 and warps in (1, 2, 4, 8, 16) and stages >= 1
                  and (block_k == 0 or _power_of_two(block_k) and block_k >= 16))
        if not ok:
            raise ValueError(f"MSTAR_GEMV_FORCE={raw!r}: expected ROWS:BLOCK_N/BLOCK_K/WARPS/STAGES[;...] with ROWS in "
                             f"[1, {GEMV_MAX_ROWS}], BLOCK_N a power of two <= 64, BLOCK_K 0 (the whole K) or a power "
                             "of two >= 16, WARPS 1-16 (a power of two), STAGES >= 1; e.g. 1:8/0/8/1")
        forced[int(rows)] = tuple(int(v) for v in values)
    return forced


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def force_gemv_settings(model: nn.Module, forced: dict[int, tuple[int, ...]], max_rows: int) -> int:
    """Apply `forced_gemv_settings()` to every `GemvLinear` at the row counts up to `max_rows` (`use_gemv`'s); a
    BLOCK_K of 0 becomes the power of two at or above the projection's K. A norm-fed projection keeps its norm
    inside the kernel only where the tuning had put it there. Returns how many (projection, rows) were forced."""
    count = 0
    for module in model.modules():
        if not isinstance(module, GemvLinear):
            continue
        whole_k = _whole_k(module.in_features)
        for rows, setting in forced.items():
            if rows > max_rows:
                continue
            block_n, block_k, warps, stages = setting
            setting = (block_n, block_k or whole_k, warps, stages)
            if rows not in module.gemv_plan:  # cuBLAS until now: with a norm in front, the norm stays apart
                module.norm_apart = module.norm_apart | {rows}
            module.gemv_plan = {**module.gemv_plan, rows: setting}
            count += 1
    return count

