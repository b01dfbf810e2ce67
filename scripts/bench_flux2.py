#!/usr/bin/env python
"""FLUX.2 [klein] / Z-Image-Turbo throughput: images/s at concurrency 1/4/16 for our walk and diffusers' pipeline.

    # on the GPU device (torch 2.11, Python 3.12; diffusers optional, see below):
    source .device/prepare.sh && python scripts/bench_flux2.py --json runs/bench_flux2.json
    python scripts/bench_flux2.py --mode served ...   # through tritonserver + the walk router (gRPC clients)
    python scripts/bench_flux2.py --family z_image_turbo --json runs/bench_z_image.json   # Z-Image-Turbo
    # CPU smoke (CI): tiny checkpoint, 64x64, c=1/2, both systems
    python scripts/bench_flux2.py --smoke [--family z_image_turbo]
    python scripts/bench_flux2.py --profile --json runs/bench_flux2.json   # + runs/bench_flux2_profile.txt (klein)

What it measures (random weights at the real shapes, 1024x1024, one prompt per request; --family flux2_klein
(default): klein-4B, 4 steps; --family z_image_turbo: Z-Image-Turbo, 8 steps, no classifier-free guidance):
  ours, --mode engine (default): the walk and the family's components (klein: four, Z-Image: three) in this process
      (`LocalWalk`: the same walk script and batching engines as the server, no Triton), c concurrent clients
      issuing requests back to back; images/s = images / wall time; p50 latency; peak torch-allocated GPU memory.
  ours, --mode served: tritonserver on a generated repository (every component its own stub), c gRPC clients
      calling the walk; device memory in use (all processes) sampled with torch.cuda.mem_get_info. With
      MSTAR_TIMINGS=1 each level also reports `timings_p50_ms`: the p50 of each walk hop, each component's
      arrival-to-response time and the whole walk, read from the server log's `timing` lines.
  diffusers: `Flux2KleinPipeline` / `ZImagePipeline` (guidance_scale 0) with the same weights, dtype and settings;
      concurrency c = a batch of c prompts per call; images/s = c / call time; peak torch-allocated memory.

--profile (engine mode, klein only), after the timed runs: a c=1 request's wall time split into text encoder /
denoise / VAE decode / PNG encode / the rest (each bracketed by device synchronisation; the median of 3 requests),
the same for diffusers' pipeline (text encoder / transformer calls / VAE decode / postprocess), one request of each
under torch.profiler (CPU + CUDA, every thread): top ops by CUDA and CPU time, GPU busy time against wall time, and
the FLOPs of one image (so achieved TFLOPS), written to `<json stem>_profile.txt` and the report's "profile" key.

Needs: torch with CUDA (or --smoke on the CPU), transformers, safetensors, pyyaml, pillow (the device image may
lack it: carry its wheel), this project on the path (run from the project root); the script names what is
missing. The diffusers baseline needs `diffusers==0.42.1` (`pip install` it, or carry its wheel to the device);
without it that row is skipped with a note. --mode served needs tritonserver (prepare.sh sets
TRITONSERVER_HOME) and tritonclient.

The random checkpoint (diffusers layout; the tokenizer is the tiny offline BPE: ids differ, cost does not) is
written once to --checkpoint-dir (default /tmp/flux2-klein-4b-random, /tmp/z-image-turbo-random).
klein-4B, ~16 GB: DiT 24 heads x 128 (3072 wide), 5 double + 20 single blocks, joint dim 7680 (3 x Qwen3-4B's
2560), 128 latent channels; a full 36-layer Qwen3-4B text encoder; the FLUX.2 VAE (128/256/512/512, 32 latent
channels). Z-Image-Turbo, ~20 GB: the 6.15B single-stream DiT (30 heads x 128 (3840 wide), 30 layers + 2 noise
and 2 caption refiner layers, caption features 2560), Qwen3-4B saved as `Qwen3Model` (36 layers; the DiT reads
the second-to-last), the FLUX.1 VAE (128/256/512/512, 16 latent channels, no quant convs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar_common.bench.pa_files import IMAGE_PROMPTS  # noqa: E402
from mstar_common.bench.report import json_text  # noqa: E402

TRANSFORMER_4B = {"in_channels": 128, "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128,
                  "num_attention_heads": 24, "joint_attention_dim": 7680, "timestep_guidance_channels": 256,
                  "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6,
                  "patch_size": 1, "out_channels": None, "guidance_embeds": False}
QWEN3_4B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False}
VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 32, "norm_num_groups": 32,
       "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4, "patch_size": [2, 2]}

# Z-Image-Turbo. Every DiT key is a `ZImageTransformer2DModel.__init__` argument of diffusers 0.42.1, which our
# loader reads by the same name, and every value but axes_lens equals that signature's default. Not confirmed (no
# released config at hand): axes_lens [1536, 512, 512] (diffusers' and our loader's default: [1024, 512, 512]; it
# sizes diffusers' RoPE tables only, no weights); the text encoder's values beyond hidden_size 2560 (klein's
# Qwen3-4B ones); the VAE's sample_size and force_upcast (FLUX.1's as remembered; ZImagePipeline and our decoder
# ignore both).
Z_TRANSFORMER = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
                 "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True,
                 "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
                 "axes_lens": [1536, 512, 512]}
Z_QWEN3_4B = {**QWEN3_4B, "architectures": ["Qwen3Model"]}
Z_VAE = {"in_channels": 3, "out_channels": 3, "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
         "latent_channels": 16, "norm_num_groups": 32, "down_block_types": ["DownEncoderBlock2D"] * 4,
         "up_block_types": ["UpDecoderBlock2D"] * 4, "act_fn": "silu", "sample_size": 1024, "scaling_factor": 0.3611,
         "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True,
         "mid_block_add_attention": True}


# the random checkpoint


def write_random_checkpoint(out: Path, device: str, transformer: dict = TRANSFORMER_4B, text_encoder: dict = QWEN3_4B,
                            vae: dict = VAE) -> Path:
    """Random weights in diffusers layout (normal(0, 0.02) matrices, unit norms, zero biases); klein-4B shapes
    unless other configs are given (the tests write tiny ones)."""
    if (out / "model_index.json").is_file():  # before the imports: the tokenizer's module imports transformers'
        return out  # model classes, which the device's server venv (numpy 1.x) cannot
    from mstar_common.families.flux2_klein.tiny import SCHEDULER
    from mstar_common.families.flux2_klein.transformer import Flux2Transformer, Flux2TransformerConfig
    from mstar_common.families.flux2_klein.vae import Flux2VaeConfig, VaeDecoder, VaeEncoder

    def states() -> dict[str, dict[str, torch.Tensor]]:
        with torch.device("meta"):
            vae_config = Flux2VaeConfig.from_diffusers(vae)
            return {"transformer": Flux2Transformer(Flux2TransformerConfig.from_diffusers(transformer)).state_dict(),
                    "vae": {**VaeEncoder(vae_config).state_dict(), **VaeDecoder(vae_config).state_dict()},
                    "text_encoder": _qwen3_shapes(text_encoder)}

    return _write_checkpoint(out, device, {"_class_name": "Flux2KleinPipeline", "is_distilled": True},
                             {"transformer": {"_class_name": "Flux2Transformer2DModel", **transformer},
                              "vae": {"_class_name": "AutoencoderKLFlux2", **vae}, "text_encoder": text_encoder},
                             SCHEDULER, states)


def write_random_z_image_checkpoint(out: Path, device: str, transformer: dict = Z_TRANSFORMER,
                                    text_encoder: dict = Z_QWEN3_4B, vae: dict = Z_VAE) -> Path:
    """The same for Z-Image-Turbo (6B DiT, Qwen3-4B saved as `Qwen3Model`: no `model.` prefix, no LM head;
    FLUX.1 VAE without quant convs)."""
    if (out / "model_index.json").is_file():  # before the imports (see write_random_checkpoint)
        return out
    from torch import nn

    from mstar_common.families.flux2_klein.vae import Encoder
    from mstar_common.families.z_image_turbo.tiny import SCHEDULER
    from mstar_common.families.z_image_turbo.transformer import ZImageTransformer, ZImageTransformerConfig
    from mstar_common.families.z_image_turbo.vae import Flux1VaeConfig, VaeDecoder

    def states() -> dict[str, dict[str, torch.Tensor]]:
        with torch.device("meta"):
            vae_config = Flux1VaeConfig.from_diffusers(vae)
            vae_state = {**nn.ModuleDict({"encoder": Encoder(vae_config.network)}).state_dict(),
                         **VaeDecoder(vae_config).state_dict()}
            text = {name.removeprefix("model."): value for name, value in _qwen3_shapes(text_encoder).items()}
            return {"transformer": ZImageTransformer(ZImageTransformerConfig.from_diffusers(transformer)).state_dict(),
                    "vae": vae_state, "text_encoder": text}

    return _write_checkpoint(out, device, {"_class_name": "ZImagePipeline"},
                             {"transformer": {"_class_name": "ZImageTransformer2DModel", **transformer},
                              "vae": {"_class_name": "AutoencoderKL", **vae}, "text_encoder": text_encoder},
                             SCHEDULER, states, ones={"cap_embedder.0.weight"})  # the caption RMSNorm's weight


def _write_checkpoint(out: Path, device: str, index: dict, configs: dict[str, dict], scheduler: dict,
                      states, ones: set[str] = frozenset()) -> Path:
    """configs and `states()` by folder (transformer, vae, text_encoder); model_index.json last, so an interrupted
    write is redone rather than taken for a checkpoint."""
    from safetensors.torch import save_file

    from mstar_common.families.qwen3.tiny import build_tokenizer

    for folder, config in configs.items():
        _json(out / folder / "config.json", config)
    _json(out / "scheduler" / "scheduler_config.json", {"_class_name": "FlowMatchEulerDiscreteScheduler", **scheduler})
    build_tokenizer().save_pretrained(out / "tokenizer")
    stems = {"transformer": "diffusion_pytorch_model", "vae": "diffusion_pytorch_model", "text_encoder": "model"}
    for folder, state in states().items():
        save_file(_random(state, device, ones), out / folder / f"{stems[folder]}.safetensors")
    _json(out / "model_index.json", index)
    return out


def _qwen3_shapes(c: dict) -> dict[str, torch.Tensor]:
    h, q, kv, inter = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], \
        c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (c["head_dim"],), p + "self_attn.k_norm.weight": (c["head_dim"],),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


@torch.no_grad()
def _random(state: dict[str, torch.Tensor], device: str, ones: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device).manual_seed(0)
    out = {}
    for name, meta in state.items():
        if meta.dtype == torch.long:
            out[name] = torch.zeros(meta.shape, dtype=torch.long)
        elif name.endswith("running_var") or name in ones or (meta.dim() == 1 and "norm" in name):
            out[name] = torch.ones(meta.shape, dtype=torch.bfloat16)
        elif name.endswith(("bias", "running_mean")):
            out[name] = torch.zeros(meta.shape, dtype=torch.bfloat16)
        else:
            values = torch.randn(meta.shape, generator=generator, device=device, dtype=torch.float32) * 0.02
            out[name] = values.to(torch.bfloat16).cpu()
    return out


def _json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(value, indent=2))


# systems under test

PROMPT = IMAGE_PROMPTS[0]  # the perf_analyzer file's first request


def deployment(checkpoint: Path, args: argparse.Namespace, device_kind: str):
    from mstar_common.config import deployment_from_dict
    from mstar_common.families.registry import get_family

    placement = {"device": "cpu"} if device_kind == "cpu" else {"device": "gpu", "gpus": [0]}
    components = {name: {"placement": dict(placement)}
                  for name, comp in get_family(args.family).graph.components.items() if comp.kind != "walk_router"}
    components["walk"] = {"placement": {"device": "cpu", "instances": 1}}
    for captured in ("denoise", "text_encoder"):  # as configs/*_gpu.yaml
        components[captured]["cuda_graphs"] = device_kind == "gpu" and not args.no_cuda_graphs
    size = f"{args.width}x{args.height}"
    kwargs = {"dtype": args.dtype, "default_size": size, "max_image_area": max(args.width * args.height, 64 * 64),
              "max_batch_size": max(args.concurrency), "max_images_per_request": 1,
              "vae_max_batch": args.vae_max_batch, "capture_sizes": [size],
              "capture_batch_sizes": [b for b in (1, 2, 4, 8, 16) if b <= max(args.concurrency)],
              **FAMILIES[args.family].model_kwargs(checkpoint, args)}
    if args.family == "flux2_klein":  # text to image only: references never larger than the outputs
        kwargs.setdefault("max_reference_area", kwargs["max_image_area"])
    if args.vae_in_denoise:
        kwargs["vae_in_denoise"] = True
    if args.dit_fp8:
        kwargs["dit_fp8"] = True
    if args.lora:
        kwargs["lora"] = [{"path": args.lora}]
    return deployment_from_dict({"name": "bench", "family": args.family, "checkpoint": str(checkpoint),
                                 "components": components, "model_kwargs": kwargs,
                                 "server": {"shm_default_byte_size": 1 << 27, "stub_timeout_seconds": 600}})


def _klein_kwargs(checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {"text_encoder_out_layers": args.taps, "capture_edit_sizes": []}


def _z_image_kwargs(checkpoint: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The denoise step is captured per padded caption length too: the bench prompt's, through the walk's own
    tokenizer and chat template (a transformers tokenizer only: fine in the server venv)."""
    from ensembles.z_image_turbo import ZImageTurboWalk
    from mstar_common.diffusion.image_family import load_walk_tokenizer
    from mstar_common.families.z_image_turbo.options import ZImageTurboOptions
    from mstar_common.families.z_image_turbo.transformer import padded_length

    walk = ZImageTurboWalk(load_walk_tokenizer(checkpoint), ZImageTurboOptions(), multiple=16)  # size unchecked here
    return {"capture_caption_tokens": [padded_length(walk.tokenize(PROMPT)[1])]}


