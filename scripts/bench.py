#!/usr/bin/env python
"""The serving benchmark from a checkout: `mstar bench` (mstar_common/bench/cli.py), runnable without installing
the package. `scripts/bench.py --help` lists the subcommands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="scripts/bench.py"))
