"""scripts/parallel_pytest.py: one pytest run as several processes (the GPU suite's test stage, the CPU kernel
stage of scripts/test.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import SCRIPTS, load_script

SCRIPT = SCRIPTS / "parallel_pytest.py"


def _module():
    return load_script("parallel_pytest")


def test_functions_are_dealt_largest_first_to_the_smallest_group():
    deal = _module().deal
    counts = {"a::t1": 1, "a::t2": 10, "b::t3": 6, "b::t4": 5, "c::t5": 3}
    groups = deal(counts, 2)
    assert groups == [["a::t2", "c::t5"], ["a::t1", "b::t3", "b::t4"]]  # 13 and 12 cases, in collection order
    assert sorted(sum(groups, [])) == sorted(counts)
    assert deal(counts, 9) == [["a::t2"], ["b::t3"], ["b::t4"], ["c::t5"], ["a::t1"]]  # no empty groups


def test_options_are_kept_and_paths_replaced():
    options_only = _module().options_only
    args = ["-q", "-m", "not slow", "tests/kernels", "-p", "no:cacheprovider", "-k", "prefill", "tests/gpu/x.py::t",
            "-x", "--durations=5"]
    assert options_only(args) == ["-q", "-m", "not slow", "-p", "no:cacheprovider", "-k", "prefill", "-x",
                                  "--durations=5"]


def test_an_option_that_takes_a_value_keeps_it():
    """Only nine options were known to take a value: `--tb short` kept `--tb` and the first dealt node id became
    its value (a usage error in every process), `--deselect X` dropped X and deselected a dealt test instead."""
    options_only = _module().options_only
    args = ["-q", "--tb", "short", "--maxfail", "1", "--deselect", "a.py::t", "--junitxml", "r.xml", "tests/kernels"]
    assert options_only(args) == args[:-1]


def _tests(tmp_path, failing: bool) -> Path:
    folder = tmp_path / "suite"
    folder.mkdir()
    (folder / "test_one.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', range(4))\ndef test_a(n):\n    assert n < 4\n\n"
        "def test_b():\n    assert True\n")
    (folder / "test_two.py").write_text(f"def test_c():\n    assert {not failing}\n\ndef test_d():\n    pass\n\n"
                                        "import pytest\n\n@pytest.mark.skipif(True, reason='never here')\n"
                                        "def test_e():\n    pass\n")
    return folder


def test_collection_counts_cases_and_leaves_out_what_a_marker_skips(tmp_path):
    folder = _tests(tmp_path, failing=False)
    counts = _module().collect(["-q", str(folder)])
    assert counts == {f"{folder}/test_one.py::test_a": 4, f"{folder}/test_one.py::test_b": 1,
                      f"{folder}/test_two.py::test_c": 1, f"{folder}/test_two.py::test_d": 1,
                      f"{folder}/test_two.py::test_e": 0}


def _run(tmp_path, folder, jobs):
    return subprocess.run([sys.executable, str(SCRIPT), "--jobs", str(jobs), "--logs", str(tmp_path / "logs"), "--",
                           "-q", "-p", "no:cacheprovider", str(folder)], capture_output=True, text=True, timeout=300)


def test_a_run_in_processes_passes_and_reports_each(tmp_path):
    done = _run(tmp_path, _tests(tmp_path, failing=False), 3)
    assert done.returncode == 0, done.stdout + done.stderr
    summaries = [line for line in done.stdout.splitlines() if " exit 0: " in line]
    assert len(summaries) == 3
    assert sum(int(line.split("exit 0: ")[1].split(" passed")[0]) for line in summaries) == 7
    assert len(list((tmp_path / "logs").glob("pytest_*.log"))) == 3


def test_a_failing_process_fails_the_run_and_prints_its_log(tmp_path):
    done = _run(tmp_path, _tests(tmp_path, failing=True), 2)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED" in done.stdout and "test_c" in done.stdout and "-----" in done.stdout


def _run_test_sh(tmp_path: Path, *args: str, stage_rc: int = 0, rc: int = 0) -> list[str]:
    """scripts/test.sh in a copy of the layout it expects, with setup.sh a no-op and a .venv python that logs each
    call (and reports no GPU), its kernel stage exiting `stage_rc`: the calls it made (test.sh exiting `rc`)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "test.sh").write_text((SCRIPTS / "test.sh").read_text())
    (root / "scripts" / "setup.sh").write_text("#!/bin/sh\n")
    (root / "scripts" / "setup.sh").chmod(0o755)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../../calls.log"\n'
                      f'case "$*" in *parallel_pytest*) exit {stage_rc};; esac\n')
    python.chmod(0o755)
    for folder in ("configs", "tests/unit"):
        (root / folder).mkdir(parents=True)
    done = subprocess.run(["bash", str(root / "scripts" / "test.sh"), *args], timeout=60)
    assert done.returncode == rc, done.returncode
    return (root / "calls.log").read_text().splitlines()


