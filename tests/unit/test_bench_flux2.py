"""scripts/bench_flux2.py: the CPU smoke run reports both systems, and the random-checkpoint writer (klein-4B
shapes on the GPU) produces a diffusers-layout checkpoint that both our loader and the reference classes read."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mstar_common.cli import PROJECT_ROOT

pytest.importorskip("diffusers")

_spec = importlib.util.spec_from_file_location("bench_flux2", PROJECT_ROOT / "scripts" / "bench_flux2.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY_DIT = {**bench.TRANSFORMER_4B, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
            "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 48,
            "timestep_guidance_channels": 32, "axes_dims_rope": [4, 4, 4, 4]}
TINY_QWEN3 = {**bench.QWEN3_4B, "vocab_size": 512, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024}
TINY_VAE = {**bench.VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "latent_channels": 4,
            "norm_num_groups": 4}


def test_smoke_run_reports_both_systems(tmp_path):
    out = tmp_path / "report.json"
    report = bench.main(["--smoke", "--json", str(out), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert json.loads(out.read_text()) == report
    for system in ("ours", "diffusers"):
        assert [row["concurrency"] for row in report[system]] == [1, 2]
        assert all(row["images_per_s"] > 0 for row in report[system])
    for row in report["ours"]:  # engine mode says where a request's time goes
        assert {"text_encoder", "denoise", "vae_decode"} <= set(row["component_p50_ms"])
        assert all(ms > 0 for ms in row["component_p50_ms"].values())


def test_random_checkpoint_loads_in_our_loader_and_the_reference_classes(tmp_path):
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    from mstar_common.families.flux2_klein import loader

    root = bench.write_random_checkpoint(tmp_path / "random", "cpu", TINY_DIT, TINY_QWEN3, TINY_VAE)
    loader.check_pipeline(root)
    ours = loader.load_transformer(root, "bfloat16", "cpu")
    loader.load_text_encoder(root, (1, 2, 3), "bfloat16", "cpu")
    loader.load_vae_encoder(root, "bfloat16", "cpu")
    loader.load_vae_decoder(root, "bfloat16", "cpu")
    reference = Flux2Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=torch.bfloat16)
    assert torch.equal(reference.proj_out.weight, ours.proj_out.weight)
    AutoencoderKLFlux2.from_pretrained(root / "vae", torch_dtype=torch.bfloat16)
    Qwen3ForCausalLM.from_pretrained(root / "text_encoder", dtype=torch.bfloat16)
