"""Triton node for a family's walk router: the entry model that runs the family's walk script with async BLS.

I/O contract: the walk component's tensors as the family declares them (flux2_klein: prompt, size, n, seed,
steps, reference images, output knobs in; encoded images and the seed out); one FINAL response per request.

Concurrency: `execute` is a coroutine; for a decoupled model the Python backend runs it in the background,
so one instance serves many requests at once. Each request runs `walk.run(inputs, call)`, where `call`
is one async BLS request to `<family>_<component>` that waits for that component's single response.
Refusals: a ValueError from the walk or an `invalid_request:` error from a component becomes the
request's `invalid_request:` error (HTTP 400); anything else is a server error with an id in the log.

Streaming walks (whisper): a walk with `stream(inputs, call, call_stream)` yields several responses; each is
sent as it comes and the last one carries the FINAL flag. `call_stream` is a decoupled BLS request whose
responses arrive as an async iterator: Triton 2.51's response iterator blocks, so a thread per stream reads
it and hands each response to the event loop, which keeps serving the instance's other requests meanwhile.
A client that goes away stops its walk at the next response (BLS requests cannot be cancelled in 2.51:
a component stream already started runs to its end, its responses discarded).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.bls import KEEPER, cpu_output_memory, release_stub_objects
from backends.node_setup import load_node
from backends.responder import Responder, request_inputs, request_timeout_s, tensor_value, to_pb_tensor
from mstar_common import wire
from mstar_common.gc_policy import settle_heap
from mstar_common.repository import model_name
from mstar_common.walk_api import ComponentError

logger = logging.getLogger(__name__)
TIMINGS = os.environ.get("MSTAR_TIMINGS") == "1"  # log each hop's and each walk's wall time (stateless_node.py)


@dataclass(frozen=True, slots=True)
class WalkLimits:
    running: int
    queued: int
    timeout_s: float | None

    @property
    def cap(self) -> int:
        return self.running + self.queued


def deadline_s(request, ceiling_s: float | None) -> float | None:
    """The request's Triton timeout in seconds, at most `ceiling_s` (either may be None: none)."""
    return min((t for t in (request_timeout_s(request), ceiling_s) if t is not None), default=None)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        setup = load_node(args, kind="walk_router")
        self.model_name = setup.model_name
        self.family = setup.deployment.family
        self.components = setup.family.graph.components
        self.walk = setup.build()  # .input_names; async .run(inputs, call) -> outputs
        self._ids = itertools.count()
        dep = setup.deployment
        # The walk's own admission and deadline (its components may queue without bound, e.g. the denoise engine):
        # past `max_concurrent_requests` + `admission.max_queue` walks in this instance a request is refused at
        # once (the proxy's 429), and a request past its deadline (the client's Triton timeout, at most
        # `admission.request_timeout_s`) ends with deadline_exceeded (504).
        cap = dep.max_concurrent_requests
        self.limit = WalkLimits(cap, dep.admission.resolved_max_queue(cap), dep.admission.request_timeout_s)
        self.in_flight = 0
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready", self.model_name)

    async def execute(self, requests: list) -> None:
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        release_stub_objects()

    async def _serve(self, request) -> None:
        responder = Responder(request, f"{request.request_id() or 'req'}#{next(self._ids)}")
        if self.in_flight >= self.limit.cap:
            responder.send_error(wire.OVERLOADED_PREFIX + f"{self.in_flight} requests in {self.model_name} already, "
                                 f"its cap of {self.limit.running} running and {self.limit.queued} queued")
            return
        self.in_flight += 1
        try:
            await self._serve_admitted(request, responder, deadline_s(request, self.limit.timeout_s))
        finally:
            self.in_flight -= 1

    async def _serve_admitted(self, request, responder: Responder, timeout_s: float | None) -> None:
        started = time.perf_counter()
        try:
            inputs = request_inputs(request, self.walk.input_names)
            if hasattr(self.walk, "stream"):
                work = self._stream(responder, inputs)
            else:
                work = self.walk.run(inputs, self._caller(responder, Received()))
            outputs = await asyncio.wait_for(work, timeout_s)
        except TimeoutError as exc:
            if timeout_s is None or time.perf_counter() - started < timeout_s:  # the walk's own, not the deadline
                responder.send_server_error(exc)
            else:  # its component requests run on (BLS requests cannot be cancelled in 2.51); the client is told now
                logger.info("[%s] past its deadline of %g s", responder.request_id, timeout_s)
                responder.send_error(wire.DEADLINE_PREFIX + f"the request did not finish within {timeout_s:g} s")
        except ValueError as exc:
            responder.send_invalid(str(exc))
        except ComponentError as exc:
            if exc.is_invalid_request:
                responder.send_error(exc.message)
            else:
                logger.error("[%s] %s", responder.request_id, exc)
                responder.send_error(exc.message)  # the component logged the cause under this error id
        except Exception as exc:  # noqa: BLE001 - a fault in one walk must not take down the router
            responder.send_server_error(exc)
        else:
            responder.send_final(outputs)
        if TIMINGS:
            logger.info("[%s] timing walk: %.1f ms", responder.request_id, (time.perf_counter() - started) * 1e3)

    async def _stream(self, responder: Responder, inputs: dict) -> dict[str, np.ndarray] | None:
        """Send every response of a streaming walk but the last, which is returned (the FINAL); None when
        the client went away (a flags-only FINAL then ends the request)."""
        last = None
        received = Received()
        stream = self.walk.stream(inputs, self._caller(responder, received), self._stream_caller(responder, received))
        try:
            async for outputs in stream:
                if last is not None:
                    responder.send_chunk(last)
                last = outputs
                if responder.is_cancelled():
                    logger.info("[%s] client cancelled; stopping its walk", responder.request_id)
                    return None
        finally:
            await stream.aclose()
        return last

    def _stream_caller(self, responder: Responder, received: Received):
        loop = asyncio.get_running_loop()

        async def call_stream(component: str, inputs: dict):
            spec = self.components[component]
            request = pb_utils.InferenceRequest(
                model_name=model_name(self.family, component),
                inputs=[received.tensor(name, value) for name, value in inputs.items()],
                requested_output_names=[out.name for out in spec.outputs],
                request_id=f"{responder.request_id}/{component}",
                **cpu_output_memory(),
            )
            responses = await request.async_exec(decoupled=True)
            queue: asyncio.Queue = asyncio.Queue()
            is_abandoned = threading.Event()

            def read() -> None:  # the iterator blocks: read it here, off the event loop, always to its end
                try:
                    for response in responses:
                        if not is_abandoned.is_set():
                            loop.call_soon_threadsafe(queue.put_nowait, response)
                except Exception as exc:  # noqa: BLE001 - delivered to the walk
                    loop.call_soon_threadsafe(queue.put_nowait, exc)
                finally:
                    KEEPER.hold(responses)  # backends/bls.py: the stub must not free it off the GIL
                    loop.call_soon_threadsafe(queue.put_nowait, None)

            threading.Thread(target=read, name=f"{responder.request_id}/{component}", daemon=True).start()
            try:
                while (response := await queue.get()) is not None:
                    if isinstance(response, Exception):
                        raise ComponentError(component, f"reading the stream failed: {response}")
                    if response.has_error():
                        raise ComponentError(component, response.error().message())
                    outputs = {}
                    for out in spec.outputs:
                        tensor = pb_utils.get_output_tensor_by_name(response, out.name)
                        if tensor is not None:
                            outputs[out.name] = received.add(tensor)
                    if outputs:
                        yield outputs
            finally:
                is_abandoned.set()
                if hasattr(responses, "cancel"):  # Triton >= 2.57 can cancel a BLS stream
                    responses.cancel()

        return call_stream

    def _caller(self, responder: Responder, received: Received):
        async def call(component: str, inputs: dict) -> dict[str, np.ndarray]:
            if responder.is_cancelled():
                raise ComponentError(component, "cancelled: the client went away")
            spec = self.components[component]
            started = time.perf_counter()
            request = pb_utils.InferenceRequest(
                model_name=model_name(self.family, component),
                inputs=[received.tensor(name, value) for name, value in inputs.items()],
                requested_output_names=[out.name for out in spec.outputs],
                request_id=f"{responder.request_id}/{component}",
                **cpu_output_memory(),
            )
            outputs: dict[str, np.ndarray] = {}
            responses = await request.async_exec(decoupled=True)
            try:
                for response in responses:
                    if response.has_error():
                        raise ComponentError(component, response.error().message())
                    for out in spec.outputs:
                        tensor = pb_utils.get_output_tensor_by_name(response, out.name)
                        if tensor is not None:
                            outputs[out.name] = received.add(tensor)
            finally:
                KEEPER.hold(responses)  # backends/bls.py: the stub must not free it off the GIL
            if not outputs:
                raise ComponentError(component, f"{component} answered without outputs")
            if TIMINGS:
                logger.info("[%s] timing hop %s: %.1f ms", responder.request_id, component,
                            (time.perf_counter() - started) * 1e3)
            return outputs

        return call


