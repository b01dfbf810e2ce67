#!/usr/bin/env python
"""Times mstar_kernels/paged_decode_attention.py's launch knobs (context tokens per iteration, warps, pipeline
stages, context splits) on the decode shapes the benchmarks run, and prints each one's effective KV read
bandwidth against the GPU's (measured by a device copy in the same run).

Device: source .device/prepare.sh && python scripts/sweep_decode_attention.py [--out sweep.json]
Shapes: Orpheus/Llama-3.2-3B (24 q heads, 8 KV heads, head dim 128) at 256 and 64 rows, Qwen3-0.6B (16/8/128)
at 1 and 64 rows, Whisper large-v3 (20/20/64) at 1 row over the 1,500 encoder positions; bf16 and fp8 pools.
The first shape is swept in full; the five best settings are then timed on the others.
`--variants` instead compares the kernel's forms (heads-major, tokens-major, fp16 dots, fp8 q.k) over a smaller
grid of launch knobs, per pool dtype. `--focus NAME` sweeps one shape's launch knobs and context splits for each
pool's default form (bf16: heads-major; fp8: tokens-major with the fp8 q.k), against the defaults. `--prefill`
sweeps the ragged prefill kernel's two forms and launch knobs on a step of 8 fresh 512-token prompts and on one
4,096-token prompt.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name, rows, q heads, kv heads, head dim, context tokens per row
SHAPES = [
    ("orpheus-256", 256, 24, 8, 128, 640),
    ("orpheus-64", 64, 24, 8, 128, 640),
    ("qwen3-1", 1, 16, 8, 128, 700),
    ("qwen3-64", 64, 16, 8, 128, 700),
    ("whisper-cross-1", 1, 20, 20, 64, 1500),
]
PAGE_SIZE = 16


def make_case(rows: int, heads: int, kv_heads: int, head_dim: int, ctx: int, kv_dtype, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_row = -(-ctx // PAGE_SIZE)
    num_pages = rows * pages_per_row + 1
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16).to(kv_dtype)
    # shuffled pages, as a pool that has served a while hands them out
    order = torch.randperm(num_pages - 1, generator=gen, device=device).to(torch.int32) + 1
    tables = order.view(rows, pages_per_row)
    ctx_lens = torch.full((rows,), ctx, dtype=torch.int32, device=device)
    query = torch.randn((rows, heads, head_dim), generator=gen, device=device, dtype=torch.bfloat16)
    kv_bytes = 2 * rows * ctx * kv_heads * head_dim * k_cache.element_size()
    return query, k_cache, v_cache, tables, ctx_lens, kv_bytes


def time_us(fn, iters: int = 50) -> float:
    """Inside a captured graph, as the engine runs the kernel (a bare loop would time Triton's host launcher
    for the one-row shapes)."""
    from mstar_common.bench.gpu_timing import graph_time_us

    return graph_time_us(fn, calls=10, replays=max(1, iters // 10))


def _event_time_us(fn, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def copy_bandwidth() -> float:
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _event_time_us(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (us * 1e-6) / 1e12  # read + write, TB/s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--variants", action="store_true", help="compare the kernel's forms (see above)")
    parser.add_argument("--mixed", action="store_true", help="time a mixed step's attention both ways")
    parser.add_argument("--focus", choices=[shape[0] for shape in SHAPES], help="sweep one shape (see above)")
    parser.add_argument("--prefill", action="store_true",
                        help="sweep the ragged prefill kernel's forms and launch knobs (8 x 512 and 1 x 4,096 tokens)")
    args = parser.parse_args()
    import torch

    from mstar_kernels.paged_decode_attention import decode_num_splits, paged_decode_attention

    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth {bandwidth:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    grid = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (0, 2, 4)))  # splits 0: the heuristic
    results: list[dict] = []

    def run(shape, kv_dtype, setting) -> dict:
        name, rows, heads, kv_heads, head_dim, ctx = shape
        query, k_cache, v_cache, tables, ctx_lens, kv_bytes = make_case(rows, heads, kv_heads, head_dim, ctx,
                                                                         kv_dtype, "cuda")
        block, warps, stages, splits, *rest = setting
        fp16_dots = bool(rest and rest[0])
        tokens_major = bool(len(rest) > 1 and rest[1])
        qk_fp8 = bool(len(rest) > 2 and rest[2])
        splits = splits or decode_num_splits(rows, kv_heads)
        try:
            us = time_us(lambda: paged_decode_attention(query, k_cache, v_cache, tables, ctx_lens, 0.088,
                                                        num_splits=splits, block=block, num_warps=warps,
                                                        num_stages=stages, fp16_dots=fp16_dots,
                                                        tokens_major=tokens_major, qk_fp8=qk_fp8))
        except Exception as exc:  # an out-of-resources launch: report it and go on
            print(f"{name} {kv_dtype} {setting}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            return {}
        row = {"shape": name, "kv_dtype": str(kv_dtype).removeprefix("torch."), "block": block, "warps": warps,
               "stages": stages, "splits": splits, "fp16_dots": fp16_dots,
               "tokens_major": tokens_major, "qk_fp8": qk_fp8, "us": round(us, 2),
               "TB/s": round(kv_bytes / us / 1e6, 3)}
        results.append(row)
        return row

    if args.mixed:
        results.extend(time_mixed_step())
    elif args.prefill:
        results.extend(sweep_prefill(args.top))
    elif args.focus:
        sweep_focus(run, next(shape for shape in SHAPES if shape[0] == args.focus), args.top)
    elif args.variants:
        sweep_variants(run, args.top)
    else:
        sweep_grid(run, grid, args.top)
    if args.out:
        args.out.write_text(json.dumps({"copy_TBps": bandwidth, "results": results}, indent=1))
    return 0


PREFILL_CASES = ((8, 512), (1, 4096))  # (fresh prompts, tokens each): the benchmark's step, one long prompt
PREFILL_HEADS = (("qwen3-prefill", 16, 8), ("llama-prefill", 24, 8))
PREFILL_SETTINGS = tuple(itertools.product((32, 64, 128), (4, 8), (2, 3)))  # keys a block, warps, stages


def sweep_prefill(top: int, cases=PREFILL_CASES, heads_list=PREFILL_HEADS, settings=PREFILL_SETTINGS,
                  device: str = "cuda", dtype=None, timer=None) -> list[dict]:
    """The ragged prefill kernel on steps of fresh prompts (pages of 64, as served), Qwen3-0.6B's and
    Llama-3.2-3B's heads: both forms (`plain`; `grouped` with one and with two query heads a program) at every
    (keys per iteration, warps, stages), in TFLOPS of the causal attention. Each output is compared with the plain
    form's at its default settings first. `device`, `dtype` (default bf16), `timer` and the rest let a test run
    it small in Triton's interpreter."""
    import torch

    from mstar_kernels.paged_prefill_attention import (
        GROUPED_HEADS,
        fresh_prompts,
        grouped_launch,
        paged_prefill_attention,
    )

    dtype = dtype or torch.bfloat16
    timer = timer or time_us
    out = []
    for (name, heads, kv_heads), (rows, prompt) in itertools.product(heads_list, cases):
        args = fresh_prompts(rows, prompt, heads, kv_heads, 128, 64, dtype, dtype, device)
        flops = 4 * heads * 128 * rows * prompt * (prompt + 1) / 2  # q.k and p.v over the causal half
        reference = paged_prefill_attention(*args, form="plain").float()
        group = heads // kv_heads
        forms = [("plain", None), ("grouped", 1)] + ([("grouped", 2)] if group > 1 else [])
        found = []
        for (form, per_program), (block_n, warps, stages) in itertools.product(forms, settings):
            def run(a=args, b=block_n, w=warps, st=stages, f=form, h=per_program):
                return paged_prefill_attention(*a, block_n=b, num_warps=w, num_stages=st, form=f,
                                               heads_per_program=h)
            try:
                err = ((run().float() - reference).norm() / reference.norm()).item()
                us = timer(run)
            except Exception as exc:  # an out-of-resources launch: report it and go on
                print(f"{name} {form}/{per_program} {block_n}/{warps}/{stages}: {type(exc).__name__}: "
                      f"{str(exc)[:80]}", flush=True)
                continue
            found.append({"shape": f"{name}-{rows}x{prompt}", "form": form, "heads": per_program,
                          "block_n": block_n, "warps": warps, "stages": stages, "us": round(us, 2),
                          "TFLOPS": round(flops / us / 1e6, 1), "rel_err_vs_plain": float(f"{err:.2e}")})
        found.sort(key=lambda r: r["us"])
        served = {"plain": next((r for r in found if r["form"] == "plain" and (r["block_n"], r["warps"],
                                                                              r["stages"]) == (64, 4, 2)), None),
                  "grouped": next((r for r in found if r["form"] == "grouped" and r["heads"] == GROUPED_HEADS
                                   and (r["block_n"], r["warps"], r["stages"])
                                   == grouped_launch(GROUPED_HEADS)), None)}
        print(f"\n{name} {rows}x{prompt}: as launched by default {served}", flush=True)
        for form in ("plain", "grouped"):
            for r in [r for r in found if r["form"] == form][:top]:
                print(f"  best {form}", r, flush=True)
        out.extend(found)
    return out


