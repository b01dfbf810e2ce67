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
