"""Benchmark results -> JSON, a markdown table and one PNG figure per model (matplotlib, the `bench` extra)."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from mstar_common.bench import gpu_memory

logger = logging.getLogger(__name__)


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def json_text(value, indent: int | None = None) -> str:
    """`value` as JSON that other programs can read: a NaN or an infinity (a figure with no samples, a PSNR of
    identical images), which json.dumps writes as the bare words NaN and Infinity that JSON does not have, is null."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _load(run: dict) -> str:
    return f"c={run['concurrency']}" if run.get("concurrency") is not None else f"{run['rate']:g} req/s"


def markdown(results: dict) -> str:
    """The report. Each model's figures are labelled with the machine, date and command of the run that measured
    them (its results file's `meta`), apart from the machine the report itself was made on (`results["meta"]`)."""
    meta = results["meta"]
    lines = [f"Report made on {meta.get('hardware')} ({meta.get('software')}), {meta.get('date')}: "
             f"`{meta.get('command')}`.", ""]
    for name, model in results["models"].items():
        lines += [f"### {name}", ""]
        if run := model.get("meta"):
            lines.append(f"Measured on {run.get('hardware')} ({run.get('software')}), {run.get('date')}: "
                         f"`{run.get('command')}`.")
        else:
            lines.append("Measured on: not recorded (a results file from before runs recorded their machine).")
        bw = model.get("bandwidth") or {}
        if model.get("floor_ms") is not None:
            lines.append(f"Weights {model['weight_bytes'] / 1e9:.3f} GB; read bandwidth {bw['read_tb_per_s']:.2f} TB/s "
                         f"(copy {bw['copy_rw_tb_per_s']:.2f} TB/s read+write); weight-streaming floor "
                         f"**{model['floor_ms']:.3f} ms** per decode step.")
        if "switches" in model:  # `mstar bench serve` records them with the code it ran
            switches = ", ".join(f"`{k}={v}`" for k, v in model["switches"].items()) or "none set (the defaults)"
            lines.append(f"Code {model.get('code') or 'unknown'}; environment switches: {switches}.")
        if model.get("startup_s") is not None:
            lines.append(f"Server start to ready (load, graph capture): {model['startup_s']:.0f} s.")
        memory_line = gpu_memory.report_line(model.get("gpu_memory_mib"))
        if memory_line:
            lines.append(memory_line)
        if model.get("deployment"):
            lines.append(serving_line(model["deployment"]))
        if model.get("runs"):
            lines.append(workload_line(model["runs"][0].get("workload") or {}))
        lines += ["", "| target | load | requests | req/s | output tok/s | TTFT p50 / p90 / p99 ms "
                  "| ITL p50 / p90 / p99 ms | tokens/response | errors |", "|---|---|---|---|---|---|---|---|---|"]
        for run in model.get("runs", []):
            s = run["summary"]
            ttft, itl = s["ttft_ms"], s["itl_ms"]
            lines.append(
                f"| {run['target']} | {_load(run)} | {s['num_requests']} | {_fmt(s['requests_per_s'])} "
                f"| {_fmt(s['output_tok_per_s'], 0)} | {_fmt(ttft['p50'])} / {_fmt(ttft['p90'])} / {_fmt(ttft['p99'])} "
                f"| {_fmt(itl['p50'], 3)} / {_fmt(itl['p90'], 3)} / {_fmt(itl['p99'], 3)} "
                f"| {_fmt(s['tokens_per_response'])} | {s['num_errors']} |")
        for hf in model.get("hf_generate", []):
            lines.append(f"| HF generate | batch {hf['batch']} | {hf['batch']} | - | {_fmt(hf['output_tok_per_s'], 0)} "
                         f"| - | {_fmt(hf['itl_ms'], 3)} (mean) | - | 0 |")
        lines += [""] + [f"- {line}" for line in comparisons(model) + repeat_lines(model) + slo_lines(model)
                         + server_lines(model)] + [""]
    return "\n".join(lines)


