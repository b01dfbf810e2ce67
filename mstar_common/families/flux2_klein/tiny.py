"""A tiny random FLUX.2 [klein] checkpoint in diffusers layout, for tests, CI and the CPU demo.

Built with the reference classes themselves (diffusers `Flux2KleinPipeline` around `Flux2Transformer2DModel`,
`AutoencoderKLFlux2`, transformers `Qwen3ForCausalLM`, the offline BPE tokenizer of the tiny Qwen3), so it is
a real diffusers checkpoint. The geometry is the real one (VAE ×8, 2×2 patches: a 16-pixel latent grid);
the widths are tiny. The text encoder has 4 layers and the DiT reads taps 1, 2, 3 (`TINY_TAPS`), so, like
the real model, the encoder's last layer is never run. Deterministic for a given seed; builds in ~2 s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar_common.checkpoints import vary_norms_and_biases
from mstar_common.diffusion.tiny_checkpoint import save_pipeline_once, tiny_qwen3

TINY_TAPS = (1, 2, 3)
_TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 8}
TRANSFORMER = {"in_channels": 16, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "joint_attention_dim": len(TINY_TAPS) * _TEXT["hidden_size"],
               "timestep_guidance_channels": 32, "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": False}
VAE = {"block_out_channels": (8, 16, 16, 16), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 4,
       "sample_size": 64}
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "exponential"}


def build_tiny_pipeline(seed: int = 0):
    """The tiny `Flux2KleinPipeline` (in memory, fp32, eval)."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3ForCausalLM

    from mstar_common.families.qwen3.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny_qwen3(Qwen3ForCausalLM, tokenizer, _TEXT)
        transformer = vary_norms_and_biases(Flux2Transformer2DModel(**TRANSFORMER).eval())
        vae = vary_norms_and_biases(AutoencoderKLFlux2(**VAE).eval())  # GroupNorm weights not all 1
        channels = vae.bn.running_mean.shape[0]  # non-trivial latent statistics, so (de)normalisation is tested
        vae.bn.running_mean.copy_(torch.randn(channels) * 0.1)
        vae.bn.running_var.copy_(torch.rand(channels) + 0.5)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=True)


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline to `out_dir` in diffusers layout (if not there yet) and return the path; safe under
    concurrent callers."""
    return save_pipeline_once(out_dir, lambda: build_tiny_pipeline(seed))
