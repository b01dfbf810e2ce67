"""Run a family's walk in-process: every component built once and started, `call` submitting to its engine.

The same walk script and the same batching engines as under Triton, without the server or BLS. The tests use
it for whole-pipeline parity and the benchmark for an engine-only figure beside the served one.

    async with LocalWalk(family, dep, checkpoint, "cpu") as walk:
        outputs = await walk.run({"prompt": np.array([b"a cat"], dtype=object), ...})
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar_common.config import Deployment
from mstar_common.families.base import Family
from mstar_common.walk_api import ComponentError


class LocalWalk:
    def __init__(self, family: Family, dep: Deployment, checkpoint: Path, device: str = "cpu"):
        self.family = family
        routers = [c.name for c in family.graph.components.values() if c.kind == "walk_router"]
        if len(routers) != 1:
            raise ValueError(f"family {family.name!r} has {len(routers)} walk routers; LocalWalk needs one")
        self.walk = family.build_component(routers[0], dep, checkpoint, "cpu")
        self.components = {
            name: family.build_component(name, dep, checkpoint, device)
            for name, comp in family.graph.components.items() if comp.kind != "walk_router"
        }
        self._ids = itertools.count()
        self.timings: dict[str, list[float]] = defaultdict(list)  # component -> seconds per call (submit to done)

    def start(self) -> LocalWalk:
        for runtime in self.components.values():
            runtime.engine.start()
        return self

    def close(self) -> None:
        for runtime in self.components.values():
            runtime.engine.shutdown()

    async def __aenter__(self) -> LocalWalk:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return await self.walk.run(inputs, self.call)

    async def call(self, component: str, inputs: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(outputs: Any, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, outputs, error)

        tensors = {name: value if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
                   for name, value in inputs.items()}
        start = time.perf_counter()
        try:
            self.components[component].submit(f"local-{next(self._ids)}", tensors, on_done)
        except ValueError as exc:
            raise ComponentError(component, f"invalid_request: {exc}") from None
        try:
            return await future
        finally:
            self.timings[component].append(time.perf_counter() - start)


def _settle(future: asyncio.Future, outputs: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outputs)