def test_a_selection_that_matches_no_kernel_test_passes_the_test_script(tmp_path):
    """`test.sh -k prefix_cache` exited 5 after a green run: the interpreter stage took the caller's -k, matched no
    kernel test, and pytest's "no tests collected" (5) became the script's status. A failing stage still fails."""
    calls = _run_test_sh(tmp_path / "none", "-k", "prefix_cache", stage_rc=5, rc=0)
    assert any("scripts/parallel_pytest.py" in call for call in calls)
    _run_test_sh(tmp_path / "failed", "-k", "prefix_cache", stage_rc=1, rc=1)


def test_the_test_scripts_kernel_stage_runs_unless_test_paths_are_given(tmp_path):
    """An option's value that happens to name a folder (`-k configs`) was taken for a test path, so the CPU kernel
    stage was skipped though no path was given."""
    for args in (["-q"], ["-k", "configs"], ["-m", "not gpu", "--deselect", "tests/unit"]):
        calls = _run_test_sh(tmp_path / "_".join(args).replace(" ", "-").replace("/", "-"), *args)
        assert calls[0].startswith("-m pytest"), calls
        assert any("scripts/parallel_pytest.py" in call for call in calls), (args, calls)
    calls = _run_test_sh(tmp_path / "paths", "-q", "tests/unit")
    assert not any("parallel_pytest" in call for call in calls), calls


def test_the_kernel_stage_joins_a_callers_marker_to_its_own(tmp_path):
    """pytest keeps the last -m: `test.sh -m "not server"` replaced the stage's "not slow" and ran the slow
    interpreter cases (minutes each)."""
    calls = _run_test_sh(tmp_path / "marker", "-m", "not server", "--tb", "short")
    stage = next(call for call in calls if "scripts/parallel_pytest.py" in call)
    assert stage.endswith("-- -m not slow and (not server) --tb short tests/kernels"), stage
    calls = _run_test_sh(tmp_path / "plain", "-q")
    stage = next(call for call in calls if "scripts/parallel_pytest.py" in call)
    assert stage.endswith("-- -m not slow -q tests/kernels"), stage


