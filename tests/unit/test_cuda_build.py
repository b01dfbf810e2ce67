"""mstar_common.cuda_build: where nvcc is found, and the error when it is not."""

import pytest

from mstar_common import cuda_build


def test_nvcc_from_cuda_home_then_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"needs nvcc \(on PATH or under \$CUDA_HOME/bin\)"):
        cuda_build.nvcc()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    assert cuda_build.nvcc() == str(tmp_path / "bin" / "nvcc")
