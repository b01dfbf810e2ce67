"""Run the Whisper walk in-process: the real walk script, encoder batcher and decoder engine, without Triton.

`call` submits to the encoder component; `call_stream` parses a decoder request exactly as the Triton node does
and feeds the engine's token callbacks into an async iterator. Every decoder stream's tokens are recorded (in
call order) so parity tests can compare them with transformers.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from mstar_common.cli import CONFIGS
from mstar_common.config import deployment_from_dict
from mstar_common.families.registry import get_family
from mstar_common.walk_api import ComponentError


def tiny_deployment(**overrides: Any):
    raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if name:
            raw.setdefault(section, {})[name] = value
        else:
            raw[key] = value
    return deployment_from_dict(raw, source="test-whisper")


class LocalWhisper:
    def __init__(self, checkpoint: Path, dep=None, device: str = "cpu") -> None:
        self.dep = dep or tiny_deployment()
        family = get_family("whisper")
        self.walk = family.build_component("walk", self.dep, checkpoint, "cpu")
        self.encoder = family.build_component("encoder", self.dep, checkpoint, device)
        self.decoder = family.build_component("decoder", self.dep, checkpoint, device)
        self.decoder_calls: list[dict[str, Any]] = []  # {"inputs", "tokens", "finish"} per decoder stream
        self._ids = itertools.count()

    def __enter__(self) -> LocalWhisper:
        self.encoder.engine.start()
        self.decoder.engine.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.encoder.engine.shutdown()
        self.decoder.engine.shutdown()

    async def transcribe(self, **inputs: Any) -> dict[str, Any]:
        outputs = await self.walk.run(_wire(inputs), self.call, self.call_stream)
        return {name: _plain(value) for name, value in outputs.items()}

    async def stream(self, **inputs: Any) -> list[dict[str, Any]]:
        return [{name: _plain(v) for name, v in out.items()}
                async for out in self.walk.stream(_wire(inputs), self.call, self.call_stream)]

    async def call(self, component: str, inputs: dict[str, Any]) -> dict[str, Any]:
        assert component == "encoder", component
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_done(outputs, error):
            loop.call_soon_threadsafe(_settle, future, outputs, error)

        tensors = {k: torch.as_tensor(np.asarray(v)) for k, v in inputs.items()}
        try:
            self.encoder.submit(f"enc-{next(self._ids)}", tensors, on_done)
        except ValueError as exc:
            raise ComponentError(component, f"invalid_request: {exc}") from None
        outputs = await future
        return {k: v.numpy() for k, v in outputs.items()}

    async def call_stream(self, component: str, inputs: dict[str, Any]):
        assert component == "decoder", component
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        record = {"inputs": inputs, "tokens": [], "finish": None}
        self.decoder_calls.append(record)
        try:
            request = self.decoder.parse_request({k: np.asarray(v) for k, v in inputs.items()})
        except ValueError as exc:
            raise ComponentError(component, f"invalid_request: {exc}") from None

        def on_output(request_id, tokens, finish, error):
            loop.call_soon_threadsafe(queue.put_nowait, (list(tokens), finish, error))

        self.decoder.engine.add_request(f"dec-{next(self._ids)}", request.prompt_ids, request.params, on_output,
                                        request_state=request.request_state)
        while True:
            tokens, finish, error = await queue.get()
            if error is not None:
                raise ComponentError(component, error)
            record["tokens"] += tokens
            out = {"token_ids": np.asarray(tokens, np.int32)}
            if finish is not None:
                record["finish"] = finish.value
                out["finish_reason"] = np.array([finish.value.encode()], dtype=object)
                out.update(self.decoder.final_outputs(request.request_state))  # as the node's last response
                record["scores"] = {name: float(out[name][0]) for name in ("avg_logprob", "no_speech_prob")}
            yield out
            if finish is not None:
                return


def _settle(future: asyncio.Future, outputs, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outputs)


def _wire(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in inputs.items():
        if isinstance(value, np.ndarray):
            out[name] = value
        elif isinstance(value, (bytes, str)):
            out[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=object)
        elif isinstance(value, bool):
            out[name] = np.array([value])
        elif isinstance(value, float):
            out[name] = np.array([value], np.float32)
        else:
            out[name] = np.array([value], np.int32 if name != "seed" else np.int64)
    return out


def _plain(value: np.ndarray) -> Any:
    item = np.asarray(value).reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else item.item()
