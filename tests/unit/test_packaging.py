"""pyproject.toml's lower bounds cover the APIs the code calls: CI installs the newest allowed versions, so a bound
left below an API's first release is never caught there, and a user's older install fails at run time."""

import re
import tomllib
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# package -> (the lowest version with what the code uses, what that is)
NEEDED = {
    "torch": ("2.6", "sdpa_kernel(backends, set_priority) in the DiT attention"),
    "transformers": ("5.0", "WhisperTokenizer(vocab=, merges=) and LlamaConfig(rope_parameters=) in the builders"),
    "starlette": ("0.44", "Request.form(max_part_size=) in every multipart route"),
    "pydantic": ("2", "field_validator/model_validator in the proxy's request models"),
    "uvicorn": ("0.51", "Multiprocess(config, sockets=) for the multi-worker proxy"),
    "python-multipart": ("0.0.18", "the floor of Starlette's form parser"),
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _lower_bounds() -> dict[str, str]:
    bounds = {}
    for spec in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]:
        if match := re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(?:>=|==)\s*([0-9.]+)", spec):
            bounds[match.group(1).lower()] = match.group(2)
    return bounds


@pytest.mark.parametrize("package", sorted(NEEDED))
def test_each_dependencys_lower_bound_has_the_api_the_code_calls(package):
    lowest, why = NEEDED[package]
    bounds = _lower_bounds()
    assert package in bounds, f"{package} is imported by the code ({why}) but not a declared dependency"
    assert _version(bounds[package]) >= _version(lowest), f"{package}>={bounds[package]} allows a version without {why}"
