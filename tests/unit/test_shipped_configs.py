"""Every deployment shipped in configs/ loads, passes validation and renders a model repository (no
checkpoint is read), so a user copying one from the docs is not refused at startup for a typo in it."""

from pathlib import Path

import pytest

from mstar_common.config import load_deployment, validate_deployment
from mstar_common.repository import render_repository

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_deployment_is_valid(path):
    dep = load_deployment(path)
    validate_deployment(dep, path.name)
    files = render_repository(dep, path.name)
    assert any(name.endswith("config.pbtxt") for name in files)


def test_the_streams_deployment_differs_from_the_default_only_where_it_says():
    base = load_deployment(Path(CONFIGS[0]).parent / "orpheus_3b_gpu.yaml")
    streams = load_deployment(Path(CONFIGS[0]).parent / "orpheus_3b_gpu_streams.yaml")
    assert streams.resources.kv_cache.dtype == "fp8_e4m3" and base.resources.kv_cache.dtype == "auto"
    extra = {k: v for k, v in streams.model_kwargs.items() if base.model_kwargs.get(k) != v}
    assert extra == {"codec_in_process": True, "first_chunk_frames": "auto"}


def test_whisper_refuses_an_explicit_prefix_cache():
    """Its decoder's KV depends on the audio too: `prefix_caching: true` is refused at startup, unset it is off."""
    import dataclasses

    from mstar_common.config import DeploymentError

    dep = load_deployment(Path(CONFIGS[0]).parent / "whisper.yaml")
    validate_deployment(dep, "whisper.yaml")  # unset: valid (off for this family)
    dep.resources.kv_cache = dataclasses.replace(dep.resources.kv_cache, prefix_caching=True)
    with pytest.raises(DeploymentError, match="resources.kv_cache.prefix_caching"):
        validate_deployment(dep, "whisper.yaml")


def test_the_bench_deployment_is_what_bench_serve_serves_for_the_suite(monkeypatch):
    """configs/qwen3_0_6b_gpu_bench.yaml is for replaying perf_analyzer_configs/text_lm against a running server:
    it must serve as `mstar bench serve` does in docs/benchmarks.md, with scripts/gpu_suite.sh's own flags read
    through the real argument parser (a hand-built copy of them left out --no-capture-sampling, so the shipped
    file captured sampling graphs the benchmarks never had), above all with the prefix cache off, since those
    files' 16 prompts repeat."""
    import re
    import shlex

    from mstar_common.bench import cli as bench_cli
    from mstar_common.config import deployment_from_dict

    suite = (Path(__file__).parents[2] / "scripts" / "gpu_suite.sh").read_text()
    load = shlex.split(re.search(r"^LOAD=\((.*?)\)$", suite, re.M | re.S).group(1).replace("\\\n", " "))
    seen = []
    monkeypatch.setattr(bench_cli, "cmd_serve", lambda args: seen.append(args) or 0)
    assert bench_cli.main(["serve", "--family", "qwen3", "--checkpoint", "Qwen/Qwen3-0.6B", "--name", "qwen3-0.6b",
                           "--out", "unused.json", *load]) == 0
    served = deployment_from_dict(bench_cli.deployment(seen[0]), source="bench")
    shipped = load_deployment(Path(CONFIGS[0]).parent / "qwen3_0_6b_gpu_bench.yaml")
    validate_deployment(shipped, "qwen3_0_6b_gpu_bench.yaml")
    assert shipped.resources.kv_cache.prefix_caching is False
    assert shipped.resources == served.resources
    assert shipped.max_concurrent_requests == served.max_concurrent_requests == 64
    for key in ("cuda_graphs", "decode_buckets", "prefill_token_buckets", "attention_backend", "fused_ops",
                "capture_sampling"):
        assert getattr(shipped.components["llm"], key) == getattr(served.components["llm"], key), key
    assert shipped.model_kwargs["generation_config"] == served.model_kwargs["generation_config"] == "ignore"