def request_inputs(args: argparse.Namespace, seed: int) -> dict[str, np.ndarray]:
    return {"prompt": np.array([PROMPT.encode()], dtype=object),
            "width": np.array([args.width], np.int32), "height": np.array([args.height], np.int32),
            "seed": np.array([seed], np.int64), "num_inference_steps": np.array([args.steps], np.int32)}


def bench_engine(checkpoint: Path, args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    from mstar_common.families.registry import get_family
    from mstar_common.local_walk import LocalWalk

    walk = LocalWalk(get_family(args.family), deployment(checkpoint, args, "cpu" if device == "cpu" else "gpu"),
                     checkpoint, device).start()
    try:
        async def one(seed: int) -> float:
            start = time.perf_counter()
            await walk.run(request_inputs(args, seed))
            return time.perf_counter() - start

        rows = []
        for c in _warm(args, lambda: asyncio.run(_clients(one, 1, 2))):
            walk.timings.clear()
            rows.append(_level(c, args, device, lambda c=c: asyncio.run(_clients(one, c, args.requests(c)))))
            # Where a request's time goes: each component's call, submit to result (queueing included).
            rows[-1]["component_p50_ms"] = {name: round(statistics.median(t) * 1e3, 1)
                                            for name, t in sorted(walk.timings.items())}
            print(f"[bench]   c={c:<3} per component p50 ms {rows[-1]['component_p50_ms']}", flush=True)
        if args.profile:
            args.profile_report["ours"] = profile_engine(walk, args, device)
        return rows
    finally:
        walk.close()


def fp8_quality(checkpoint: Path, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """--fp8-quality N: N requests (seeds 0..N-1) through the in-process walk twice, in the benchmark's dtype
    (bf16; fp32 in --smoke) and then with model_kwargs.dit_fp8 (eager: the same arithmetic as the captured
    graphs, which the GPU tests pin); the PSNR of each fp8 image against the other's."""
    import gc
    import io

    from PIL import Image

    from mstar_common.families.registry import get_family
    from mstar_common.local_walk import LocalWalk

    images: dict[bool, list[np.ndarray]] = {}
    for fp8 in (False, True):
        variant = argparse.Namespace(**{**vars(args), "dit_fp8": fp8, "no_cuda_graphs": True})
        kind = "cpu" if device == "cpu" else "gpu"
        walk = LocalWalk(get_family(args.family), deployment(checkpoint, variant, kind), checkpoint, device).start()
        try:
            outputs = [asyncio.run(walk.run(request_inputs(args, seed))) for seed in range(args.fp8_quality)]
        finally:
            walk.close()
        images[fp8] = [np.asarray(Image.open(io.BytesIO(out["images"][0]))) for out in outputs]
        del walk, outputs
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
    psnrs = []
    for bf16, fp8 in zip(images[False], images[True], strict=True):
        mse = float(np.mean((bf16.astype(np.float64) - fp8.astype(np.float64)) ** 2))
        psnrs.append(round(float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse), 2))
    result = {"seeds": list(range(args.fp8_quality)), f"psnr_db_fp8_vs_{args.dtype}": psnrs,
              "median_psnr_db": statistics.median(psnrs)}
    print(f"[bench] dit_fp8 against {args.dtype}, PSNR per image (dB): {psnrs}", flush=True)
    return result


async def _clients(one, concurrency: int, total: int) -> list[float]:
    seeds = iter(range(total))
    latencies: list[float] = []

    async def client():
        for seed in seeds:
            latencies.append(await one(seed))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def bench_served(checkpoint: Path, args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from mstar_common.launcher import LogEcho, Ports, start_triton, stop_process, wait_ready
    from mstar_common.repository import entry_model, write_repository

    dep = deployment(checkpoint, args, "cpu" if device == "cpu" else "gpu")
    short = FAMILIES[args.family].short
    root = Path(tempfile.mkdtemp(prefix=f"bench-{short}-"))
    repo = write_repository(dep, root / "repo", "bench")
    ports = Ports.free(proxy=False)
    log = Path(os.environ.get("MSTAR_BENCH_LOG_DIR") or root) / f"{short}_tritonserver.log"
    progress = LogEcho(log, prefix="[bench_flux2] ")  # the captures' progress
    server = start_triton(repo, dep, ports, log)
    print(f"[bench] tritonserver log: {log}", flush=True)
    try:
        wait_ready(ports.triton_ready_url, server, 900, "tritonserver", progress=progress)
        url, model = ports.grpc_url, entry_model(dep)

        def run(c: int, total: int) -> list[float]:
            seeds = iter(range(total))
            with ThreadPoolExecutor(c) as pool:
                return [t for ts in pool.map(lambda _: _grpc_client(url, model, args, seeds), range(c)) for t in ts]

        rows = []
        metrics_url = ports.metrics_url
        for c in _warm(args, lambda: run(1, 2)):
            offset = log.stat().st_size
            before = step_counters(metrics_url)  # the warm-up's (or the last level's) steps all published
            rows.append(_level(c, args, device, lambda c=c: run(c, args.requests(c)), served=True))
            rows[-1]["steps"] = step_deltas(before, step_counters(metrics_url))
            print(f"[bench]         steps {rows[-1]['steps']}", flush=True)
            if os.environ.get("MSTAR_TIMINGS") == "1":  # the server's per-hop log lines of this level
                with log.open("rb") as f:
                    f.seek(offset)
                    rows[-1]["timings_p50_ms"] = timing_summary(f.read().decode(errors="replace"))
                print(f"[bench]         timings p50 ms {rows[-1]['timings_p50_ms']}", flush=True)
        return rows
    finally:
        stop_process(server)


EXPORT_WAIT_S = 5.0  # the most step_counters waits for the components' metrics threads
_COUNTER = re.compile(r'^(mstar_engine_steps_total|mstar_graph_steps_total|mstar_engine_rows_stepped_total)'
                      r'\{[^}]*model="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def step_counters(metrics_url: str) -> dict[tuple[str, str], float]:
    """Triton's /metrics -> {(model, series): value} for the engines' step counters, summed over instances, read
    once every component instance has finished a metrics sample begun after this call (`page_after_a_sample`; at most
    `EXPORT_WAIT_S`), so every step before the call is counted: a fixed 0.2 s wait left a level's last steps out
    whenever load stretched the sampler's 0.1 s period."""
    from mstar_common.bench.cli import page_after_a_sample
    from mstar_common.launcher import open_direct

    def page() -> str:
        with open_direct(metrics_url, timeout=10) as response:  # the bench's own server: never through http_proxy
            return response.read().decode()

    return parse_step_counters(page_after_a_sample(page, EXPORT_WAIT_S))


def parse_step_counters(text: str) -> dict[tuple[str, str], float]:
    totals: dict[tuple[str, str], float] = {}
    for series, model, value in _COUNTER.findall(text):
        totals[model, series] = totals.get((model, series), 0.0) + float(value)
    return totals


def step_deltas(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, dict]:
    """Per model that stepped between two scrapes: steps, the share replayed from graphs, and rows per step
    (where the engine counts rows: the denoise loop's batch)."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    out = {}
    for model in sorted({model for model, _ in delta}):
        steps = delta.get((model, "mstar_engine_steps_total"), 0.0)
        if steps <= 0:
            continue
        out[model] = {"steps": int(steps),
                      "graph_share": round(delta.get((model, "mstar_graph_steps_total"), 0.0) / steps, 3)}
        rows = delta.get((model, "mstar_engine_rows_stepped_total"), 0.0)
        if rows > 0:
            out[model]["rows_per_step"] = round(rows / steps, 2)
    return out


_TIMING = re.compile(r"\] timing (hop \S+|walk|\S+)(?: from arrival to response sent)?: ([\d.]+) ms")


def timing_summary(log_text: str) -> dict[str, float]:
    """`MSTAR_TIMINGS=1` server log lines -> p50 ms per hop (`hop text_encoder`, ...), per component and per walk."""
    times: dict[str, list[float]] = {}
    for match in _TIMING.finditer(log_text):
        times.setdefault(match.group(1), []).append(float(match.group(2)))
    return {name: round(statistics.median(values), 1) for name, values in times.items()}


def _grpc_client(url: str, model: str, args: argparse.Namespace, seeds) -> list[float]:
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    from mstar_common.bench.drivers import triton_grpc_client

    results: queue.Queue = queue.Queue()
    client = triton_grpc_client(url)
    client.start_stream(callback=lambda result, error: results.put(error))
    latencies = []
    try:
        for seed in seeds:
            inputs = []
            for name, value in request_inputs(args, seed).items():
                dtype = "BYTES" if value.dtype == object else np_to_triton_dtype(value.dtype)
                inputs.append(grpcclient.InferInput(name, list(value.shape), dtype))
                inputs[-1].set_data_from_numpy(value)
            start = time.perf_counter()
            client.async_stream_infer(model, inputs, request_id=str(seed))
            error = results.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"request failed: {error}")
            latencies.append(time.perf_counter() - start)
    finally:
        client.stop_stream()
        client.close()
    return latencies


def bench_diffusers(checkpoint: Path, args: argparse.Namespace, device: str) -> list[dict[str, Any]] | str:
    family = FAMILIES[args.family]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        pipe = _pipeline(family, checkpoint, dtype).to(device)
    except _NoDiffusers as exc:
        return f"skipped: diffusers is not importable ({exc}); pip install diffusers==0.42.1 (or carry its wheel)"
    pipe.set_progress_bar_config(disable=True)

    def call(c: int) -> float:
        start = time.perf_counter()
        pipe(prompt=[PROMPT] * c, width=args.width, height=args.height, num_inference_steps=args.steps,
             generator=torch.Generator().manual_seed(0), output_type="pil", **family.call_kwargs(args))
        return time.perf_counter() - start

    levels = _warm(args, lambda: call(1))
    rows = [_level(c, args, device, lambda c=c: [call(c) for _ in range(args.diffusers_calls)], batch=c)
            for c in levels]
    if args.profile:
        args.profile_report["diffusers"] = profile_diffusers(pipe, lambda: call(1), device)
    return rows


class _NoDiffusers(Exception):
    pass


def _from_diffusers(*names: str) -> list[Any]:
    try:
        import diffusers

        return [getattr(diffusers, name) for name in names]
    except (ImportError, AttributeError) as exc:  # absent, or a release without these classes
        raise _NoDiffusers(str(exc)) from exc


def _pipeline(family: BenchFamily, checkpoint: Path, dtype: torch.dtype):
    """The family's diffusers pipeline assembled from the checkpoint's parts."""
    pipeline, transformer, vae, scheduler = _from_diffusers(*family.diffusers_classes,
                                                            "FlowMatchEulerDiscreteScheduler")
    import transformers

    text_encoder = getattr(transformers, family.text_encoder_class)
    return pipeline(
        scheduler=scheduler.from_pretrained(checkpoint / "scheduler"),
        vae=vae.from_pretrained(checkpoint / "vae", torch_dtype=dtype),
        text_encoder=text_encoder.from_pretrained(checkpoint / "text_encoder", dtype=dtype),
        tokenizer=transformers.AutoTokenizer.from_pretrained(checkpoint / "tokenizer"),
        transformer=transformer.from_pretrained(checkpoint / "transformer", torch_dtype=dtype),
        **family.pipeline_kwargs,
    )


def _klein_tiny(out: Path, args: argparse.Namespace) -> Path:
    from mstar_common.families.flux2_klein.tiny import TINY_TAPS, build_tiny_checkpoint

    args.taps = list(TINY_TAPS)
    return build_tiny_checkpoint(out)


def _z_image_tiny(out: Path, args: argparse.Namespace) -> Path:
    from mstar_common.families.z_image_turbo.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out)


class BenchFamily(NamedTuple):
    """What differs per family; everything else is shared."""

    title: str  # the shapes, for the log
    short: str  # tritonserver log / temp dir prefix
    checkpoint_dir: str  # --checkpoint-dir default (real shapes); --smoke's tiny one
    tiny_dir: str
    steps: int  # --steps default
    write: Callable[[Path, str], Path]  # the random checkpoint at real shapes
    tiny: Callable[[Path, argparse.Namespace], Path]  # --smoke's checkpoint (may set args)
    model_kwargs: Callable[[Path, argparse.Namespace], dict[str, Any]]  # beyond the shared image ones
    diffusers_classes: tuple[str, str, str]  # diffusers' pipeline, transformer and VAE classes
    text_encoder_class: str  # transformers'
    pipeline_kwargs: dict[str, Any]  # the pipeline's constructor, beyond its parts
    call_kwargs: Callable[[argparse.Namespace], dict[str, Any]]  # its call, beyond prompt, size, steps, generator


FAMILIES = {
    "flux2_klein": BenchFamily(
        title="klein-4B", short="flux2", checkpoint_dir="/tmp/flux2-klein-4b-random",
        tiny_dir="/tmp/flux2-klein-tiny-bench", steps=4, write=write_random_checkpoint, tiny=_klein_tiny,
        model_kwargs=_klein_kwargs,
        diffusers_classes=("Flux2KleinPipeline", "Flux2Transformer2DModel", "AutoencoderKLFlux2"),
        text_encoder_class="Qwen3ForCausalLM", pipeline_kwargs={"is_distilled": True},
        call_kwargs=lambda args: {"text_encoder_out_layers": tuple(args.taps)}),
    "z_image_turbo": BenchFamily(
        title="Z-Image-Turbo (6B)", short="z_image", checkpoint_dir="/tmp/z-image-turbo-random",
        tiny_dir="/tmp/z-image-turbo-tiny-bench", steps=8, write=write_random_z_image_checkpoint, tiny=_z_image_tiny,
        model_kwargs=_z_image_kwargs,
        diffusers_classes=("ZImagePipeline", "ZImageTransformer2DModel", "AutoencoderKL"),
        text_encoder_class="Qwen3Model", pipeline_kwargs={},
        call_kwargs=lambda args: {"guidance_scale": 0.0}),  # distilled, run without CFG (as our walk runs it)
}


# --profile: where one c=1 request's time goes (after the timed runs; never part of them)

PROFILE_REQUESTS = 3  # un-profiled requests timed for the breakdown (median per part)


class _SyncTimer:
    """Wall time of calls to wrapped methods, each bracketed by device synchronisation; `restore()` unwraps."""

    def __init__(self, device: str):
        self.device = device
        self.ms: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            _sync(self.device)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                _sync(self.device)
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3

        setattr(owner, attr, timed)  # an instance attribute: deleting it restores the class's method
        self._wrapped.append((owner, attr))

    def restore(self) -> None:
        for owner, attr in self._wrapped:
            delattr(owner, attr)


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def profile_engine(walk, args: argparse.Namespace, device: str) -> dict[str, Any]:
    """Our c=1 request: component calls (submit to result, each ending in a device-to-host copy), the walk's
    PNG encode, and the rest (tokenize, hops, thread hand-offs); then one request under the profiler."""

    def run(seed: int) -> dict[str, float]:
        timer = _SyncTimer(device)
        timer.wrap(walk.walk, "encode_images", "png_encode")
        walk.timings.clear()
        try:
            start = time.perf_counter()
            asyncio.run(walk.run(request_inputs(args, seed)))
            total = (time.perf_counter() - start) * 1e3
        finally:
            timer.restore()
        parts = {name: sum(t) * 1e3 for name, t in walk.timings.items()} | timer.ms
        return {**parts, "other": total - sum(parts.values()), "total": total}

    breakdown = _median_parts([run(10_000 + i) for i in range(PROFILE_REQUESTS)])
    return {"breakdown_ms": breakdown,
            **_profiled("ours (engine)", lambda: asyncio.run(walk.run(request_inputs(args, 20_000))), device)}


def profile_diffusers(pipe, call_one, device: str) -> dict[str, Any]:
    """diffusers' c=1 call split the same way: text encoder, transformer calls, VAE decode, postprocess, the rest."""

    def run() -> dict[str, float]:
        timer = _SyncTimer(device)
        for owner, attr, name in ((pipe.text_encoder, "forward", "text_encoder"), (pipe.transformer, "forward",
                                  "denoise"), (pipe.vae, "decode", "vae_decode"),
                                  (pipe.image_processor, "postprocess", "postprocess")):
            timer.wrap(owner, attr, name)
        try:
            total = call_one() * 1e3
        finally:
            timer.restore()
        return {**timer.ms, "other": total - sum(timer.ms.values()), "total": total}

    breakdown = _median_parts([run() for _ in range(PROFILE_REQUESTS)])
    return {"breakdown_ms": breakdown, **_profiled("diffusers", call_one, device)}


def _median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: round(statistics.median(r.get(name, 0.0) for r in runs), 1) for name in runs[0]}


def _profiled(title: str, run_once, device: str) -> dict[str, Any]:
    """One call under torch.profiler: wall and GPU-busy time, and the op tables (kept for the text file)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    config, threads_note = _all_threads_config()
    with profile(activities=activities, **config) as prof:
        start = time.perf_counter()
        run_once()
        _sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    averages = prof.key_averages()
    gpu_ms = sum(event.self_device_time_total for event in averages) / 1e3
    tables = [f"== {title}: one c=1 request under torch.profiler: wall {wall_ms:.1f} ms, GPU kernels {gpu_ms:.1f} ms "
              f"({threads_note})"]
    for sort_by, rows, what in (("self_device_time_total", 40, "self CUDA time (kernels)"),
                                ("device_time_total", 40, "total CUDA time (ops with their kernels)"),
                                ("self_cpu_time_total", 25, "self CPU time")):
        tables.append(f"-- top {rows} by {what}\n" + averages.table(sort_by=sort_by, row_limit=rows,
                                                                      max_name_column_width=90))
    return {"profiled_wall_ms": round(wall_ms, 1), "gpu_kernel_ms": round(gpu_ms, 1), "tables": tables}


def _all_threads_config() -> tuple[dict[str, Any], str]:
    """The components run in their own threads; torch records their CPU ops only with `profile_all_threads`."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}, "CPU ops of every thread"
    except (ImportError, TypeError):
        return {}, "CPU ops of the calling thread only (this torch lacks profile_all_threads); kernels of all"


def image_tflops(checkpoint: Path, args: argparse.Namespace) -> dict[str, float]:
    """FLOPs of one image (matmuls, convolutions, attention; torch's FlopCounterMode over meta tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mstar_common.families.flux2_klein import loader
    from mstar_common.families.flux2_klein.components import Layout, position_ids
    from mstar_common.families.flux2_klein.options import TEXT_TOKENS
    from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
    from mstar_common.families.flux2_klein.transformer import Flux2Transformer
    from mstar_common.families.flux2_klein.vae import VaeDecoder

    dit_config, vae_config = loader.transformer_config(checkpoint), loader.vae_config(checkpoint)
    factor = 2 * vae_config.scale_factor
    layout = Layout(args.height // factor, args.width // factor)
    te_config, taps = loader.text_encoder_config(checkpoint), tuple(args.taps)
    cpu_lens = torch.full((1,), TEXT_TOKENS)  # unpadded: the causal path (the same FLOPs), no mask built on meta
    with torch.device("meta"), torch.no_grad():
        dit, vae = Flux2Transformer(dit_config), VaeDecoder(vae_config)
        rope = dit.rope(*position_ids(layout, TEXT_TOKENS, torch.device("meta")))
        ids = torch.zeros(1, TEXT_TOKENS, dtype=torch.long)
        calls = {"text_encoder": lambda: Qwen3TapEncoder(te_config, taps)(ids, cpu_lens),
                 "denoise_step": lambda: dit(torch.zeros(1, layout.num_tokens, dit_config.in_channels),
                                             torch.zeros(1, TEXT_TOKENS, dit_config.joint_attention_dim),
                                             torch.zeros(1), rope),
                 "vae_decode": lambda: vae(torch.zeros(1, layout.num_tokens, vae_config.token_channels), args.height,
                                           args.width)}
        flops = {}
        for name, call in calls.items():
            with FlopCounterMode(display=False) as counter:
                call()
            flops[name] = counter.get_total_flops() / 1e12
    flops["image"] = flops["text_encoder"] + args.steps * flops["denoise_step"] + flops["vae_decode"]
    return {name: round(value, 3) for name, value in flops.items()}


def write_profile(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    """The op tables to `<json stem>_profile.txt`; returns the numbers for the report (tables left out)."""
    path = (Path(args.json).with_name(Path(args.json).stem + "_profile.txt") if args.json
            else Path("bench_flux2_profile.txt"))
    tflops = image_tflops(checkpoint, args)
    lines = [f"bench_flux2 --profile: {args.width}x{args.height}, {args.steps} steps, {args.dtype}; one image = "
             f"{tflops['image']:.1f} TFLOP {tflops}"]
    summary: dict[str, Any] = {"tflop": tflops}
    for system, result in args.profile_report.items():
        wall_s, gpu_s = result["breakdown_ms"]["total"] / 1e3, result["gpu_kernel_ms"] / 1e3
        lines.append(f"{system}: wall breakdown ms (median of {PROFILE_REQUESTS}) {result['breakdown_ms']}; "
                     f"{tflops['image'] / wall_s:.0f} TFLOPS over the wall time, "
                     f"{tflops['image'] / gpu_s if gpu_s else 0.0:.0f} over the GPU kernels' time")
        print(f"[bench] profile {system}: {lines[-1]}", flush=True)
        summary[system] = {key: value for key, value in result.items() if key != "tables"}
    for result in args.profile_report.values():
        lines.extend(result["tables"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(lines) + "\n")
    print(f"[bench] profile tables: {path}", flush=True)
    return {**summary, "file": str(path)}


# measurement


def _warm(args: argparse.Namespace, warmup) -> list[int]:
    warmup()
    return args.concurrency


def _level(c: int, args: argparse.Namespace, device: str, run, batch: int = 1, served: bool = False) -> dict:
    sampler = _MemorySampler(device) if served else None
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    latencies = run()
    wall = time.perf_counter() - start
    row = {"concurrency": c, "requests": len(latencies), "images": len(latencies) * batch,
           "images_per_s": round(len(latencies) * batch / wall, 3),
           "p50_latency_s": round(statistics.median(latencies), 3)}
    if sampler is not None and device != "cpu":
        row["device_memory_used_gib"] = sampler.stop()
    elif device != "cpu":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(f"[bench]   c={c:<3} {row}", flush=True)
    return row


class _MemorySampler:
    def __init__(self, device: str):
        self.peak = 0
        self._stop = threading.Event()
        self._device = device
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            if self._device != "cpu":
                free, total = torch.cuda.mem_get_info()
                self.peak = max(self.peak, total - free)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak / 2**30, 2)


def _missing_requirements(mode: str) -> list[str]:
    import importlib.util

    needed = {"transformers": "transformers", "safetensors": "safetensors", "PIL": "pillow", "yaml": "pyyaml"}
    if mode == "served":
        needed["tritonclient"] = "tritonclient[grpc]"
    return [f"{module} (pip install {package}, or carry its wheel to the device)"
            for module, package in needed.items() if importlib.util.find_spec(module) is None]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=tuple(FAMILIES), default="flux2_klein")
    parser.add_argument("--mode", choices=("engine", "served"), default="engine")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU smoke: tiny checkpoint; defaults 64x64, c=1/2, one request per client, float32")
    parser.add_argument("--checkpoint-dir", help="default: /tmp/flux2-klein-4b-random, /tmp/z-image-turbo-random "
                        "(--smoke: /tmp/flux2-klein-tiny-bench, /tmp/z-image-turbo-tiny-bench)")
    parser.add_argument("--size", help="WxH (default 1024x1024)")
    parser.add_argument("--steps", type=int, help="default: 4 (flux2_klein), 8 (z_image_turbo)")
    parser.add_argument("--concurrency", help="levels (default 1,4,16)")
    parser.add_argument("--requests-per-client", type=int, help="default 4")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default bfloat16")
    parser.add_argument("--diffusers-calls", type=int, default=3, help="timed pipeline calls per concurrency")
    parser.add_argument("--vae-max-batch", type=int, default=4)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--dit-fp8", action="store_true",
                        help="model_kwargs.dit_fp8: the transformer blocks' GEMMs as scaled e4m3")
    parser.add_argument("--vae-in-denoise", action="store_true",
                        help="model_kwargs.vae_in_denoise: decode inside the denoise component (no vae_decode hop)")
    parser.add_argument("--lora", metavar="PATH", help="model_kwargs.lora: this adapter folded into the DiT (scale 1)")
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument("--fp8-quality", type=int, default=0, metavar="N",
                        help="after the rest: N seeded images in bf16 and with dit_fp8, in process; PSNR of each pair")
    parser.add_argument("--skip-ours", action="store_true",
                        help="only diffusers' pipeline (the device runs --mode served under the server's Python, "
                             "which lacks the numpy 2 stack transformers' model classes need, then this)")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--profile", action="store_true",
                        help="engine mode: after the benchmark, profile one c=1 request of each system "
                             "(<json stem>_profile.txt)")
    args = parser.parse_args(argv)
    if args.profile and args.mode != "engine":
        parser.error("--profile profiles the in-process engine: use it with --mode engine")
    if args.profile and args.family != "flux2_klein":
        parser.error("--profile is implemented for --family flux2_klein only")
    family = FAMILIES[args.family]
    args.steps = family.steps if args.steps is None else args.steps
    args.profile_report = {}
    if missing := _missing_requirements(args.mode):
        parser.error("missing: " + "; ".join(missing))
    smoke = args.smoke
    args.concurrency = [int(c) for c in (args.concurrency or ("1,2" if smoke else "1,4,16")).split(",")]
    args.width, args.height = (int(v) for v in (args.size or ("64x64" if smoke else "1024x1024")).lower().split("x"))
    args.requests_per_client = args.requests_per_client or (1 if smoke else 4)
    args.dtype = args.dtype or ("float32" if smoke else "bfloat16")
    args.taps = [9, 18, 27]
    if smoke:
        args.diffusers_calls = 1
        device = "cpu"
        checkpoint = family.tiny(Path(args.checkpoint_dir or family.tiny_dir), args)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on the GPU, or pass --smoke for the CPU smoke run")
        device = "cuda:0"
        args.checkpoint_dir = args.checkpoint_dir or family.checkpoint_dir
        print(f"[bench] random {family.title} checkpoint at {args.checkpoint_dir}", flush=True)
        checkpoint = family.write(Path(args.checkpoint_dir), device)
    args.requests = lambda c: max(2, c * args.requests_per_client)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "family": args.family,
        "device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu", "torch": torch.__version__,
        "mode": args.mode, "size": f"{args.width}x{args.height}", "steps": args.steps, "dtype": args.dtype,
        "cuda_graphs": device != "cpu" and not args.no_cuda_graphs, "vae_in_denoise": args.vae_in_denoise,
        "dit_fp8": args.dit_fp8, "lora": args.lora,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    if not args.skip_ours:
        print(f"[bench] ours ({args.mode})", flush=True)
        report["ours"] = (bench_served if args.mode == "served" else bench_engine)(checkpoint, args, device)
    if device != "cpu":
        torch.cuda.empty_cache()
    if not args.skip_diffusers:
        print(f"[bench] diffusers {family.diffusers_classes[0]} (c = prompts per call)", flush=True)
        report["diffusers"] = bench_diffusers(checkpoint, args, device)
    if args.profile:
        report["profile"] = write_profile(args, checkpoint)
    if args.fp8_quality:
        report["fp8_quality"] = fp8_quality(checkpoint, args, device)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json_text(report, indent=2))
    print(json_text(report, indent=2))
    return report


if __name__ == "__main__":
    main()