def time_mixed_step(rows: int = 256, ctx: int = 640, prompt: int = 32) -> list[dict]:
    """A mixed step's attention (one layer, Llama-3.2-3B heads): `rows` decode rows of `ctx` tokens plus one
    new `prompt`, all through the ragged prefill kernel (one pass per query head) against the prefill kernel
    for the prompt and the decode kernel for the one-token rows (the engine's path since 2026-12-01)."""
    import torch

    from mstar_kernels.paged_decode_attention import paged_decode_attention
    from mstar_kernels.paged_prefill_attention import build_prefill_work, paged_prefill_attention, prefill_work_capacity

    out = []
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        query, k_cache, v_cache, tables, ctx_lens, _ = make_case(rows + 1, 24, 8, 128, ctx, kv_dtype, "cuda")
        query_lens = [1] * rows + [prompt]
        qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        packed = torch.randn((rows + prompt, 24, 128), device="cuda", dtype=torch.bfloat16)
        capacity = prefill_work_capacity(rows + prompt, rows + 1)
        work = {skip: [torch.tensor(w, dtype=torch.int32, device="cuda")
                       for w in build_prefill_work(query_lens, capacity, skip_single=skip)] for skip in (False, True)}
        fp8 = kv_dtype == torch.float8_e4m3fn

        args = (packed, k_cache, v_cache, qsl, ctx_lens, tables)

        def prefill_only(args=args, work=work):
            return paged_prefill_attention(*args, *work[False], 0.088)

        def split(args=args, work=work, fp8=fp8):
            packed, k_cache, v_cache, qsl, ctx_lens, tables = args
            o = paged_prefill_attention(*args, *work[True], 0.088)
            return paged_decode_attention(packed, k_cache, v_cache, tables, ctx_lens, 0.088, query_start_loc=qsl,
                                          out=o, tokens_major=fp8, qk_fp8=fp8)

        row = {"shape": f"mixed-{rows}x{ctx}+{prompt}", "kv_dtype": str(kv_dtype).removeprefix("torch."),
               "prefill_kernel_us": round(time_us(prefill_only), 2), "prefill_plus_decode_us": round(time_us(split), 2)}
        print(row, flush=True)
        out.append(row)
    return out