def workload_line(workload: dict) -> str:
    """The requests a run sent: lengths, fixed or natural ends, greedy or sampled (the first level's record)."""
    if "input_data" in workload:
        (p_lo, p_hi), (o_lo, o_hi) = workload["prompt_len"], workload["output_len"]
        return (f"Workload: {workload['requests']} requests from `{workload['input_data']}`, prompts of "
                f"{p_lo}-{p_hi} tokens, max_tokens {o_lo}-{o_hi}.")

    def span(low, high) -> str:
        return f"{low}" if high is None else f"{low}-{high}"

    parts = [f"{span(workload.get('prompt_len'), workload.get('prompt_len_max'))}-token prompts"]
    if workload.get("shared_prefix_len"):
        parts.append(f"the first {workload['shared_prefix_len']} shared")
    ends = "exactly (ignore_eos)" if workload.get("ignore_eos", True) else "at most, or to EOS"
    parts.append(f"{span(workload.get('output_len'), workload.get('output_len_max'))} output tokens {ends}")
    temperature = workload.get("temperature") or 0.0
    if temperature <= 0:
        parts.append("greedy")
    else:
        knobs = [f"temperature {temperature:g}"]
        if workload.get("top_p", 1.0) != 1.0:
            knobs.append(f"top_p {workload['top_p']:g}")
        if workload.get("top_k"):
            knobs.append(f"top_k {workload['top_k']}")
        parts.append("sampled (" + ", ".join(knobs) + ")")
    return "Workload: " + "; ".join(parts) + "."


def _pages(num_pages: int | str | None) -> str:
    if num_pages is None:  # an image family's deployment: no paged pool
        return "no paged pool"
    return "sized from GPU memory (auto) in pages" if num_pages == "auto" else f"{num_pages:,} pages"


def serving_line(dep: dict) -> str:
    """The deployment settings that move the figures: the step budget, the pool, the cap and the captured graphs."""
    res, kv = dep["resources"], dep["resources"]["kv_cache"]
    parts = [f"`max_batch_tokens` {res['max_batch_tokens']:,}",
             f"KV pool {_pages(kv['num_pages'])} of {kv['page_size']} tokens, dtype {kv['dtype']}",
             f"`max_concurrent_requests` {dep['max_concurrent_requests']}"]
    def ladder(buckets: list[int] | None) -> str:
        return "the default ladder" if buckets is None else ", ".join(map(str, buckets))

    for name, comp in dep["components"].items():
        if comp.get("cuda_graphs"):
            parts.append(f"{name}: CUDA graphs for decode rows {ladder(comp.get('decode_buckets'))} and packed tokens "
                         f"{ladder(comp.get('prefill_token_buckets'))}, attention `{comp.get('attention_backend')}`")
        else:
            parts.append(f"{name}: eager on {comp['placement']['device']}")
    return "Serving: " + "; ".join(parts) + "."


def repeat_lines(model: dict) -> list[str]:
    """Levels that resent prompts of an --input-data file with the server's prefix cache on (or not known): those
    prefills were cache hits, not the full prefills the figures would otherwise be."""
    return [f"{run['target']} {_load(run)}: {run['repeated_prompts']} of {run['summary']['num_requests']} prompts "
            f"were sent before in the run (the input-data file wrapped round) with the prefix cache on or not known: "
            f"their prefills were cache hits" for run in model.get("runs", []) if run.get("repeated_prompts")]


def slo_lines(model: dict) -> list[str]:
    """Per level run with an SLO (`mstar bench --slo-ttft-ms/--slo-tpot-ms`): the share that met it, the goodput."""
    out = []
    for run in model.get("runs", []):
        slo = run["summary"].get("slo")
        if slo is None:
            continue
        bounds = " and ".join(f"{label} <= {slo[key]:g} ms" for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))
                              if slo[key] is not None)
        out.append(f"{run['target']} {_load(run)}: {slo['met']}/{run['summary']['num_requests']} requests met "
                   f"{bounds} ({slo['met_fraction']:.0%}); goodput {slo['goodput_req_per_s']:.2f} req/s")
    return out


