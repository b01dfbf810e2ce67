"""The LoRA fold (`model_kwargs.lora`) at FLUX.2 klein's real shapes on the GPU: a random rank-16 adapter on every
linear of the transformer blocks, the DiT loaded with and without it (load seconds, peak GPU memory), and one folded
weight checked against its fp32 sum rounded once to bf16.

Usage (device): python scripts/probe_lora_fold.py CHECKPOINT OUT.json
(CHECKPOINT: a diffusers-layout klein folder, e.g. the /tmp/flux2-klein-4b-random that
`scripts/bench_flux2.py --skip-ours --skip-diffusers` writes.)
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.diffusion.dit_lora import Layout  # noqa: E402
from mstar_common.diffusion.image_options import LoraAdapter  # noqa: E402
from mstar_common.families.flux2_klein.loader import load_transformer, transformer_config  # noqa: E402
from mstar_common.families.flux2_klein.transformer import Flux2Transformer  # noqa: E402

RANK = 16


def write_adapter(root: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor], list[str]]:
    """A random bf16 adapter on every 2-D weight of the blocks, with alpha = r beside it (a factor of 1)."""
    shapes = Layout.of(lambda: Flux2Transformer(transformer_config(root))).shapes
    targets = [name for name, shape in shapes.items() if name.endswith(".weight") and len(shape) == 2
               and "blocks" in name]
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name in targets:
        rows, cols = shapes[name]
        module = name.removesuffix(".weight")
        tensors[f"transformer.{module}.lora_A.weight"] = (torch.randn(RANK, cols, generator=generator)
                                                          / cols ** 0.5).to(torch.bfloat16)
        tensors[f"transformer.{module}.lora_B.weight"] = (torch.randn(rows, RANK, generator=generator)
                                                          * 0.01).to(torch.bfloat16)
    path = folder / "adapter.safetensors"
    save_file(tensors, str(path))
    (folder / "adapter_config.json").write_text(json.dumps({"r": RANK, "lora_alpha": RANK}))
    return path, tensors, targets


def main() -> int:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    adapter, tensors, targets = write_adapter(root, Path(tempfile.mkdtemp(prefix="lora-fold-")))
    checked = targets[len(targets) // 2]
    report: dict = {"adapted_weights": len(targets), "rank": RANK,
                    "adapter_mib": round(sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20, 1)}
    weights = {}
    for label, lora in (("base", ()), ("lora", (LoraAdapter(str(adapter), 1.0),))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model = load_transformer(root, "bfloat16", "cuda:0", lora)
        torch.cuda.synchronize()
        report[label] = {"load_s": round(time.perf_counter() - start, 2),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
        weights[label] = dict(model.named_parameters())[checked].detach()
        del model
        torch.cuda.empty_cache()
    module = checked.removesuffix(".weight")
    down = tensors[f"transformer.{module}.lora_A.weight"].float().cuda()
    up = tensors[f"transformer.{module}.lora_B.weight"].float().cuda()
    want = (weights["base"].float() + up @ down).to(torch.bfloat16)
    report["check"] = {"weight": checked, "equals_fp32_sum_rounded_once": bool(torch.equal(weights["lora"], want)),
                       "max_abs_diff": (weights["lora"].float() - want.float()).abs().max().item(),
                       "delta_rms": (weights["lora"].float() - weights["base"].float()).pow(2).mean().sqrt().item()}
    text = json.dumps(report, indent=1)
    print(text)
    out.write_text(text)
    return 0 if report["check"]["max_abs_diff"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
