"""Loading a file of `scripts/` as a module, for the tests of the scripts' functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """`scripts/<name>.py` as the module `name` (registered in `sys.modules` first: dataclasses look their module
    up while the script is executed)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
