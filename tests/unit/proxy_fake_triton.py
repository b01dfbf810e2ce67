"""A fake of the proxy's Triton client: scripted responses, recorded requests and tensors, recorded cancels."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype

from mstar_common.proxy.app import ProxySettings, ServedModel, create_app
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse, build_request

HANG = "hang"  # a script item: wait until cancelled


def decode_tensors(request) -> dict[str, tuple[str, list[int], Any]]:
    """ModelInferRequest -> {name: (datatype, shape, numpy array)} read back from raw_input_contents."""
    out = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        if tensor.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(tensor.datatype))
        out[tensor.name] = (tensor.datatype, list(tensor.shape), array.reshape(list(tensor.shape)))
    return out


def text_script(*pieces: str, finish: str = "stop", prompt_tokens: int = 5) -> list[Any]:
    """Responses carrying `pieces` (one token each), then the finish, then Triton's empty final response."""
    script: list[Any] = []
    for i, piece in enumerate(pieces):
        script.append(StreamResponse(text=piece, token_ids=[100 + i], prompt_tokens=prompt_tokens,
                                     completion_tokens=i + 1))
    script.append(StreamResponse(finish_reason=finish, prompt_tokens=prompt_tokens, completion_tokens=len(pieces)))
    script.append(StreamResponse(is_final=True))
    return script


@dataclass
class Recorded:
    model: str
    request_id: str
    gen: GenerationRequest
    tensors: dict[str, tuple[str, list[int], Any]]
    timeout_s: float | None


@dataclass
class FakeTriton:
    script: list[Any] = field(default_factory=lambda: text_script("Hello", ",", " world"))
    is_server_ready: bool = True
    requests: list[Recorded] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    started: asyncio.Event | None = None  # set once a request reaches HANG
    is_closed: bool = False

    async def generate(self, model: str, request_id: str, gen: GenerationRequest, timeout_s: float | None = None):
        self.requests.append(Recorded(model, request_id, gen, decode_tensors(build_request(model, request_id, gen)),
                                      timeout_s))
        is_complete = False
        try:
            for item in self.script:
                await asyncio.sleep(0)
                if isinstance(item, Exception):
                    is_complete = True
                    raise item
                if item == HANG:
                    if self.started is not None:
                        self.started.set()
                    await asyncio.Event().wait()
                yield item
                if item.is_final:
                    is_complete = True
                    return
        finally:
            if not is_complete:
                self.cancelled.append(request_id)

    async def is_ready(self, models: list[str]) -> bool:
        return self.is_server_ready

    async def close(self) -> None:
        self.is_closed = True


def make_app(fake: FakeTriton | None = None, **settings: Any):
    fake = fake or FakeTriton()
    models = settings.pop("models", [ServedModel("qwen3", "qwen3_llm")])
    app = create_app(ProxySettings(triton_url="fake:0", models=models, **settings), triton=fake)
    return app, fake
