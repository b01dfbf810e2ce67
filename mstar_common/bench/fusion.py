"""Decode-step GPU time per configuration: what each fusion buys, measured by replaying a captured step.

For each config (attention backend, fused norms/activation) and batch size, the model is captured as a
decode graph over rows of `context_len` tokens, and the replay is timed with CUDA events (median of 50):
the GPU time of one decode step with no host in it. The eager step (no graph) is timed too, host included.

`profile_step` breaks one captured step, configured as the server configures it, into its kernels.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar_common.bench.gpu_timing import event_time_ms

CONFIGS = {  # name -> (attention backend, fused norms + activation)
    "fused (triton prologue + norm + act)": ("triton", True),
    "unfused prologue": ("triton_unfused", True),
    "unfused norm + act": ("triton", False),
    "all unfused": ("triton_unfused", False),
}


@dataclass
class _Seq:
    """The fields of a `Sequence` the runner reads when it samples a row."""

    params: object
    seed: int = 0
    num_output_tokens: int = 0
    generator: object = None
    token_ids: tuple = ()


SAMPLING = {  # profile_step's sampling settings: each row's parameters, and the graph variant they replay
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},  # the temperature-alone variant
    "top_k_top_p": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},  # Qwen3's recommended settings
}


def _decode_batch(rows: int, context_len: int, page_size: int, sampling: str = "greedy"):
    from mstar_common.engine.model_runner import HostBatch
    from mstar_common.engine.types import SamplingParams

    pages_per_row = -(-context_len // page_size)
    batch = HostBatch()
    for row in range(rows):
        pages = list(range(row * pages_per_row, (row + 1) * pages_per_row))
        pos = context_len - 1
        batch.input_ids.append(11 + row)
        batch.positions.append(pos)
        batch.slot_mapping.append(pages[pos // page_size] * page_size + pos % page_size)
        batch.query_lens.append(1)
        batch.context_lens.append(context_len)
        batch.page_tables.append(pages)
        batch.sample_indices.append(row)
        batch.sampling_seqs.append(_Seq(SamplingParams(**SAMPLING[sampling]), seed=row))
    return batch


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _prefill_batch(rows: int, prompt_len: int, page_size: int, sampling: str = "greedy"):
    """`rows` fresh prompts of `prompt_len` tokens in one step (each samples its first token as `sampling` says), on
    the pages after those of `_decode_batch`'s rows."""
    from mstar_common.engine.model_runner import HostBatch
    from mstar_common.engine.types import SamplingParams

    pages_per_row = -(-prompt_len // page_size)
    batch = HostBatch()
    for row in range(rows):
        pages = list(range(row * pages_per_row, (row + 1) * pages_per_row))
        batch.input_ids += [(11 + row * 7 + i) % 1000 for i in range(prompt_len)]
        batch.positions += range(prompt_len)
        batch.slot_mapping += [pages[pos // page_size] * page_size + pos % page_size for pos in range(prompt_len)]
        batch.query_lens.append(prompt_len)
        batch.context_lens.append(prompt_len)
        batch.page_tables.append(pages)
        batch.sample_indices.append(len(batch.input_ids) - 1)
        batch.sampling_seqs.append(_Seq(SamplingParams(**SAMPLING[sampling]), seed=row))
    return batch


def _load(checkpoint: str | Path, family: str, batch_sizes: list[int], context_len: int, page_size: int,
          min_pages: int = 0, kv_dtype: str = "auto"):
    """The model in bf16 on the GPU and a KV cache holding `max(batch_sizes)` rows of `context_len` tokens
    (at least `min_pages` pages), filled with random values (decode attends over real-looking values, not
    zeros); `kv_dtype` as `resources.kv_cache.dtype` (auto: bf16, or fp8_e4m3)."""
    from mstar_common.engine.ar_engine import _KV_DTYPES
    from mstar_common.engine.kv_cache import KVCache

    if family == "llama":
        from mstar_common.families.llama.loader import load_llama as load
    else:
        from mstar_common.families.qwen3.loader import load_qwen3 as load
    model, config = load(checkpoint, dtype="bfloat16", device="cuda")
    num_pages = max(max(batch_sizes) * -(-context_len // page_size), min_pages) + 1
    kv_cache = KVCache(model.kv_spec, num_pages, page_size, _KV_DTYPES.get(kv_dtype, torch.bfloat16), "cuda")
    kv_cache._pool.copy_(torch.randn(kv_cache._pool.shape, device="cuda", dtype=torch.bfloat16))
    return model, config, kv_cache


def _decode_graphs(model, config, kv_cache, batch_sizes: list[int], token_buckets: list[int] | None = None,
                   max_rows: int = 1, capture_sampling: bool = False):
    """The engine's graphs, with the device-side repetition-penalty state the engine keeps on CUDA (its rows carry
    penalty 1.0: the scratch slot), so that the sampling variants run the penalty's launches as served."""
    from mstar_common.engine.cuda_graph import CudaGraphRunner, GraphConfig
    from mstar_common.engine.model_runner import logits_window
    from mstar_common.engine.penalty import PenaltyState

    rows = max(batch_sizes + [max_rows])
    penalty = PenaltyState(rows, *reversed(logits_window(model, config["vocab_size"])), torch.device("cuda"))
    graphs = CudaGraphRunner(model, kv_cache, GraphConfig(batch_sizes, token_buckets or [64], capture_sampling),
                             rows, 4096, config["vocab_size"], torch.device("cuda"), penalty)
    graphs.capture()
    return graphs


def _penalty_off(graphs, batch):
    """`batch` with every sampling row on the graphs' scratch penalty slot, penalty off (where the graphs carry the
    repetition penalty's state: the engine fills these rows itself)."""
    if graphs.penalty is not None and len(batch.penalty_slots) < len(batch.sampling_seqs):
        batch.penalty_slots = [graphs.penalty.scratch] * len(batch.sampling_seqs)
        batch.penalties = [1.0] * len(batch.sampling_seqs)
    return batch


def _staged_replay(graphs, rows: int, context_len: int, page_size: int, batch=None, sampling: str = "greedy"):
    """Fill the step buffers with `batch` (default: a decode batch of `rows` rows sampling as `sampling` says);
    returns (the batch, its graph's replay)."""
    batch = _penalty_off(graphs, batch if batch is not None else _decode_batch(rows, context_len, page_size, sampling))
    key = graphs.pick(batch)
    graphs._fill(graphs.buffers.host_views(0), batch, key)
    graphs._plan(key, graphs.buffers.host_views(0))  # the attention backend's plan (FlashInfer's; else a no-op)
    graphs.buffers.copy_in(0, graphs._shape(key[0], key[1])[0])
    graphs.buffers.mirror(0)  # replays that read the host mirror themselves alternate between the two
    graphs.resync()
    return batch, graphs.graphs[key].replay


@torch.inference_mode()
def measure(checkpoint: str | Path, family: str, batch_sizes: list[int], context_len: int = 768,
            page_size: int = 64) -> list[dict]:
    from mstar_common.engine.attention import select_attention_backend
    from mstar_common.engine.model_runner import ModelRunner
    from mstar_common.engine.sampler import Sampler

    model, config, kv_cache = _load(checkpoint, family, batch_sizes, context_len, page_size)
    results = []
    for name, (backend, fused_ops) in CONFIGS.items():
        model.attn_backend = select_attention_backend("cuda", backend)
        model.enable_fused_ops(fused_ops)
        graphs = _decode_graphs(model, config, kv_cache, batch_sizes)
        runner = ModelRunner(model, kv_cache, Sampler(), torch.device("cuda"), config["vocab_size"])
        for rows in batch_sizes:
            batch, replay = _staged_replay(graphs, rows, context_len, page_size)
            graph_ms = event_time_ms(replay)
            eager_ms = _time_host(lambda batch=batch, runner=runner: runner._run_eager(batch))
            results.append({"config": name, "batch": rows, "graph_step_ms": graph_ms, "eager_step_ms": eager_ms})
            print(f"[fusion] {family} {name:40s} batch {rows:3d}: graph {graph_ms:.3f} ms, eager {eager_ms:.3f} ms",
                  flush=True)
        del graphs
        torch.cuda.empty_cache()
    del model, kv_cache
    torch.cuda.empty_cache()
    return results


def _time_host(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def profile_step(checkpoint: str | Path, family: str, batch_sizes: list[int], context_len: int = 768,
                 page_size: int = 64, replays: int = 20, prefill: tuple[int, int] | None = None,
                 kv_dtype: str = "auto", sampling: tuple[str, ...] = ("greedy",)) -> list[dict]:
    """Each batch size's decode step as the server runs it (the component defaults: Triton attention, fused
    ops, the tuned skinny GEMM), captured and replayed under the torch profiler: per kernel name, its GPU time
    per step and its calls per step, next to the replay's wall time (CUDA events), so that the gaps between
    kernels show as the difference. `prefill` (rows, prompt length): also a step of that many fresh prompts,
    replayed from the smallest captured prefill/mixed bucket that holds it. `sampling`: the rows sample as each of
    these `SAMPLING` settings says, each step replaying its graph variant."""
    from mstar_common.bench.gpu_timing import profiled
    from mstar_common.config import ComponentConfig
    from mstar_common.engine.cuda_graph import configure_fast_path

    min_pages = prefill[0] * -(-prefill[1] // page_size) if prefill else 0
    model, config, kv_cache = _load(checkpoint, family, batch_sizes, context_len, page_size, min_pages, kv_dtype)
    configure_fast_path(model, ComponentConfig(), "cuda", max(batch_sizes), 4096)
    token_buckets = [_next_power_of_2(prefill[0] * prefill[1])] if prefill else None
    graphs = _decode_graphs(model, config, kv_cache, batch_sizes, token_buckets, prefill[0] if prefill else 1,
                            capture_sampling=sampling != ("greedy",))
    steps = [(rows, None, mode) for rows in batch_sizes for mode in sampling]
    steps += [(prefill[0], prefill[1], mode) for mode in sampling] if prefill else []
    results = []
    for rows, prompt_len, mode in steps:
        batch = _prefill_batch(rows, prompt_len, page_size, mode) if prompt_len else None
        _, replay = _staged_replay(graphs, rows, context_len, page_size, batch, mode)
        step_ms = event_time_ms(replay)
        prof = profiled(replay, replays)
        kernels: dict[str, list[float]] = {}
        timeline = []
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us() > 0:
                kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
                timeline.append((event.time_range.start, event.time_range.end, event.name))
        table = sorted(({"kernel": name[:120], "us_per_step": sum(times) / replays,
                         "calls_per_step": len(times) / replays} for name, times in kernels.items()),
                       key=lambda row: -row["us_per_step"])
        busy_ms = sum(row["us_per_step"] for row in table) / 1e3
        kind = "decode" if prompt_len is None else f"prefill of {prompt_len}-token prompts"
        kind += "" if mode == "greedy" else f", sampling ({mode})"
        critical = critical_path(timeline, replays, config["num_hidden_layers"])
        gaps = idle_gaps(timeline, replays)
        results.append({"family": family, "kv_dtype": kv_dtype, "rows": rows, "context_len": prompt_len or context_len,
                        "step": kind, "step_ms": step_ms, "kernel_busy_ms": busy_ms, "kernels": table,
                        "critical_path": critical, "idle_gaps": gaps})
        print(f"[profile] {family} {kind} rows {rows} context {prompt_len or context_len}: replay {step_ms:.3f} ms, "
              f"kernels busy {busy_ms:.3f} ms, {sum(r['calls_per_step'] for r in table):.0f} launches", flush=True)
        for row in table[:25]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  {row['kernel']}", flush=True)
        print("  critical path (each kernel's end after the end before it):", flush=True)
        for row in critical[:25]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  {row['kernel']}", flush=True)
        idle_us = sum(g["us_per_step"] for g in gaps)
        print(f"  idle GPU between kernels: {idle_us:.1f} us a step; the largest:", flush=True)
        for row in gaps[:8]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:5.1f}  {row['between']}", flush=True)
    del graphs, model, kv_cache
    torch.cuda.empty_cache()
    return results


def idle_gaps(timeline: list[tuple[float, float, str]], replays: int) -> list[dict]:
    """Where the GPU ran no kernel (between the replays too, back to back): per (kernel before, kernel after), the
    idle time a step, largest first."""
    gaps: dict[str, list[float]] = {}
    latest, last_name = None, None
    for start, end, name in sorted(timeline):
        if latest is not None and start > latest:
            gaps.setdefault(f"{last_name[:50]} -> {name[:50]}", []).append(start - latest)
        if latest is None or end >= latest:
            latest, last_name = end, name
    return sorted(({"between": label, "us_per_step": sum(times) / replays, "calls_per_step": len(times) / replays}
                   for label, times in gaps.items()), key=lambda row: -row["us_per_step"])


def critical_path(timeline: list[tuple[float, float, str]], replays: int, layers: int) -> list[dict]:
    """Where a step's time goes when its kernels overlap (PDL): each kernel is charged the time from the latest
    end of the kernels before it (in start order) to its own end, so the charges add up to the span from the
    first start to the last end. A kernel name called k x `layers` times per step is split by its place in the
    layer (`name#0` .. `name#k-1`: the GEMV's projections in order). Gaps between replays are not charged."""
    timeline = sorted(timeline)
    counts: dict[str, int] = {}
    for _, _, name in timeline:
        counts[name] = counts.get(name, 0) + 1
    per_step = {name: count // replays for name, count in counts.items()}
    seen: dict[str, int] = {}
    charged: dict[str, float] = {}
    calls: dict[str, int] = {}
    latest = None
    for start, end, name in timeline:
        index = seen.get(name, 0)
        seen[name] = index + 1
        label = name[:80]
        calls_per_step = per_step[name]
        if layers and calls_per_step > layers and calls_per_step % layers == 0:
            label += f"#{(index % calls_per_step) % (calls_per_step // layers)}"
        base = start if latest is None or start > latest else latest  # a kernel after an idle gap: from its start
        charged[label] = charged.get(label, 0.0) + max(end - base, 0.0)
        calls[label] = calls.get(label, 0) + 1
        latest = end if latest is None else max(latest, end)
    return sorted(({"kernel": label, "us_per_step": us / replays, "calls_per_step": calls[label] / replays}
                   for label, us in charged.items()), key=lambda row: -row["us_per_step"])


@torch.inference_mode()
def ab_steps(checkpoint: str | Path, family: str, batch_sizes: list[int], variants: dict[str, dict[str, str]],
             context_len: int = 640, page_size: int = 64, rounds: int = 7, replays: int = 20,
             served_like: bool = False, kv_dtype: str = "auto") -> list[dict]:
    """A/B of kernel switches in one process: each variant's environment (`MSTAR_*` switches) is set while the
    model is configured as the server configures it and its decode steps are captured; then the variants'
    replays are timed in alternation, `rounds` times (each the median of `replays` event-timed replays), so
    that clock and thermal drift between separate runs (a few percent on the H200) cannot pass for a
    difference. Returns, per variant and batch size, every round's time and their median. `served_like`: also
    each variant's steps as the engine runs them (`served_like_ms`). A variant's `MSTAR_AB_ATTENTION_BACKEND`
    (not an engine switch) picks its attention backend, as a component's `attention_backend` does."""
    from mstar_common.config import ComponentConfig
    from mstar_common.engine.cuda_graph import configure_fast_path

    model, config, kv_cache = _load(checkpoint, family, batch_sizes, context_len, page_size, kv_dtype=kv_dtype)
    captured = {}
    for name, env in variants.items():
        with scoped_environment(env):
            component = ComponentConfig(attention_backend=env.get("MSTAR_AB_ATTENTION_BACKEND", "auto"))
            configure_fast_path(model, component, "cuda", max(batch_sizes), 4096)
            captured[name] = _decode_graphs(model, config, kv_cache, batch_sizes)
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for rows in batch_sizes:
            for name, graphs in captured.items():
                _, replay = _staged_replay(graphs, rows, context_len, page_size)
                times.setdefault((name, rows), []).append(event_time_ms(replay, repeats=replays))
    results = []
    for (name, rows), ms in times.items():
        median = sorted(ms)[len(ms) // 2]
        results.append({"family": family, "kv_dtype": kv_dtype, "variant": name, "env": variants[name], "rows": rows,
                        "context_len": context_len, "step_ms": median, "rounds_ms": ms})
        print(f"[ab] {family} rows {rows:3d} {name:24s} {median:.4f} ms  (rounds {min(ms):.4f}-{max(ms):.4f})",
              flush=True)
    if served_like:
        for rows in batch_sizes:
            for name, graphs in captured.items():
                for gather in (True, False):
                    with scoped_environment(variants[name]):  # switches read by the served loop's own objects
                        ms = served_like_ms(graphs, rows, context_len, page_size, gather=gather)
                    results.append({"family": family, "variant": name, "env": variants[name], "rows": rows,
                                    "context_len": context_len, "served_like_ms": ms, "gather": gather})
                    print(f"[ab] {family} rows {rows:3d} {name:24s} served-like {ms:.4f} ms per step "
                          f"({'with' if gather else 'without'} the token gather)", flush=True)
    del captured, model, kv_cache
    torch.cuda.empty_cache()
    return results


@contextlib.contextmanager
def scoped_environment(env: dict[str, str]):
    """`env` set in `os.environ` for the block, the previous values back after it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def served_like_ms(graphs, rows: int, context_len: int, page_size: int, steps: int = 200,
                   gather: bool = True) -> float:
    """GPU time per decode step when steps run as the engine runs them with overlap: per step the host fills the
    inputs, copies them in, gathers the previous step's tokens into the input ids (`gather`), replays the graph
    and starts the token readback; step N is collected after step N+1 is launched. Against a bare replay this
    is what the served loop adds on the GPU."""
    from mstar_common.engine.model_runner import TokenReadback

    batch = _penalty_off(graphs, _decode_batch(rows, context_len, page_size))
    if gather:
        batch.gather_dst, batch.gather_src = list(range(rows)), list(range(rows))
    readback = TokenReadback(rows, torch.device("cuda"))
    last = graphs.buffers.out_tokens[:rows]
    graphs.resync()  # after bare replays, which flip the parity the graphs read without the host's count

    def launch():
        tokens = graphs.try_replay(batch, last)
        return readback.start(batch.sampling_seqs, tokens, graphs.last_host_tokens)

    for _ in range(5):
        launch().tokens()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    previous = None
    for _ in range(steps):
        pending = launch()
        if previous is not None:
            previous.tokens()
        previous = pending
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / steps


@torch.inference_mode()
def tune_step_plans(checkpoint: str | Path, family: str, rows: int = 1, context_len: int = 640, page_size: int = 64,
                    replays: int = 30, rounds: int = 7, budget_s: float = 240.0) -> dict:
    """The skinny GEMM's settings chosen by whole decode steps instead of one projection at a time: starting from
    the server's tuned plan (`tune_gemv`, each projection timed behind a norm launch), each projection shape in
    turn (qkv, o, gate_up, down: every layer's module of that shape together) tries every candidate setting, the
    `rows`-row step is captured again and its replay timed, and the fastest is kept (coordinate descent, one
    pass, until `budget_s`). In a step a projection runs behind another kernel whose programs hold registers and
    stream bytes of their own, which the per-projection timing does not see. Ends with an A/B of the two plans in
    one process (alternating replays, median of `rounds`). Returns every timing, both plans and `step_settings`:
    the changed shapes' GEMV-cache entries (`mstar_common.layers.linear.step_setting_key`), which
    scripts/tune_step_gemv.py `--write-cache` stores for the server."""
    from mstar_common.config import ComponentConfig
    from mstar_common.engine.cuda_graph import configure_fast_path
    from mstar_common.layers.linear import GemvLinear, gemv_candidates, step_setting_key

    model, config, kv_cache = _load(checkpoint, family, [rows], context_len, page_size)
    configure_fast_path(model, ComponentConfig(), "cuda", rows, 4096)
    groups: dict[tuple[int, int], list] = {}
    for module in model.modules():
        if isinstance(module, GemvLinear) and rows in module.gemv_plan:
            groups.setdefault((module.out_features, module.in_features), []).append(module)
    start_plan = {shape: modules[0].gemv_plan[rows] for shape, modules in groups.items()}

    def apply(plan):
        for shape, modules in groups.items():
            for module in modules:
                module.gemv_plan = {**module.gemv_plan, rows: tuple(plan[shape])}

    def capture(plan):
        apply(plan)
        graphs = _decode_graphs(model, config, kv_cache, [rows])
        return graphs, _staged_replay(graphs, rows, context_len, page_size)[1]

    def step_ms(plan) -> float:
        graphs, replay = capture(plan)
        ms = event_time_ms(replay, repeats=replays)
        del graphs, replay
        return ms

    began = time.monotonic()
    best_plan = dict(start_plan)
    best_ms = step_ms(best_plan)
    trials = [{"plan": {f"{n}x{k}": list(s) for (n, k), s in best_plan.items()}, "step_ms": best_ms, "start": True}]
    print(f"[step-tune] {family} rows {rows}: start {best_ms:.4f} ms with {start_plan}", flush=True)
    for shape in groups:
        for setting in gemv_candidates(rows, *shape):
            if time.monotonic() - began > budget_s:
                break
            plan = {**best_plan, shape: setting}
            if plan == best_plan:
                continue
            ms = step_ms(plan)
            trials.append({"shape": f"{shape[0]}x{shape[1]}", "setting": list(setting), "step_ms": ms})
            print(f"[step-tune]   {shape[0]}x{shape[1]} {setting}: {ms:.4f} ms", flush=True)
            if ms < best_ms * 0.995:
                best_plan, best_ms = plan, ms
        print(f"[step-tune] {shape[0]}x{shape[1]} -> {best_plan[shape]} ({best_ms:.4f} ms)", flush=True)
    captured = {"tuned": capture(start_plan), "step_tuned": capture(best_plan)}
    times: dict[str, list[float]] = {name: [] for name in captured}
    for _ in range(rounds):
        for name, (_, replay) in captured.items():
            times[name].append(event_time_ms(replay, repeats=replays))
    ab = {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}
    print(f"[step-tune] A/B: tuned {ab['tuned']:.4f} ms, step-tuned {ab['step_tuned']:.4f} ms", flush=True)
    captured.clear()
    torch.cuda.empty_cache()
    changed = {shape: modules[0] for shape, modules in groups.items() if best_plan[shape] != start_plan[shape]}
    return {"family": family, "rows": rows, "context_len": context_len,
            "step_settings": {step_setting_key(m.weight, m.bias, rows): list(best_plan[shape])
                              for shape, m in changed.items()},
            "start_plan": {f"{n}x{k}": list(s) for (n, k), s in start_plan.items()},
            "step_plan": {f"{n}x{k}": list(s) for (n, k), s in best_plan.items()}, "trials": trials,
            "ab_ms": ab, "ab_rounds_ms": times}
