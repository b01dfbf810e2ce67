#!/usr/bin/env python3
"""One pytest run as N processes on one machine: the GPU suite's test stage on the device (one GPU, 16 cores: the
kernel tests spend most of their time in Triton's compiler, one core each) and the CPU stage of scripts/test.sh
(Triton's interpreter, one core each).

Collects the tests with the given pytest arguments, deals the test functions (all cases of one function stay in one
process) largest first to the process with the fewest cases so far, runs the processes at once, each with its own
log, and exits with the first failing process's status (0 when all pass; 5, no tests, counts as a pass when another
process ran some). Every process's summary line is printed, and a failing process's whole log.

    python scripts/parallel_pytest.py --jobs 4 --logs /tmp/logs -- -q -m gpu tests/kernels tests/gpu

`--jobs 1` runs plain pytest with the arguments as given.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# Collects in a child process and prints each test as `NODE <absolute path>::<function>` (`SKIP ...` where a skip
# marker already decides it), so the processes find them whatever directory pytest took as its root.
_COLLECT = """
import sys, pytest
def skipped(item):
    if any(True for _ in item.iter_markers("skip")):
        return True
    return any(m.args and not isinstance(m.args[0], str) and m.args[0] for m in item.iter_markers("skipif"))
class Nodes:
    def pytest_collection_finish(self, session):
        for item in session.items:
            name = str(item.path) + "::" + item.nodeid.split("::", 1)[1].split("[", 1)[0]
            print(("SKIP " if skipped(item) else "NODE ") + name)
sys.exit(pytest.main(sys.argv[1:] + ["--collect-only", "-q"], plugins=[Nodes()]))
"""


def collect(pytest_args: list[str]) -> dict[str, int]:
    """Test function (`path::name`, or `path::Class::name`, the path absolute) -> its number of cases that a skip
    marker does not already skip, in collection order."""
    done = subprocess.run([sys.executable, "-c", _COLLECT, "-p", "no:cacheprovider", *pytest_args], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode not in (0, 5):  # 5: nothing collected
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"parallel_pytest: collection failed (pytest exit {done.returncode})")
    counts: dict[str, int] = {}
    for line in done.stdout.splitlines():
        kind, _, function = line.partition(" ")
        if kind in ("NODE", "SKIP"):
            counts[function] = counts.get(function, 0) + (kind == "NODE")
    return counts


def deal(counts: dict[str, int], jobs: int) -> list[list[str]]:
    """The functions in `jobs` groups of about equal cases: largest first, each to the group with the fewest so far
    (ties to the earlier group); each group keeps collection order. Empty groups are dropped."""
    order = {name: i for i, name in enumerate(counts)}
    groups: list[list[str]] = [[] for _ in range(jobs)]
    sizes = [0] * jobs
    for name in sorted(counts, key=lambda n: (-counts[n], order[n])):
        target = min(range(jobs), key=lambda g: (sizes[g], g))
        groups[target].append(name)
        sizes[target] += counts[name]
    return [sorted(group, key=order.__getitem__) for group in groups if group]


# pytest's options that take the next argument as their value (the same list as scripts/test.sh's): `--tb short`
# kept only `--tb`, and the first dealt node id became its value (a usage error in every process)
TAKES_VALUE = frozenset({"-m", "-k", "-p", "-o", "-c", "-W", "-n", "--deselect", "--ignore", "--ignore-glob",
                         "--rootdir", "--basetemp", "--junitxml", "--junit-xml", "--confcutdir", "--maxfail",
                         "--durations", "--tb", "--log-file", "--override-ini", "--timeout"})


def options_only(pytest_args: list[str]) -> list[str]:
    """The arguments that are not test paths (options and their values), kept for every process."""
    kept = []
    expect_value = False
    for arg in pytest_args:
        if expect_value or arg.startswith("-"):
            kept.append(arg)
            expect_value = not expect_value and arg in TAKES_VALUE
        # a bare word that is not an option's value is a test path: replaced by the dealt node ids
    return kept


def run(jobs: int, logs: Path, pytest_args: list[str]) -> int:
    if jobs <= 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT)
    counts = collect(pytest_args)
    if not counts:
        print("parallel_pytest: no tests collected", flush=True)
        return 5
    groups = deal(counts, jobs)
    options = options_only(pytest_args)
    logs.mkdir(parents=True, exist_ok=True)
    processes = []
    for i, group in enumerate(groups):
        log = logs / f"pytest_{i}.log"
        print(f"parallel_pytest: process {i}: {sum(counts[n] for n in group)} tests in {len(group)} functions "
              f"-> {log}", flush=True)
        handle = log.open("w")
        processes.append((subprocess.Popen([sys.executable, "-m", "pytest", *options, *group], cwd=ROOT,
                                           stdout=handle, stderr=subprocess.STDOUT), log, handle))

    def stop(signum, _frame):  # a time limit (`timeout`) ends every process, not just this one
        for process, _, _ in processes:
            process.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    codes = []
    for process, _, handle in processes:
        codes.append(process.wait())
        handle.close()
    status = 0
    for i, (code, (_, log, _)) in enumerate(zip(codes, processes, strict=True)):
        lines = log.read_text(errors="replace").splitlines()
        print(f"parallel_pytest: process {i} exit {code}: {lines[-1] if lines else '(no output)'}", flush=True)
        if code not in (0, 5):
            print(f"----- {log} -----", *lines, sep="\n", flush=True)
            status = status or code
    if status == 0 and all(code == 5 for code in codes):
        status = 5
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("PYTEST_JOBS", "1") or 1),
                        help="processes (default: $PYTEST_JOBS, else 1)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/parallel_pytest"), help="one log per process here")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = parser.parse_args()
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return run(args.jobs, args.logs, pytest_args)


if __name__ == "__main__":
    sys.exit(main())