def comparisons(model: dict) -> list[str]:
    """The headline ratios: ITL at c=1 against the floor, output tok/s against HF at the same batch."""
    out = []
    triton = [r for r in model.get("runs", []) if r["target"] == "triton" and r.get("concurrency") is not None]
    closed = {r["concurrency"]: r["summary"] for r in triton}
    workloads = {r["concurrency"]: r.get("workload") for r in triton}
    hf = {h["batch"]: h for h in model.get("hf_generate", [])}
    if 1 in closed and closed[1]["itl_ms"]["p50"] is not None:
        itl = closed[1]["itl_ms"]["p50"]
        floor = model.get("floor_ms")
        ratio = f" = {itl / floor:.2f}x the floor" if floor else ""
        out.append(f"c=1 decode ITL p50 through Triton: {itl:.3f} ms{ratio}")
    repeated = {r["concurrency"]: r.get("repeated_prompts") for r in triton}
    for conc in sorted(closed):
        if conc in hf and repeated.get(conc):
            out.append(f"c={conc}: not compared with HF generate batch {conc}: {repeated[conc]} of its prompts were "
                       f"sent before in the run with the prefix cache on, so their prefills were cache hits")
        elif conc in hf and (why := _not_hf_like(workloads[conc], hf[conc], model.get("prefix_caching"))):
            out.append(f"c={conc}: not compared with HF generate batch {conc}: {why}")
        elif conc in hf:
            ours, theirs = closed[conc]["output_tok_per_s"], hf[conc]["output_tok_per_s"]
            runs = hf[conc].get("runs_tok_per_s") or []
            spread = f" (fastest of {len(runs)} runs: {', '.join(f'{r:,.0f}' for r in runs)})" if len(runs) > 1 else ""
            out.append(f"c={conc}: {ours:,.0f} output tok/s vs HF generate batch {conc}: {theirs:,.0f} tok/s{spread} "
                       f"= {ours / theirs:.1f}x")
    for check, value in (model.get("checks") or {}).items():
        out.append(f"{check}: {value}")
    return out


def _not_hf_like(workload: dict | None, hf: dict, prefix_caching: bool | None = None) -> str | None:
    """Why a served level's workload is not the one HF generate ran, greedy at fixed lengths over whole prompts
    (None: it is, or either side's record predates the lengths it needs)."""
    if not workload or "prompt_len" not in hf:
        return None
    fixed = f"HF ran {hf['prompt_len']}-token prompts and exactly {hf['output_len']} output tokens"
    if "input_data" in workload:
        source = f"the served prompts came from {workload['input_data']}"
        (p_lo, p_hi), (o_lo, o_hi) = workload["prompt_len"], workload["output_len"]
        if "ignore_eos" not in workload or (p_lo, p_hi, o_lo, o_hi) != (hf["prompt_len"], hf["prompt_len"],
                                                                          hf["output_len"], hf["output_len"]):
            return f"{source} ({p_lo}-{p_hi} tokens, max_tokens {o_lo}-{o_hi}); {fixed}"
        if workload["ignore_eos"] != [True]:
            return f"{source}, and not every entry sets ignore_eos true (a request could stop at an EOS); {fixed}"
        if any(t is None or t != 0 for t in workload["temperature"]):
            return f"{source}, and not every entry sets temperature 0 (greedy); HF ran greedy"
        if workload.get("stops"):
            return f"{source}, and some entries stop at a string or token (ignore_eos does not stop that); {fixed}"
        return None
    served = (workload.get("prompt_len"), workload.get("prompt_len_max") or workload.get("prompt_len"),
              workload.get("output_len"), workload.get("output_len_max") or workload.get("output_len"))
    if served != (hf["prompt_len"], hf["prompt_len"], hf["output_len"], hf["output_len"]):
        return f"the served lengths were {served[0]}-{served[1]} in, {served[2]}-{served[3]} out; {fixed}"
    if not workload.get("ignore_eos", True):
        return f"the served requests could stop at an EOS (no ignore_eos); {fixed}"
    if workload.get("temperature"):
        return f"the served requests sampled (temperature {workload['temperature']}); HF ran greedy"
    if workload.get("shared_prefix_len") and prefix_caching:
        return (f"the prefix cache served the prompts' shared first {workload['shared_prefix_len']} tokens; "
                "HF prefilled every prompt whole")
    return None


