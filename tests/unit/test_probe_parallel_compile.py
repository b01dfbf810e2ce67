"""scripts/probe_parallel_compile.py: the GEMV kernels the start-up tuning would compile, compiled for an H200
without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.scripts import SCRIPTS, load_script

pytest.importorskip("triton")
probe = load_script("probe_parallel_compile")


def test_the_kernels_cover_each_form_the_tuning_times_once():
    jobs = probe.kernels([1])
    keys = [json.dumps(job, sort_keys=True) for job in jobs]
    assert len(keys) == len(set(keys)) > 10
    forms = {(consts["NORM"], consts["SWIGLU"]) for consts, _ in jobs}
    assert forms == {(False, False), (True, False), (False, True)}  # plain, norm inside (qkv, gate_up), SwiGLU down
    assert all(consts["BLOCK_M"] == 1 for consts, _ in jobs)
    assert {consts["BLOCK_M"] for consts, _ in probe.kernels([1, 3])} == {1, 4}  # 3 rows pad to 4


def test_the_probe_compiles_for_sm_90_on_each_thread_count():
    out = subprocess.run([sys.executable, str(SCRIPTS / "probe_parallel_compile.py"), "--threads", "1", "2",
                          "--rows", "1", "--limit", "2"], capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in out.stdout.splitlines() if "GEMV kernels" in line]
    assert [line.split(" on ")[1].split(":")[0] for line in lines] == ["1 thread(s)", "2 thread(s)"]
    assert all(line.startswith("2 GEMV kernels for sm_90") for line in lines)
