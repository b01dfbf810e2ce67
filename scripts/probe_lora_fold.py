"""The LoRA fold (`model_kwargs.lora`) at FLUX.2 klein's real shapes on the GPU: a random rank-16 adapter on every
linear of the transformer blocks, the DiT loaded with and without it (load seconds, peak GPU memory), and one folded
weight checked against its fp32 sum rounded once to bf16. The same adapter is also written as a Kohya file
(`lora_unet_double_blocks_N_img_attn_qkv`: q/k/v as one fused pair, a block-diagonal lora_B over the three A
stacked) and loaded: every weight it folds is compared with the diffusers-layout fold.

Usage (device): python scripts/probe_lora_fold.py CHECKPOINT OUT.json [KOHYA_COPY.safetensors]
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
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"  # the CPU: a check of this script on a tiny checkpoint


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


def write_kohya(root: Path, tensors: dict[str, torch.Tensor], path: Path) -> int:
    """The diffusers-layout adapter `tensors` re-spelled as a Kohya file through the transformer's BFL names
    (`lora_aliases`), alpha = rank (a factor of 1, as the diffusers file's): a fused qkv stacks its three A over a
    block-diagonal B. -> the number of Kohya modules written."""
    with torch.device("meta"):
        aliases = Flux2Transformer(transformer_config(root)).lora_aliases()
    adapted = {key.removeprefix("transformer.").removesuffix(".lora_A.weight") for key in tensors
               if key.endswith(".lora_A.weight")}
    out: dict[str, torch.Tensor] = {}
    for alias, targets in aliases.items():
        modules = [name.removesuffix(".weight") for name, _, _ in targets]
        swapped = any(chunks != len(targets) or order != (i,) for i, (_, chunks, order) in enumerate(targets))
        if swapped or not all(m in adapted for m in modules):  # (the final modulation's swap: not a block linear)
            continue
        downs = [tensors[f"transformer.{m}.lora_A.weight"] for m in modules]
        ups = [tensors[f"transformer.{m}.lora_B.weight"] for m in modules]
        down = torch.cat(downs)
        up = torch.block_diag(*ups) if len(ups) > 1 else ups[0]
        name = "lora_unet_" + alias.replace(".", "_")
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))
    save_file(out, str(path))
    return len(out) // 3


def main() -> int:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    adapter, tensors, targets = write_adapter(root, Path(tempfile.mkdtemp(prefix="lora-fold-")))
    checked = targets[len(targets) // 2]
    report: dict = {"adapted_weights": len(targets), "rank": RANK,
                    "adapter_mib": round(sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20, 1)}
    kohya = Path(sys.argv[3]) if len(sys.argv) > 3 else adapter.with_name("kohya.safetensors")
    report["kohya_modules"] = write_kohya(root, tensors, kohya)
    weights: dict[str, torch.Tensor] = {}
    folded: dict[str, torch.Tensor] = {}
    diffs: list[float] = []
    for label, lora in (("base", ()), ("lora", (LoraAdapter(str(adapter), 1.0),)),
                        ("kohya", (LoraAdapter(str(kohya), 1.0),))):
        cuda = DEVICE != "cpu"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model = load_transformer(root, "bfloat16", DEVICE, lora)
        if cuda:
            torch.cuda.synchronize()
        report[label] = {"load_s": round(time.perf_counter() - start, 2),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
        weights[label] = dict(model.named_parameters())[checked].detach()
        params = dict(model.named_parameters())
        if label == "lora":  # kept on the host, out of the next load's peak
            folded = {name: params[name].detach().cpu() for name in targets}
        elif label == "kohya":
            diffs = [(params[n].detach().cpu().float() - folded[n].float()).abs().max().item() for n in targets]
        del model, params
        if cuda:
            torch.cuda.empty_cache()
    module = checked.removesuffix(".weight")
    down = tensors[f"transformer.{module}.lora_A.weight"].float().to(DEVICE)
    up = tensors[f"transformer.{module}.lora_B.weight"].float().to(DEVICE)
    want = (weights["base"].float() + up @ down).to(torch.bfloat16)
    report["check"] = {"weight": checked, "equals_fp32_sum_rounded_once": bool(torch.equal(weights["lora"], want)),
                       "max_abs_diff": (weights["lora"].float() - want.float()).abs().max().item(),
                       "delta_rms": (weights["lora"].float() - weights["base"].float()).pow(2).mean().sqrt().item()}
    report["kohya_vs_diffusers_file"] = {"weights": len(targets), "bit_identical": sum(d == 0 for d in diffs),
                                         "max_abs_diff": max(diffs)}
    text = json.dumps(report, indent=1)
    print(text)
    out.write_text(text)
    return 0 if report["check"]["max_abs_diff"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
