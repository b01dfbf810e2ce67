"""A tiny random Z-Image-Turbo checkpoint in diffusers layout, for tests, CI and the CPU demo.

Built with the reference classes themselves (diffusers `ZImagePipeline` around `ZImageTransformer2DModel` and a
FLUX.1-style `AutoencoderKL`, transformers `Qwen3Model`, the offline BPE tokenizer of the tiny Qwen3), so it is
a real diffusers checkpoint. The geometry is the real one (VAE ×8, 2×2 patches: a 16-pixel token grid, 16
latent channels, scaling and shift factors); the widths are tiny. The DiT is REFERENCES.md's tiny config with
two main layers and `axes_lens[0] = 1024` (the real model's is 1536) so captions up to the 512-token limit fit the
RoPE range. Norm weights and the padding tokens are randomised (the reference initialises them to 1 and 0),
so the parity tests see them. Deterministic for a given seed; builds in ~2 s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_common.checkpoints import vary_norms_and_biases
from mstar_common.diffusion.tiny_checkpoint import save_pipeline_once, tiny_qwen3

TEXT = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8}
TRANSFORMER = {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 32, "n_layers": 2,
               "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "cap_feat_dim": TEXT["hidden_size"],
               "axes_dims": [4, 6, 6], "axes_lens": [1024, 32, 32]}
VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ("DownEncoderBlock2D",) * 4,
       "up_block_types": ("UpDecoderBlock2D",) * 4, "block_out_channels": (8, 16, 16, 16), "layers_per_block": 1,
       "latent_channels": 16, "norm_num_groups": 4, "sample_size": 64, "scaling_factor": 0.3611,
       "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}


def build_tiny_pipeline(seed: int = 0):
    """The tiny `ZImagePipeline` (in memory, fp32, eval)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from mstar_common.families.qwen3.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny_qwen3(Qwen3Model, tokenizer, TEXT)
        transformer = ZImageTransformer2DModel(**TRANSFORMER).eval()
        rms_norms = {f"{name}.weight" for name, module in transformer.named_modules()
                     if type(module).__name__.endswith("RMSNorm")}  # cap_embedder.0 has no "norm" in its name
        with torch.no_grad():
            for name, param in transformer.named_parameters():
                if "norm" in name or name in rms_norms:
                    param.mul_(1 + 0.2 * torch.randn_like(param))
                elif "pad_token" in name:
                    param.copy_(torch.randn_like(param))
        vae = vary_norms_and_biases(AutoencoderKL(**VAE).eval())  # GroupNorm weights not all 1
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline to `out_dir` in diffusers layout (if not there yet) and return the path; safe under
    concurrent callers."""
    return save_pipeline_once(out_dir, lambda: build_tiny_pipeline(seed))
