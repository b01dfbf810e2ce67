#!/usr/bin/env python
"""A diffusers wheel cut to what the image benchmarks import, so that it fits the device call's carry limit.

    pip download --no-deps -d /tmp/whl diffusers==0.42.1
    python scripts/trim_diffusers_wheel.py /tmp/whl/diffusers-0.42.1-py3-none-any.whl .whl/

The device's Python lacks diffusers, and a device call carries at most 64 MiB with the working tree and `.device/`
(~49 MiB): the 6.4 MB wheel did not fit, its 2.0 MB cut (2.2 MB by hand, the first time) does. This drops the
pipelines, modular pipelines, ControlNets and schedulers the FLUX.2 and Z-Image benchmarks do not use, then puts
back each module that the imports below still need (diffusers' package `__init__`s load some submodules eagerly),
until they import, and writes the wheel with its RECORD cut to the files kept. Checked here:
tests/unit/test_flux2_parity.py, test_z_image_parity.py, test_bench_flux2.py and test_diffusion_engines.py pass
with it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

KEEP_PIPELINES = {"flux2", "z_image"}
KEEP_SCHEDULERS = re.compile(r"__init__|scheduling_utils|flow_match")
CHECK = """
import diffusers
from diffusers import (AutoencoderKL, AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                       Flux2Transformer2DModel, ZImagePipeline, ZImageTransformer2DModel)
import diffusers.loaders.single_file_model, diffusers.pipelines.flux2.pipeline_flux2_klein
import diffusers.pipelines.z_image.pipeline_z_image
"""


def trim(tree: Path) -> None:
    package = tree / "diffusers"
    for folder in [*(package / "pipelines").iterdir(), *(package / "modular_pipelines").iterdir()]:
        if folder.is_dir() and folder.name not in KEEP_PIPELINES and folder.name != "__pycache__":
            shutil.rmtree(folder)
    shutil.rmtree(package / "models" / "controlnets", ignore_errors=True)
    for path in (package / "schedulers").iterdir():
        if path.is_file() and not KEEP_SCHEDULERS.search(path.name):
            path.unlink()


def restore_until_it_imports(tree: Path, original: Path, python: str) -> list[str]:
    restored = []
    for _ in range(200):
        done = subprocess.run([python, "-c", CHECK], env={**os.environ, "PYTHONPATH": str(tree)},
                              capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return restored
        missing = re.findall(r"No module named '(diffusers[\w.]*)'", done.stderr)
        if not missing:
            raise RuntimeError(f"the trimmed diffusers does not import:\n{done.stderr[-3000:]}")
        relative = Path(*missing[-1].split("."))
        source = original / relative
        if source.is_dir():
            shutil.copytree(source, tree / relative)
        elif source.with_suffix(".py").is_file():
            shutil.copy2(source.with_suffix(".py"), (tree / relative).with_suffix(".py"))
        else:
            raise RuntimeError(f"{missing[-1]} is not in the original wheel either")
        restored.append(missing[-1])
    raise RuntimeError("gave up after 200 modules put back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--python", default=sys.executable, help="the interpreter (with torch) that checks imports")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        original, tree = Path(tmp) / "original", Path(tmp) / "tree"
        for folder in (original, tree):
            with zipfile.ZipFile(args.wheel) as wheel:
                wheel.extractall(folder)
        trim(tree)
        restored = restore_until_it_imports(tree, original, args.python)
        [record] = tree.glob("diffusers-*.dist-info/RECORD")
        lines = record.read_text().splitlines()
        record.write_text("".join(f"{line}\n" for line in lines if (tree / line.split(",")[0]).exists()))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        out = args.out_dir / args.wheel.name
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as wheel:
            for path in sorted(p for p in tree.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
                wheel.write(path, path.relative_to(tree))
    print(f"{out}: {out.stat().st_size / 1e6:.2f} MB ({args.wheel.stat().st_size / 1e6:.2f} MB before); "
          f"put back: {', '.join(restored) or 'nothing'}")


if __name__ == "__main__":
    main()