# (fp16 dots, tokens major, fp8 q.k) per pool dtype
VARIANTS = {"bfloat16": [(False, False, False), (False, True, False)],
            "float8_e4m3fn": [(True, False, False), (False, True, False), (True, True, False), (False, True, True)]}


def sweep_variants(run, top: int) -> None:
    import torch

    knobs = list(itertools.product((64, 128), (4, 8), (2, 3, 4)))
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for variant in VARIANTS[str(kv_dtype).removeprefix("torch.")]:
            rows = [r for r in (run(SHAPES[0], kv_dtype, (*k, 0, *variant)) for k in knobs) if r]
            rows.sort(key=lambda r: r["us"])
            print(f"\n{SHAPES[0][0]} {kv_dtype} fp16_dots/tokens_major/qk_fp8={variant}:", flush=True)
            for r in rows[:top]:
                print("  best", r, flush=True)
            for shape in SHAPES[1:4]:
                for r in rows[:2]:
                    print("  ", run(shape, kv_dtype, (r["block"], r["warps"], r["stages"], 0, *variant)),
                          flush=True)


def sweep_focus(run, shape, top: int) -> None:
    import torch

    knobs = list(itertools.product((32, 64, 128), (1, 2, 4), (2, 3), (1, 2)))
    for kv_dtype, variant in ((torch.bfloat16, (False, False, False)), (torch.float8_e4m3fn, (False, True, True))):
        rows = [r for r in (run(shape, kv_dtype, (*k, *variant)) for k in knobs) if r]
        # the wrapper's own choices, timed last: the first shape timed runs while the clocks ramp up
        default = run(shape, kv_dtype, (None, 4, None, 0, *variant))
        rows.sort(key=lambda r: r["us"])
        print(f"\n{shape[0]} {kv_dtype} fp16_dots/tokens_major/qk_fp8={variant}: default {default}", flush=True)
        for r in rows[:top]:
            print("  best", r, flush=True)


def sweep_grid(run, grid, top: int) -> None:
    import torch

    from mstar_kernels.paged_decode_attention import BLOCK_N, decode_num_splits

    first = SHAPES[0]
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        settings = grid + ([(*s[:4], True) for s in grid] if kv_dtype == torch.float8_e4m3fn else [])
        rows = [r for r in (run(first, kv_dtype, s) for s in settings) if r]
        rows.sort(key=lambda r: r["us"])
        default = next((r for r in rows if (r["block"], r["warps"], r["stages"]) == (BLOCK_N, 4, 2)
                        and r["splits"] == decode_num_splits(first[1], first[3])), None)
        print(f"\n{first[0]} {kv_dtype}: current default {default}", flush=True)
        for r in rows[:top]:
            print("  best", r, flush=True)
        best = [(r["block"], r["warps"], r["stages"], 0, r["fp16_dots"]) for r in rows[:top]]
        for shape in SHAPES[1:]:
            print(f"{shape[0]} {kv_dtype}:", flush=True)
            for setting in [(BLOCK_N, 4, 2, 0)] + best:
                print("  ", run(shape, kv_dtype, setting), flush=True)


if __name__ == "__main__":
    sys.exit(main())
