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


def test_a_local_header_is_part_of_the_hash(tmp_path):
    (tmp_path / "inc").mkdir()
    source = tmp_path / "k.cu"
    source.write_text('#include <stdint.h>\n#include "inc/a.cuh"\nint f() { return A; }\n')
    (tmp_path / "inc" / "a.cuh").write_text('#include "b.cuh"\n')  # relative to the header's own folder
    (tmp_path / "inc" / "b.cuh").write_text("#define A 1\n")
    first = cuda_build.source_digest(source, "sm_90a")
    assert cuda_build.source_digest(source, "sm_90a") == first
    assert cuda_build.source_digest(source, "sm_100") != first
    (tmp_path / "inc" / "b.cuh").write_text("#define A 2\n")
    assert cuda_build.source_digest(source, "sm_90a") != first
