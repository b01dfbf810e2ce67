"""scripts/bench_flux2.py: the CPU smoke run reports both systems, and the random-checkpoint writers (klein-4B and
Z-Image-Turbo shapes on the GPU) produce diffusers-layout checkpoints that both our loader and the reference classes
read; for both families."""

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
TINY_Z_DIT = {**bench.Z_TRANSFORMER, "dim": 32, "n_layers": 1, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
              "cap_feat_dim": TINY_QWEN3["hidden_size"], "axes_dims": [4, 6, 6]}
TINY_Z_VAE = {**bench.Z_VAE, "block_out_channels": [8, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4}


@pytest.mark.parametrize(("family", "steps"), [("flux2_klein", 4), ("z_image_turbo", 8)])
def test_smoke_run_reports_both_systems(tmp_path, family, steps):
    out = tmp_path / "report.json"
    report = bench.main(["--family", family, "--smoke", "--json", str(out), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert json.loads(out.read_text()) == report
    assert (report["family"], report["steps"], report["size"]) == (family, steps, "64x64")
    for system in ("ours", "diffusers"):
        assert [row["concurrency"] for row in report[system]] == [1, 2]
        assert all(row["images_per_s"] > 0 for row in report[system])
    for row in report["ours"]:  # engine mode says where a request's time goes
        assert {"text_encoder", "denoise", "vae_decode"} <= set(row["component_p50_ms"])
        assert all(ms > 0 for ms in row["component_p50_ms"].values())


def test_smoke_run_with_the_vae_in_denoise(tmp_path):
    report = bench.main(["--smoke", "--skip-diffusers", "--vae-in-denoise", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert report["vae_in_denoise"] and all(row["images_per_s"] > 0 for row in report["ours"])
    for row in report["ours"]:  # no hop to the vae_decode component
        assert "denoise" in row["component_p50_ms"] and "vae_decode" not in row["component_p50_ms"]


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


def test_profile_splits_a_request_and_writes_the_op_tables(tmp_path):
    out = tmp_path / "report.json"
    report = bench.main(["--smoke", "--profile", "--json", str(out), "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert [row["concurrency"] for row in report["ours"]] == [1, 2]  # the timed rows are still there
    profile = json.loads(out.read_text())["profile"]
    parts = {"ours": {"text_encoder", "denoise", "vae_decode", "png_encode"},
             "diffusers": {"text_encoder", "denoise", "vae_decode", "postprocess"}}
    for system, named in parts.items():
        breakdown = profile[system]["breakdown_ms"]
        assert set(breakdown) == named | {"other", "total"} and "tables" not in profile[system]
        assert all(breakdown[name] > 0 for name in named)
        assert breakdown["total"] > max(breakdown[name] for name in named)  # medians per part: no exact sum
    assert profile["tflop"]["image"] > 0
    text = (tmp_path / "report_profile.txt").read_text()
    assert profile["file"] == str(tmp_path / "report_profile.txt")
    for heading in ("== ours (engine)", "== diffusers", "top 40 by self CUDA time", "top 25 by self CPU time"):
        assert heading in text
    assert "layer_norm" in text.split("== diffusers")[0]  # the denoise thread's ops are profiled too


def test_flop_count_of_one_4b_image(tmp_path):
    import argparse

    for folder, config in (("transformer", bench.TRANSFORMER_4B), ("vae", bench.VAE),
                           ("text_encoder", bench.QWEN3_4B)):
        bench._json(tmp_path / folder / "config.json", config)
    args = argparse.Namespace(width=1024, height=1024, steps=4, taps=[9, 18, 27])
    tflop = bench.image_tflops(tmp_path, args)
    assert tflop["denoise_step"] == pytest.approx(34.82, abs=0.01)
    assert tflop["text_encoder"] == pytest.approx(2.906, abs=0.01)
    assert tflop["vae_decode"] == pytest.approx(10.475, abs=0.01)
    assert tflop["image"] == pytest.approx(152.66, abs=0.05)


def test_z_image_random_checkpoint_loads_in_our_loader_and_the_reference_classes(tmp_path):
    import torch
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from mstar_common.families.z_image_turbo import loader

    root = bench.write_random_z_image_checkpoint(tmp_path / "random", "cpu", TINY_Z_DIT, TINY_QWEN3, TINY_Z_VAE)
    loader.check_pipeline(root)
    ours = loader.load_transformer(root, "bfloat16", "cpu")
    text = loader.load_text_encoder(root, "bfloat16", "cpu")
    decoder = loader.load_vae_decoder(root, "bfloat16", "cpu")
    assert torch.equal(ours.cap_embedder[0].weight, torch.ones(TINY_QWEN3["hidden_size"], dtype=torch.bfloat16))
    loaded = [cls.from_pretrained(root / folder, output_loading_info=True, **{key: torch.bfloat16})
              for cls, folder, key in ((ZImageTransformer2DModel, "transformer", "torch_dtype"),
                                       (AutoencoderKL, "vae", "torch_dtype"), (Qwen3Model, "text_encoder", "dtype"))]
    for _, info in loaded:  # every tensor of each reference class is in the checkpoint, and nothing else
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    (reference, _), (vae, _), (qwen3, _) = loaded
    assert torch.equal(reference.layers[0].attention.to_q.weight, ours.layers[0].attention.to_q.weight)
    assert torch.equal(vae.decoder.conv_in.weight, decoder.decoder.conv_in.weight)
    assert torch.equal(qwen3.layers[0].mlp.up_proj.weight, text.model.layers[0].mlp.up_proj.weight)
    # Z-Image-Turbo's step count and guidance are the family's: 8 steps, no classifier-free guidance
    assert bench.FAMILIES["z_image_turbo"].steps == 8
    assert bench.FAMILIES["z_image_turbo"].call_kwargs(None) == {"guidance_scale": 0.0}


def test_z_image_refuses_profile(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--family", "z_image_turbo", "--smoke", "--profile"])
    assert "--profile is implemented for --family flux2_klein only" in capsys.readouterr().err


def test_timing_summary_reads_the_servers_timing_lines():
    log = "\n".join([
        "2026-12-01 12:31:45,518 INFO backends.stateless_node: [a#0/text_encoder#0] timing flux2_klein_text_encoder: "
        "18.6 ms from arrival to response sent",
        "2026-12-01 12:31:45,520 INFO backends.walk_router: [a#0] timing hop text_encoder: 21.0 ms",
        "2026-12-01 12:31:45,620 INFO backends.walk_router: [b#1] timing hop text_encoder: 25.0 ms",
        "2026-12-01 12:31:45,720 INFO backends.walk_router: [c#2] timing hop text_encoder: 40.0 ms",
        "I1201 12:31:45.657 1 model.cc:1] unrelated",
        "2026-12-01 12:31:45,657 INFO backends.walk_router: [a#0] timing walk: 169.8 ms",
    ])
    assert bench.timing_summary(log) == {"flux2_klein_text_encoder": 18.6, "hop text_encoder": 25.0,
                                               "walk": 169.8}


def test_step_deltas_give_each_engines_steps_and_rows_per_step():
    def scrape(steps, graph_steps, rows):
        return bench.parse_step_counters("\n".join([
            "# HELP mstar_engine_steps_total engine steps run",
            "# TYPE mstar_engine_steps_total counter",
            f'mstar_engine_steps_total{{instance="0",model="flux2_klein_denoise"}} {steps}',
            f'mstar_engine_steps_total{{instance="1",model="flux2_klein_denoise"}} {steps}',
            f'mstar_graph_steps_total{{instance="0",model="flux2_klein_denoise"}} {graph_steps}',
            f'mstar_engine_rows_stepped_total{{instance="0",model="flux2_klein_denoise"}} {rows}',
            'mstar_engine_steps_total{instance="0",model="flux2_klein_text_encoder"} 7',
            'nv_inference_count{model="flux2_klein_denoise",version="1"} 99',
        ]))

    before, after = scrape(10, 10, 40), scrape(30, 20, 440)
    assert before[("flux2_klein_denoise", "mstar_engine_steps_total")] == 20  # both instances
    # 40 more steps (two instances), 10 of them from graphs, 400 more rows; the text encoder did not step
    assert bench.step_deltas(before, after) == {
        "flux2_klein_denoise": {"steps": 40, "graph_share": 0.25, "rows_per_step": 10.0}}


def test_step_counters_wait_for_a_metrics_sample_begun_after_the_call(monkeypatch):
    """The served levels read the step counters after a fixed 0.2 s; a sampler slowed past that by load left a
    level's last steps out. The read now waits until every instance has finished a sample begun after the call."""
    import contextlib
    import io

    import mstar_common.launcher as launcher

    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    page = ('mstar_engine_steps_total{{instance="{i}",model="flux2_klein_denoise"}} {steps}\n'
            'mstar_metrics_samples_total{{instance="{i}",model="flux2_klein_denoise"}} {samples}\n')
    # (steps, samples) of two instances a read: instance 1's sampler is slow; its last 4 steps show at its 9th sample
    reads = iter("".join(page.format(i=i, steps=st, samples=n) for i, (st, n) in enumerate(pair)) for pair in [
        ((10, 5), (6, 7)), ((10, 6), (6, 7)), ((10, 7), (6, 8)), ((10, 8), (10, 9))])
    monkeypatch.setattr(launcher, "open_direct",
                        lambda url, timeout: contextlib.nullcontext(io.BytesIO(next(reads).encode())))
    got = bench.step_counters("http://127.0.0.1:1/metrics")
    assert got[("flux2_klein_denoise", "mstar_engine_steps_total")] == 20 and next(reads, None) is None
