#!/usr/bin/env python
"""Times the on-device sampling filters inside captured CUDA graphs: the sorted top-k/top-p form against the sort-free
kernel (mstar_kernels/top_k_top_p.py), and the whole `sample_on_device` with each, for 1 to 256 rows. The default
width is Orpheus's audio window (28,672 logits: one program a row); `--vocab 151936` is Qwen3's whole vocabulary
(the chunked search). `--top-k` adds a top-k cut to every row (0: top-p alone); the whole sampler is also timed with
both filters off (temperature alone), and as the engine's temperature-alone graph variant runs it (`filters=False`:
`sampler_plain_us`; `_bf16`: from bf16 logits), and with and without `MSTAR_TOP_P_REJECT`'s rejection for the rows
the fast path declines (`sampler_reject_us`, `sampler_search_us`). The result decides `MSTAR_TOP_P_KERNEL`. Past
32,768 logits the chunked search is timed with its fast path (`MSTAR_TOP_P_FAST`, the default) and without
(`_chain_us`); `--std` sets the logits' spread (the default 1/0.6 is a flat row, on which top-p alone keeps most of
the vocabulary and the fast path declines it; 8 is a peaked one), and `--decay A` subtracts `A * log(1 + column)`, a
stand-in for a vocabulary ordered by frequency, where the likely tokens crowd the first columns.
Which rows the fast path finishes, for top-k 20/50/100/400/1000, top-p 0.9/0.95 and top-k 20 + top-p 0.8 (any device; on
the CPU with TRITON_INTERPRET=1): python scripts/sweep_sampling.py --vocab 151936 --coverage 2 [--std S] [--decay A]

Device: source .device/prepare.sh && python scripts/sweep_sampling.py [--vocab N] [--top-k K] [--out sampling.json]
Each kernel's GPU time: python scripts/sweep_sampling.py --vocab 151936 --top-k 20 --profile 1 64
Where the kept sets differ: python scripts/sweep_sampling.py --boundary-check 256 (any device; on the CPU with
TRITON_INTERPRET=1) lists each differing token with the fp64 probability mass ranked above it, so a difference
can be told apart from a bug: it must sit at the top_p boundary, within fp32 rounding of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=28_672)
    parser.add_argument("--top-k", type=int, default=0, help="a top-k cut on every row beside top_p 0.8 (0: none)")
    parser.add_argument("--std", type=float, default=1 / 0.6, help="the random logits' standard deviation")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--boundary-check", type=int, metavar="ROWS", help="only the kept-set comparison")
    parser.add_argument("--decay", type=float, default=0.0, help="subtract decay * log(1 + column) from the logits")
    parser.add_argument("--profile", type=int, nargs="+", metavar="ROWS", help="only each kernel's GPU time")
    parser.add_argument("--coverage", type=int, metavar="ROWS", help="only which rows the fast path finishes")
    args = parser.parse_args()
    if args.boundary_check:
        return boundary_check(args.boundary_check, args.vocab)
    if args.coverage:
        return coverage(args.coverage, args.vocab, args.std, args.decay)
    if args.profile:
        results = [profile_rows(rows, args.vocab, args.top_k, args.std, args.decay) for rows in args.profile]
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return 0
    results = []
    for rows in (1, 16, 64, 256):
        results.append(time_rows(rows, args.vocab, args.top_k, args.std, args.decay))
        print(results[-1], flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def random_logits(rows: int, vocab: int, std: float, decay: float, device: str):
    """`rows` rows of normal logits of spread `std`, less `decay * log(1 + column)`."""
    import torch

    logits = torch.randn(rows, vocab, device=device) * std
    if decay:
        logits -= decay * torch.log1p(torch.arange(vocab, device=device, dtype=torch.float32))
    return logits


def coverage(rows: int, vocab: int, std: float, decay: float) -> int:
    """Per filter setting (temperature 0.7): how many of `rows` rows the fast path finishes, and for those it
    bounds, the most tokens gathered in one chunk and in the row (it takes at most FAST_CAP_CHUNK and FAST_CAP)."""
    import torch

    from mstar_kernels.top_k_top_p import FAST_CAP, FAST_CAP_CHUNK, ChunkedSearch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"{vocab} logits, std {std:g}, decay {decay:g}, on {device}; the fast path gathers at most "
          f"{FAST_CAP_CHUNK} a chunk and {FAST_CAP} a row")
    for top_k, top_p in ((20, 1.0), (50, 1.0), (100, 1.0), (400, 1.0), (1000, 1.0), (vocab, 0.9), (vocab, 0.95),
                         (20, 0.8)):
        logits = random_logits(rows, vocab, std, decay, device)
        search = ChunkedSearch(logits, fast=True)
        ones = torch.ones(rows, device=device)
        search.run(0.7 * ones, torch.full((rows,), top_k, dtype=torch.int32, device=device),
                   top_p * ones, torch.zeros_like(ones))
        bounded = search.bound > 0
        counts = search.counts[bounded]
        gathered = f"most gathered {int(counts.max())} a chunk, {int(counts.sum(1).max())} a row" if len(counts) else ""
        print(f"  top_k {top_k if top_k < vocab else 'off'}, top_p {top_p}: finished {int(search.done.sum())} of "
              f"{rows}, bounded {int(bounded.sum())} {gathered}", flush=True)
    return 0


def time_rows(rows: int, vocab: int, top_k_cut: int, std: float = 1 / 0.6, decay: float = 0.0) -> dict:
    import inspect

    import torch

    import mstar_kernels.sampling as sampling
    import mstar_kernels.top_k_top_p as filters
    from mstar_common.bench.gpu_timing import graph_time_us
    from mstar_common.engine.sampler import apply_top_k_top_p
    from mstar_kernels.top_k_top_p import MAX_VOCAB, ChunkedSearch, top_k_top_p, top_k_top_p_chunked

    logits = random_logits(rows, vocab, std, decay, "cuda")
    top_k = torch.full((rows,), top_k_cut or vocab, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.8, device="cuda")
    sort_us = graph_time_us(lambda: apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None]), calls=5)
    kernel_us = graph_time_us(lambda: top_k_top_p(logits, top_k, top_p), calls=5)
    same = torch.equal(torch.isfinite(top_k_top_p(logits, top_k, top_p)),
                       torch.isfinite(apply_top_k_top_p(logits, top_k[:, None].long(), top_p[:, None])))
    row = {"rows": rows, "vocab": vocab, "top_k": top_k_cut, "top_p": 0.8, "std": std, "decay": decay,
           "sorted_us": round(sort_us, 1),
           "kernel_us": round(kernel_us, 1), "same_kept_sets": same}
    chunked = vocab > MAX_VOCAB
    if chunked:
        search = ChunkedSearch(logits, fast=True)
        ones = torch.ones(rows, device="cuda")
        search.run(ones, top_k, top_p, torch.zeros_like(ones))
        row["fast_path_rows"] = int(search.done.sum())
        row["kernel_chain_us"] = round(graph_time_us(
            lambda: top_k_top_p_chunked(logits, top_k, top_p, fast=False), calls=5), 1)
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    temperature = torch.full((rows,), 0.7, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    off_k, off_p = torch.full_like(top_k, vocab), torch.ones_like(top_p)
    forms = [("sorted", False, True), ("kernel", True, True)] + ([("kernel_chain", True, False)] if chunked else [])
    for label, k, p in (("sampler", top_k, top_p), ("sampler_filters_off", off_k, off_p)):
        for form, sort_free, fast in forms:
            sampling._SORT_FREE_FILTER, filters.FAST_PATH = sort_free, fast
            row[f"{label}_{form}_us"] = round(graph_time_us(
                lambda k=k, p=p: sampling.sample_on_device(logits, greedy, temperature, k, p, min_p, seeds),
                calls=5), 1)
    sampling._SORT_FREE_FILTER, filters.FAST_PATH = True, True
    if "filters" in inspect.signature(sampling.sample_on_device).parameters:  # the temperature-alone variant
        for label, x in (("", logits), ("_bf16", logits.to(torch.bfloat16))):
            row[f"sampler_plain{label}_us"] = round(graph_time_us(
                lambda x=x: sampling.sample_on_device(x, greedy, temperature, off_k, off_p, min_p, seeds,
                                                      filters=False), calls=5), 1)
        row["sampler_bf16_us"] = round(graph_time_us(lambda: sampling.sample_on_device(
            logits.to(torch.bfloat16), greedy, temperature, top_k, top_p, min_p, seeds), calls=5), 1)
    if chunked and hasattr(sampling, "_REJECT"):  # MSTAR_TOP_P_REJECT: the rows the fast path declines
        saved = sampling._REJECT
        for label, reject in (("reject", True), ("search", False)):
            sampling._REJECT = reject
            row[f"sampler_{label}_us"] = round(graph_time_us(
                lambda: sampling.sample_on_device(logits, greedy, temperature, top_k, top_p, min_p, seeds),
                calls=5), 1)
        sampling._REJECT = saved
    return row


def profile_rows(rows: int, vocab: int, top_k_cut: int, std: float, decay: float = 0.0, calls: int = 20) -> dict:
    """`sample_on_device` (top_p 0.8, temperature 0.7, the `--top-k` cut) under torch's profiler, eagerly: each
    kernel's mean GPU time a call, with the fast path and without, and with temperature alone (`filters=False`)."""
    import torch

    import mstar_kernels.sampling as sampling
    import mstar_kernels.top_k_top_p as filters
    from mstar_common.bench.gpu_timing import profiled

    logits = random_logits(rows, vocab, std, decay, "cuda")
    top_k = torch.full((rows,), top_k_cut or vocab, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.8, device="cuda")
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    temperature = torch.full((rows,), 0.7, device="cuda")
    min_p, seeds = torch.zeros(rows, device="cuda"), torch.arange(rows, device="cuda")
    result = {"rows": rows, "vocab": vocab, "top_k": top_k_cut, "top_p": 0.8, "std": std, "decay": decay}
    off = (torch.full_like(top_k, vocab), torch.ones_like(top_p))
    for form, fast, cuts, extra in (("fast", True, (top_k, top_p), {}), ("chain", False, (top_k, top_p), {}),
                                    ("temperature_alone", True, off, {"filters": False})):
        filters.FAST_PATH = fast

        prof = profiled(lambda cuts=cuts, extra=extra: sampling.sample_on_device(
            logits, greedy, temperature, *cuts, min_p, seeds, **extra), calls)
        kernels = {}
        for event in prof.key_averages():
            if str(getattr(event, "device_type", "")).endswith("CUDA") and event.count:
                kernels[event.key] = (round(event.device_time_total / calls, 1), event.count // calls)
        result[form] = dict(sorted(kernels.items(), key=lambda kv: -kv[1][0]))
        print(f"{rows} rows, {form}: {sum(us for us, _ in kernels.values()):.1f} us of kernels a call", flush=True)
        for name, (us, count) in result[form].items():
            print(f"  {us:8.1f} us  x{count}  {name[:90]}", flush=True)
    filters.FAST_PATH = True
    return result


def boundary_check(rows: int, vocab: int, top_p: float = 0.8) -> int:
    import torch

    from mstar_common.engine.sampler import apply_top_k_top_p
    from mstar_kernels.top_k_top_p import top_k_top_p

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device) / 0.6
    top_k = torch.full((rows,), vocab, dtype=torch.int32, device=device)
    top_ps = torch.full((rows,), top_p, device=device)
    ours = torch.isfinite(top_k_top_p(logits, top_k, top_ps)).cpu()
    ref = torch.isfinite(apply_top_k_top_p(logits, top_k[:, None].long(), top_ps[:, None])).cpu()
    probs = torch.softmax(logits.double().cpu(), -1)
    differing = (ours != ref).nonzero().tolist()
    print(f"{rows} rows x {vocab} logits, top_p {top_p} on {device}: {len(differing)} token(s) kept differently")
    for row, token in differing:
        mass_above = float(probs[row][probs[row] > probs[row, token]].sum())
        print(f"  row {row} token {token}: kernel keeps {bool(ours[row, token])}, fp64 mass ranked above "
              f"{mass_above:.9f} (exact rule keeps it iff < {top_p})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
