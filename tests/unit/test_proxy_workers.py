"""The multi-worker proxy (`--workers`, `server.proxy_workers`): the parent hands its settings to uvicorn's worker
processes through the environment, and each worker builds the same app from them (CPU; no process is started)."""

from __future__ import annotations

import os

import pytest
import yaml

from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.launcher import proxy_limit_args
from mstar_common.proxy import __main__ as proxy_main


def _run(monkeypatch, *args):
    calls = []
    monkeypatch.setattr(proxy_main.uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    monkeypatch.delenv(proxy_main.SETTINGS_ENV, raising=False)
    proxy_main.main(["--triton-url", "127.0.0.1:9", "--model", "a=a_llm", "--model", "tts=orpheus_tts:speech",
                     "--request-timeout-s", "0", "--max-body-bytes", "1234", "--allow-remote-urls", *args])
    (app, kwargs), = calls
    return app, kwargs


def test_one_worker_serves_the_app_in_process(monkeypatch):
    app, kwargs = _run(monkeypatch)
    assert not isinstance(app, str) and "workers" not in kwargs
    assert proxy_main.SETTINGS_ENV not in os.environ


def test_workers_rebuild_the_parents_settings_from_the_environment(monkeypatch):
    app, kwargs = _run(monkeypatch, "--workers", "3", "--drain-timeout-s", "7")
    assert app == "mstar_common.proxy.__main__:app_from_env" and kwargs["factory"] and kwargs["workers"] == 3
    assert kwargs["timeout_graceful_shutdown"] == 7.0
    settings, level = proxy_main.settings_from_json(os.environ[proxy_main.SETTINGS_ENV])
    assert level == "info"
    assert settings.triton_url == "127.0.0.1:9" and settings.request_timeout_s is None
    assert settings.max_body_bytes == 1234 and settings.allow_remote_urls
    assert [(m.name, m.triton_model, m.kind) for m in settings.models] == [("a", "a_llm", "text"),
                                                                           ("tts", "orpheus_tts", "speech")]
    assert isinstance(settings.created, int)  # one `created` for every worker's model cards
    worker_app = proxy_main.app_from_env()
    assert worker_app.state.serving.created == settings.created
    assert sorted(worker_app.state.serving.models) == ["a", "tts"]


@pytest.mark.parametrize("workers", ["0", "65"])
def test_worker_count_out_of_range_is_refused(monkeypatch, capsys, workers):
    with pytest.raises(SystemExit):
        _run(monkeypatch, "--workers", workers)
    assert "--workers must be in [1, 64]" in capsys.readouterr().err


def test_the_deployment_key_reaches_the_proxy_command():
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw.setdefault("server", {})["proxy_workers"] = 4
    args = proxy_limit_args(deployment_from_dict(raw, source="test"))
    assert args[args.index("--workers") + 1] == "4"
