"""launcher.bare_triton, the platform probes' server: it serves a throwaway repository, is always stopped, and a
server that cannot start raises with its log's tail on stderr."""

from pathlib import Path

import pytest

from mstar_common.launcher import bare_triton


def test_serves_a_repository_and_stops_it(tmp_path: Path):
    import tritonclient.grpc as grpcclient

    repo = tmp_path / "repo"
    repo.mkdir()
    with bare_triton(repo, tmp_path / "tritonserver.log") as url:
        client = grpcclient.InferenceServerClient(url)
        assert client.is_server_live()
        client.close()
    with pytest.raises(Exception):  # noqa: B017 - any connection error: the server is gone
        grpcclient.InferenceServerClient(url).is_server_live(client_timeout=2)


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path: Path, capsys):
    with pytest.raises(RuntimeError, match="tritonserver exited"):
        with bare_triton(tmp_path / "missing", tmp_path / "tritonserver.log", timeout=60):
            pass
    assert "missing" in capsys.readouterr().err