class Received:
    """The component outputs a walk still holds, kept with the Triton tensors they came in.

    A walk that passes an output on unchanged, under the same name (the text encoder's prompt_embeds into the
    denoise hop), sends the received tensor itself: its shared memory goes to the next component as it is, with
    no copy in this stub (15.7 MB of fp32 embeddings per FLUX.2 request, half that in bf16). Anything else (a new
    array, a slice, another name) is copied into a new tensor as before. An entry lives as long as the walk
    holds its value (a weak reference), so a long streaming walk keeps nothing it dropped. Received numpy arrays
    are read-only: they are the stub's copy, so a change made in place would not travel with the forwarded
    tensor; a walk that needs to change one copies it first."""

    __slots__ = ("_tensors",)

    def __init__(self) -> None:
        self._tensors: dict[int, tuple[weakref.ref, pb_utils.Tensor]] = {}

    def add(self, tensor: pb_utils.Tensor):
        value = tensor_value(tensor)
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
        key = id(value)
        # The callback runs before the value is freed, so its id cannot be reused while the entry exists.
        self._tensors[key] = (weakref.ref(value, lambda _, key=key: self._tensors.pop(key, None)), tensor)
        return value

    def tensor(self, name: str, value) -> pb_utils.Tensor:
        kept = self._tensors.get(id(value))
        if kept is not None and kept[0]() is value and kept[1].name() == name:
            return kept[1]
        return to_pb_tensor(name, value)
