"""Our top-level import names belong to us alone. A checkout puts its root first on sys.path, so a folder of ours
that shares a top-level name with an installed distribution hides that distribution from everything that imports
it. That happened: transformers 5.25 requires Hugging Face's `kernels` package and imports it at start, and our
`kernels/` (now `mstar_kernels/`) answered instead, so nothing that imported transformers could load."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OURS = "mstar-triton"


def _top_level_packages() -> list[str]:
    """The top-level packages pyproject.toml ships (its `packages.find` include patterns, wildcards dropped)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    names = sorted({pattern.split(".")[0].rstrip("*") for pattern in patterns})
    assert names and all((ROOT / name / "__init__.py").is_file() for name in names), names
    return names


def test_no_installed_distribution_shares_a_top_level_name_with_ours():
    owners = importlib.metadata.packages_distributions()
    clashes = {name: sorted(set(owners.get(name, ())) - {OURS}) for name in _top_level_packages()}
    assert not any(clashes.values()), f"installed distributions shadowed by our packages: {clashes}"


def test_the_kernel_package_is_not_named_as_hugging_faces():
    """transformers imports `kernels` whenever that distribution is installed; no folder of ours may take the name."""
    assert "kernels" not in _top_level_packages()
    assert not (ROOT / "kernels").exists()