def _run_device_script(tmp_path, script: str, *args: str) -> dict[str, tuple[int, str]]:
    """(exit code, stdout) of `script` copied into a checkout whose device_env.sh makes every Python `true` ("pass")
    or `false` ("fail"), so each stage that runs one succeeds or fails."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / script).write_text((SCRIPTS / script).read_text())
    results = {}
    for outcome, python in (("pass", "true"), ("fail", "false")):
        fake_env = f"PY={python}\nIMAGE_PY={python}\nensure_soundfile() {{ :; }}\n"
        (root / "scripts" / "device_env.sh").write_text(fake_env)
        env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / f"out_{outcome}"),
               "SUITE_WORK": str(tmp_path / f"work_{outcome}")}
        done = subprocess.run(["bash", str(root / "scripts" / script), *args], env=env, capture_output=True,
                              text=True, timeout=60, cwd=root)
        results[outcome] = (done.returncode, done.stdout)
    return results


@pytest.mark.parametrize("script, args", [("gpu_suite.sh", ["--tests-only"]), ("gpu_family_benches.sh", ["gpu-tests"])])
def test_a_device_script_exits_1_naming_a_stage_that_failed(tmp_path, script, args):
    """Every stage ended in `|| echo "STAGE FAILED"` and the script in `exit 0`: failing GPU tests returned 0 (the
    suite's, then the family script's)."""
    results = _run_device_script(tmp_path, script, *args)
    assert results["pass"][0] == 0 and "=== every stage passed" in results["pass"][1], results["pass"]
    assert results["fail"][0] == 1 and "=== 1 stage(s) failed: [gpu tests]" in results["fail"][1], results["fail"]


def test_every_gpu_marked_unit_test_file_is_in_the_device_scripts():
    """The GPU tests of tests/unit ran in no exit-checked device stage: the suite ran tests/kernels and tests/gpu, and
    the family script's list lacked test_step_buffers.py."""
    import re

    marked = sorted(f"tests/unit/{p.name}" for p in (SCRIPTS.parent / "tests" / "unit").glob("test_*.py")
                    if re.search(r"mark\.gpu\b", p.read_text()))
    assert marked
    suite = (SCRIPTS / "gpu_suite.sh").read_text()
    listed = re.search(r'GPU_UNIT_TESTS="([^"]*)"', suite)[1].split()
    assert sorted(listed) == marked
    families = (SCRIPTS / "gpu_family_benches.sh").read_text()
    assert all(name in families for name in marked), [n for n in marked if n not in families]
    assert not [p for p in (SCRIPTS.parent / "tests" / "integration").glob("test_*.py")
                if re.search(r"mark\.gpu\b", p.read_text())]


def test_a_test_extra_that_does_not_import_fails_the_run_scripts_test_sh_starts(tmp_path):
    """`pytest.importorskip` turned a broken test extra (diffusers, snac, ...) into skipped parity modules on a green
    CI; scripts/test.sh sets PYTEST_REQUIRE_EXTRAS, under which tests/conftest.py refuses to start without them."""
    import os

    (tmp_path / "snac").mkdir()
    (tmp_path / "snac" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "tests/unit/test_switches.py"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SCRIPTS.parent}", "PYTEST_REQUIRE_EXTRAS": "1"}
    done = subprocess.run(command, cwd=SCRIPTS.parent, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 4 and "snac (ImportError: a broken install)" in done.stderr + done.stdout
    assert "PYTEST_REQUIRE_EXTRAS=1" in (SCRIPTS / "test.sh").read_text()


def test_setup_refuses_a_python_the_project_cannot_install_on_before_making_the_venv(tmp_path):
    """pyproject said >=3.11 and the README 3.11+: on 3.13, pip tried to build NumPy 1.x from source (no wheel) and
    failed deep in the install; past 3.13 nvidia-pytriton has no Python-backend stub."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    supported = SpecifierSet(tomllib.loads((SCRIPTS.parent / "pyproject.toml").read_text())["project"]
                             ["requires-python"])
    assert {"3.11.7", "3.12.3"} <= set(supported.filter(["3.11.7", "3.12.3", "3.13.1", "3.14.0"]))
    assert not set(supported.filter(["3.13.1", "3.14.0"]))
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "setup.sh").write_text((SCRIPTS / "setup.sh").read_text())
    fake = tmp_path / "python3.13"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Python 3.13.1" && exit 0\n'
                    '[ "$1" = -c ] && exit 1\ntouch "$(dirname "$0")/venv-made"\n')
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env={"PATH": "/usr/bin:/bin",
                          "PYTHON": str(fake)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Python 3.13.1" in done.stderr and "use Python 3.11 or 3.12" in done.stderr
    assert not (tmp_path / "venv-made").exists() and not (root / ".venv").exists()