def server_lines(model: dict) -> list[str]:
    """Per level, the mean TTFT and ITL the serving component itself recorded (request arrival at it -> first
    token sent, and the gaps between its sends) beside the client's means: the TTFT difference is the path
    through Triton (and the proxy) and back. Then, per level, the engines' steps (`cli.server_steps`)."""
    parts = []
    for run in model.get("runs", []):
        server, client = run.get("server"), run["summary"]
        if not server or server.get("ttft_ms_mean") is None:
            continue
        part = f"{run['target']} {_load(run)}: TTFT {server['ttft_ms_mean']:.3f} ms"
        if client["ttft_ms"].get("mean") is not None:
            part += f" (client {client['ttft_ms']['mean']:.3f})"
        if server.get("itl_ms_mean") is not None:
            part += f", ITL {server['itl_ms_mean']:.3f} ms"
            if client["itl_ms"].get("mean") is not None:
                part += f" (client {client['itl_ms']['mean']:.3f})"
        parts.append(part)
    lines = []
    if parts:
        lines.append("server side, means (arrival at the component -> first token sent; gaps between its sends): "
                     + "; ".join(parts))
    steps = []
    for run in model.get("runs", []):
        s = (run.get("server") or {}).get("steps")
        if s:
            padding = "-" if s.get("padding_share") is None else f"{s['padding_share']:.0%}"
            steps.append(f"{run['target']} {_load(run)}: {s['steps']:,} steps, {s['rows_per_step']:.1f} rows and "
                         f"{s['tokens_per_step']:.1f} tokens a step, {s['graph_share']:.0%} replayed, {padding} "
                         "padding")
    if steps:
        lines.append("engine steps per level (the components' step counters; padding: the share of the token slots "
                     "computed that a replayed graph padded up to its bucket): " + "; ".join(steps))
    return lines


def plot(name: str, model: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for target, marker in (("triton", "o"), ("openai", "s")):
        runs = sorted((r for r in model.get("runs", []) if r["target"] == target and r.get("concurrency")),
                      key=lambda r: r["concurrency"])
        if not runs:
            continue
        conc = [r["concurrency"] for r in runs]
        axes[0].plot(conc, [r["summary"]["output_tok_per_s"] for r in runs], marker=marker, label=f"ours ({target})")
        for q, style in (("p50", "-"), ("p99", "--")):
            axes[1].plot(conc, [r["summary"]["itl_ms"][q] for r in runs], style, marker=marker, label=f"{target} {q}")
    hf = model.get("hf_generate", [])
    if hf:
        axes[0].plot([h["batch"] for h in hf], [h["output_tok_per_s"] for h in hf], "x--", label="HF generate")
    if model.get("floor_ms"):
        axes[1].axhline(model["floor_ms"], color="gray", linestyle=":", label="weight-streaming floor")
    poisson = sorted((r for r in model.get("runs", []) if r.get("rate") is not None), key=lambda r: r["rate"])
    for target in ("triton", "openai"):
        runs = [r for r in poisson if r["target"] == target]
        if runs:
            axes[2].plot([r["rate"] for r in runs], [r["summary"]["ttft_ms"]["p50"] for r in runs], "o-",
                         label=f"{target} TTFT p50")
            axes[2].plot([r["rate"] for r in runs], [r["summary"]["ttft_ms"]["p99"] for r in runs], "o--",
                         label=f"{target} TTFT p99")
    titles = ("output tok/s vs concurrency", "ITL (ms) vs concurrency", "TTFT (ms) vs Poisson rate (req/s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(f"{name}: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:  # no Poisson levels in this run
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(results: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    written[0].write_text(json_text(results, indent=1))
    written[1].write_text(markdown(results))
    for name, model in results["models"].items():
        path = out / f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)}.png"  # an org/name id is one file, not a folder
        if plot(name, model, path):
            written.append(path)
        else:
            logger.warning("no plot for %s: matplotlib is not installed (pip install 'mstar-triton[bench]')", name)
    return written
