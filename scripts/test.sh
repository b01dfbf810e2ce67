#!/usr/bin/env bash
# Sets up what the tests need, then runs them (GPU tests skip without a GPU). Extra args go to pytest.
# Without a GPU, a second stage runs the kernel tests in Triton's interpreter (see below).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PYTEST_REQUIRE_EXTRAS=1 .venv/bin/python -m pytest "${@:-tests}"  # a test extra that does not import fails the run
# Given no test paths (options only) and no GPU: the Triton kernels against their torch references too, on the
# CPU through Triton's interpreter (their smaller sweep; the slowest cases there are marked `slow`, left to the GPU),
# as one process a core (at most 4; KERNEL_TEST_JOBS sets it), each with its log under $TMPDIR/mstar-kernel-tests-<uid>.
# (A test path is an argument that names a file or folder, `path::test` included; the value of an option such as
# `-k config` or `--deselect tests/x.py::t` is not one.)
# (The options that take a value are scripts/parallel_pytest.py's TAKES_VALUE too.) A `-m EXPR` of the caller's is
# joined to the stage's own: pytest keeps the last -m given, so `-m "not server"` ran the slow interpreter cases.
value=0
marker="not slow"
rest=()
for arg in "$@"; do
  if [ "$value" = m ]; then value=0; marker="not slow and ($arg)"; continue; fi
  if [ "$value" = 1 ]; then value=0; rest+=("$arg"); continue; fi
  case $arg in
    -m) value=m; continue ;;
    -k|-p|-o|-c|-W|-n|--deselect|--ignore|--ignore-glob|--rootdir|--basetemp|--junitxml|--junit-xml|\
      --confcutdir|--maxfail|--durations|--tb|--log-file|--override-ini|--timeout) value=1 ;;
    -*) ;;
    *) [ -e "${arg%%::*}" ] && exit 0 ;;
  esac
  rest+=("$arg")
done
if .venv/bin/python -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then
  jobs=${KERNEL_TEST_JOBS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
  status=0
  TRITON_INTERPRET=1 .venv/bin/python scripts/parallel_pytest.py --jobs "$jobs" \
    --logs "${TMPDIR:-/tmp}/mstar-kernel-tests-$(id -u)" -- -m "$marker" ${rest[@]+"${rest[@]}"} tests/kernels || status=$?
  if [ "$status" = 5 ]; then  # pytest's "no tests collected": the caller's -k/-m selects no kernel test
    echo "test.sh: no kernel test matches this selection; the interpreter stage has nothing to run"
    status=0
  fi
  exit "$status"
fi
