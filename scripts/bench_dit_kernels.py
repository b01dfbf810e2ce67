#!/usr/bin/env python
"""The FLUX.2 klein-4B transformer and VAE decoder, eager against the fused kernels, per SDPA backend (GPU).

    source .device/prepare.sh && python scripts/bench_dit_kernels.py --json runs/dit_kernels.json

Random weights at the real shapes (normal(0, 0.02) matrices), bf16, 1024x1024 (4,096 image + 512 text tokens).
Times one transformer forward (the denoise step's body) at batch 1 and 4, eager and replayed from a captured
CUDA graph, with the elementwise glue eager or fused (mstar_kernels/dit.py) and each SDPA backend
(`MSTAR_DIT_ATTENTION`); one VAE decode at batch 1 and 4 with torch's GroupNorm+SiLU or mstar_kernels/group_norm.py.
Reports milliseconds (median of --iters after warm-up), the fused output's relative error against eager, and
whether a graph replay equals the eager call; the last line names the fastest attention backend.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mstar_common.bench.gpu_timing import event_time_ms  # noqa: E402
from mstar_common.bench.report import json_text  # noqa: E402
from scripts.bench_flux2 import TRANSFORMER_4B, VAE  # noqa: E402


def _time(fn, iters: int) -> float:
    return round(event_time_ms(fn, repeats=iters, warmup=2), 3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _random_(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02)
            elif "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()
    return module


def bench_transformer(batches: list[int], iters: int, backends: list[str]) -> dict:
    from mstar_common.families.flux2_klein.components import Layout, position_ids
    from mstar_common.families.flux2_klein.transformer import Flux2Transformer, Flux2TransformerConfig

    config = Flux2TransformerConfig.from_diffusers(TRANSFORMER_4B)
    with torch.device("meta"):
        model = Flux2Transformer(config)
    model = _random_(model.to(torch.bfloat16).to_empty(device="cuda")).eval()
    txt_ids, img_ids = position_ids(Layout(64, 64), 512, torch.device("cuda"))
    rope = model.rope(txt_ids, img_ids)
    gen = torch.Generator("cuda").manual_seed(0)
    results = {}
    for batch in batches:
        hidden = torch.randn(batch, 4096, config.in_channels, device="cuda", generator=gen).bfloat16()
        prompt = torch.randn(batch, 512, config.joint_attention_dim, device="cuda", generator=gen).bfloat16()
        timestep = torch.linspace(0.9, 0.2, batch, device="cuda")

        def forward(hidden=hidden, prompt=prompt, timestep=timestep):
            return model(hidden, prompt, timestep, rope)

        row = {}
        with torch.inference_mode():
            os.environ["MSTAR_DIT_ATTENTION"] = "auto"
            model.use_fused_kernels(False)
            ref = forward()
            row["eager_glue_auto_ms"] = _time(forward, iters)
            model.use_fused_kernels(True)
            for backend in backends:
                with backend_order(backend):
                    try:
                        out = forward()
                        row[f"fused_{backend}_ms"] = _time(forward, iters)
                        row[f"fused_{backend}_rel_err"] = round(_rel(out, ref), 5)
                    except Exception as exc:  # a backend this build or shape does not support
                        row[f"fused_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        continue
                    graph = torch.cuda.CUDAGraph()
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        forward()
                    torch.cuda.current_stream().wait_stream(stream)
                    try:
                        with torch.cuda.graph(graph):
                            captured = forward()
                    except Exception as exc:
                        row[f"graph_{backend}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        continue
                    graph.replay()
                    torch.cuda.synchronize()
                    row[f"graph_{backend}_ms"] = _time(graph.replay, iters)
                    row[f"graph_{backend}_equals_eager"] = bool(torch.equal(captured, out))
                    del graph, captured
        results[f"batch_{batch}"] = row
        print(f"transformer batch {batch}: {row}", flush=True)
    os.environ["MSTAR_DIT_ATTENTION"] = "auto"
    return results


def backend_order(backend: str):
    """SDPA with `backend`'s order (MSTAR_DIT_ATTENTION's values) for the calls inside. The served attention sets its
    order once per process (`attention.use_backend_order`), so setting the variable between forwards measured
    torch's default order under every name; torch's own context sets it here, where no other thread runs
    attention (its race is between threads)."""
    from torch.nn.attention import sdpa_kernel

    from mstar_common.diffusion.attention import sdpa_backends

    os.environ["MSTAR_DIT_ATTENTION"] = backend
    order = sdpa_backends()
    return sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext()


def bench_gemm(batches: list[int], iters: int) -> dict:
    """The DiT's projection GEMMs in bf16 against fp8 e4m3 `torch._scaled_mm` with row-wise scales (per token for
    the activations, per output channel for the weights), and the activation quantisation's own cost."""
    dim, mlp = 3072, 9216
    shapes = {"single_in (qkv+mlp)": (dim, 3 * dim + 2 * mlp), "single_out": (dim + mlp, dim),
              "double_q/k/v/out": (dim, dim), "double_ff_in": (dim, 2 * mlp), "double_ff_out": (mlp, dim)}
    fp8 = torch.float8_e4m3fn
    results = {}
    for batch in batches:
        rows = batch * (4096 + 512)
        for name, (k, n) in shapes.items():
            x = torch.randn(rows, k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
            w_scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            w8 = (w.float() / w_scale).to(fp8)

            def quantise(x=x):
                scale = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
                return (x.float() / scale).to(fp8), scale

            x8, x_scale = quantise()
            row = {"bf16_ms": _time(lambda x=x, w=w: x @ w.t(), iters)}
            try:
                out8 = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
                row["fp8_ms"] = _time(lambda x8=x8, w8=w8, x_scale=x_scale, w_scale=w_scale: torch._scaled_mm(
                    x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16), iters)
                row["fp8_rel_err"] = round(_rel(out8, x @ w.t()), 5)
                row["quantise_eager_ms"] = _time(quantise, iters)
            except Exception as exc:
                row["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            results[f"batch_{batch} {name} [{rows}x{k}]x[{k}x{n}]"] = row
            print(f"gemm batch {batch} {name}: {row}", flush=True)
            del x, w, w8
    return results


def bench_vae(batches: list[int], iters: int) -> dict:
    from mstar_common.families.flux2_klein.vae import Flux2VaeConfig, VaeDecoder, use_fused_group_norm

    with torch.device("meta"):
        model = VaeDecoder(Flux2VaeConfig.from_diffusers(VAE))
    model = _random_(model.to(torch.bfloat16).to_empty(device="cuda")).eval()
    model.bn.running_var.fill_(1.0)
    model.bn.running_mean.zero_()
    results = {}
    for batch in batches:
        latents = torch.randn(batch, VAE["latent_channels"], 128, 128, device="cuda").bfloat16()
        row = {}
        with torch.inference_mode():
            use_fused_group_norm(model, False)
            ref = model.decoder(latents)
            row["eager_ms"] = _time(lambda latents=latents: model.decoder(latents), iters)
            use_fused_group_norm(model, True)
            out = model.decoder(latents)
            row["fused_ms"] = _time(lambda latents=latents: model.decoder(latents), iters)
            row["fused_rel_err"] = round(_rel(out, ref), 5)
            row["fused_ms_per_image"] = round(row["fused_ms"] / batch, 3)
            torch.backends.cudnn.benchmark = True  # cuDNN times its convolution algorithms on the first call
            model.decoder(latents)
            row["fused_cudnn_benchmark_ms"] = _time(lambda latents=latents: model.decoder(latents), iters)
            torch.backends.cudnn.benchmark = False
            model.decoder.to(memory_format=torch.channels_last)
            last = latents.contiguous(memory_format=torch.channels_last)
            use_fused_group_norm(model, False)
            row["eager_channels_last_ms"] = _time(lambda last=last: model.decoder(last), iters)
            model.decoder.to(memory_format=torch.contiguous_format)
        results[f"batch_{batch}"] = row
        print(f"vae decode batch {batch}: {row}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--backends", default="auto,flash,cudnn,efficient")
    parser.add_argument("--vae-batches", default=None, help="default: --batches")
    parser.add_argument("--gemm-batches", default="", help="batches for the bf16 vs fp8 GEMM table (none by default)")
    parser.add_argument("--skip-transformer", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dit_kernels: needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    backends = args.backends.split(",")
    vae_batches = [int(b) for b in (args.vae_batches or args.batches).split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "vae": bench_vae(vae_batches, args.iters)}
    torch.cuda.empty_cache()
    if args.gemm_batches:
        report["gemm"] = bench_gemm([int(b) for b in args.gemm_batches.split(",")], args.iters)
        torch.cuda.empty_cache()
    if not args.skip_transformer:
        report["transformer"] = bench_transformer(batches, args.iters, backends)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json_text(report, indent=1))
    if not args.skip_transformer:
        first = report["transformer"][f"batch_{batches[0]}"]
        timed = [(first.get(f"graph_{b}_ms", float("inf")), b) for b in backends]
        print(f"best attention backend (batch {batches[0]}, graph replay): {min(timed)[1]}")


if __name__ == "__main__":
    main()
