"""Triton node for a family's walk router: the entry model that runs the family's walk script with async BLS.

I/O contract: the walk component's tensors as the family declares them (flux2_klein: prompt, size, n, seed,
steps, reference images, output knobs in; encoded images and the seed out); one FINAL response per request.

Concurrency: `execute` is a coroutine; for a decoupled model the Python backend runs it in the background,
so one instance serves many requests at once. Each request runs `walk.run(inputs, call)`, where `call`
is one async BLS request to `<family>_<component>` that waits for that component's single response.
Refusals: a ValueError from the walk or an `invalid_request:` error from a component becomes the
request's `invalid_request:` error (HTTP 400); anything else is a server error with an id in the log.

Streaming walks (whisper): a walk with `stream(inputs, call, call_stream)` yields several responses; each is
sent as it comes, and the last one, a `LastResponse`, carries the FINAL flag. `call_stream` is a decoupled BLS
request whose responses arrive as an async iterator: Triton 2.51's response iterator blocks, so a thread per
stream reads it and hands each response to the event loop, which keeps serving the instance's other requests
meanwhile.
Clients that go away: the walk asks every WALK_CANCEL_POLL_S (and after each streamed response) whether its
client is still there. Once it is gone, Triton 2.51 cannot cancel the walk's BLS requests, so the walk posts
the ids of those in flight on the server's cancel board (mstar_common/walk_cancel.py); each component reads
that as a cancel and stops the work (a denoise job at its next step, a batched item before it runs, an LLM
row at its next step), and the walk itself is stopped and ends at once with a flags-only FINAL (what it was
waiting for, a window slot included, waits no more; no new hop is sent).

Deadlines: each component request carries the time the walk's client has left as its Triton timeout, so a
component stops the walk's work at the same deadline, with `deadline_exceeded:`.
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
from backends.metrics import ComponentMetrics
from backends.node_setup import load_node
from backends.responder import (
    Responder,
    client_request_id,
    deadline_s,
    request_inputs,
    tensor_value,
    to_pb_tensor,
    walk_board,
)
from mstar_common import wire
from mstar_common.config import env_switch
from mstar_common.gc_policy import settle_heap
from mstar_common.repository import model_name
from mstar_common.walk_api import ComponentError, LastResponse, QueueWaitExpired

logger = logging.getLogger(__name__)
TIMINGS = env_switch("MSTAR_TIMINGS", False)  # log each hop's and each walk's wall time (stateless_node.py)
WALK_CANCEL_POLL_S = 0.1  # how often a walk asks whether its client is still there (one IPC round trip)
REFUSAL_SETTLE_S = 0.005  # how long a refused request's execute() waits before it returns (see _serve)


@dataclass(frozen=True, slots=True)
class WalkLimits:
    running: int
    queued: int
    timeout_s: float | None

    @property
    def cap(self) -> int:
        return self.running + self.queued


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
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
        self.num_refused = self.num_expired = 0  # the walk's own 429s and deadlines, for its metrics
        labels = {"model": self.model_name, "instance": args["model_instance_name"], "device": "cpu"}
        self.metrics = ComponentMetrics(self, None, labels)
        self.metrics.start()
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready", self.model_name)

    def stats(self) -> dict:
        """What the metrics thread samples: the walks in progress (the walk queues none itself) and its refusals."""
        return {"num_running": self.in_flight, "num_refused": self.num_refused, "num_expired": self.num_expired}

    async def execute(self, requests: list) -> None:
        await asyncio.gather(*(self._serve(request) for request in requests))
        return None

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        self.metrics.stop()
        release_stub_objects()

    async def _serve(self, request) -> None:
        # the pid keeps hop ids unique across this model's instances (the cancel board is the server's)
        responder = Responder(request, f"{client_request_id(request) or 'req'}#{os.getpid()}.{next(self._ids)}")
        if self.in_flight >= self.limit.cap:
            self.num_refused += 1
            responder.send_error(wire.OVERLOADED_PREFIX + f"{self.in_flight} requests in {self.model_name} already, "
                                 f"its cap of {self.limit.running} running and {self.limit.queued} queued")
            # An execute() that ends before the stub has filed its future logs "Cannot remove future from
            # background; KeyError" at ERROR (Triton's python_backend registers the done-callback first:
            # triton-inference-server/server#8537); a refusal is that fast, so it ends a moment later.
            await asyncio.sleep(REFUSAL_SETTLE_S)
            return
        self.in_flight += 1
        try:
            await self._serve_admitted(request, responder, deadline_s(request, self.limit.timeout_s))
        finally:
            self.in_flight -= 1

    async def _serve_admitted(self, request, responder: Responder, timeout_s: float | None) -> None:
        started = time.perf_counter()
        hops = Hops(Budget(started, timeout_s))
        answered = False  # the walk returned its outputs (its hops in flight, if any, are still wanted)
        running: asyncio.Future | None = None

        def stop_the_walk() -> None:  # its client went: a walk waiting for anything (a window slot) waits no more
            if running is not None:
                running.cancel()

        watch = asyncio.ensure_future(watch_client(responder, hops, stop_the_walk))
        try:
            inputs = request_inputs(request, self.walk.input_names)
            if hasattr(self.walk, "stream"):
                work = self._stream(responder, inputs, hops)
            else:
                work = self.walk.run(inputs, self._caller(responder, Received(), hops))
            running = asyncio.ensure_future(asyncio.wait_for(work, timeout_s))
            outputs = await running
        except asyncio.CancelledError:
            if not hops.is_abandoned or asyncio.current_task().cancelling():
                raise  # the stub's own cancellation, not the watch's
            logger.info("[%s] client cancelled; its walk stopped", responder.request_id)
            responder.send_final()
        except TimeoutError as exc:
            if timeout_s is None or time.perf_counter() - started < timeout_s:  # the walk's own, not the deadline
                responder.send_server_error(exc)
            else:  # the components stop its work at the same deadline (Budget); the client is told now
                self.num_expired += 1
                logger.info("[%s] past its deadline of %g s", responder.request_id, timeout_s)
                responder.send_error(wire.DEADLINE_PREFIX + f"the request did not finish within {timeout_s:g} s")
        except ValueError as exc:
            responder.send_invalid(str(exc))
        except ComponentError as exc:
            if hops.is_abandoned or responder.is_cancelled():  # (the watch may not have seen the client go yet)
                logger.info("[%s] client cancelled; its walk stopped at %s", responder.request_id, exc.component)
                responder.send_final()
            elif wire.error_class(exc.message) is not None:  # the client's: refused, or past its deadline there
                self.num_refused += wire.error_class(exc.message) == wire.OVERLOADED_PREFIX  # a 429 the walk answers
                self.num_expired += isinstance(exc, QueueWaitExpired)  # the walk's own queue wait (a 503)
                responder.send_error(exc.message)
            else:
                logger.error("[%s] %s", responder.request_id, exc)
                responder.send_error(exc.message)  # the component logged the cause under this error id
        except Exception as exc:  # noqa: BLE001 - a fault in one walk must not take down the router
            if hops.is_abandoned or responder.is_cancelled():
                # its client went first: a hop the board stopped ends without its output, which a walk may then
                # trip over (whisper's language, never detected), and no one is left to tell
                logger.info("[%s] client cancelled; its walk stopped (%s: %s)", responder.request_id,
                            type(exc).__name__, exc)
                responder.send_final()
            else:
                responder.send_server_error(exc)
        else:
            answered = True
            responder.send_final(outputs)
        finally:
            watch.cancel()
            # A walk that ended without its answer (an error, its deadline, its client gone) leaves its other hops
            # running shielded (send_hop): whisper's sibling windows decoded to their ends for nobody, holding
            # decoder and cross-KV slots. The board stops them as for a client gone (none live: nothing posted).
            if not answered:
                hops.abandon()
        if TIMINGS:
            logger.info("[%s] timing walk: %.1f ms", responder.request_id, (time.perf_counter() - started) * 1e3)

    async def _stream(self, responder: Responder, inputs: dict, hops: Hops) -> dict[str, np.ndarray] | None:
        """Send each response of a streaming walk as it is yielded, but its `LastResponse`, which is returned (the
        FINAL); None when the client went away or the walk marked no last one (a flags-only FINAL then ends the
        request). (Holding each response until the next, to flag the last, held whisper's text deltas: a window's
        last delta waited for the next window's first, which may wait for a window slot.)"""
        last = None
        received = Received()
        stream = self.walk.stream(inputs, self._caller(responder, received, hops),
                                  self._stream_caller(responder, received, hops))
        try:
            async for outputs in stream:
                if isinstance(outputs, LastResponse):
                    last = outputs
                else:
                    responder.send_chunk(outputs)
                if hops.is_abandoned or responder.is_cancelled():
                    logger.info("[%s] client cancelled; stopping its walk", responder.request_id)
                    hops.abandon()
                    return None
        finally:
            await stream.aclose()
        return last

    def _stream_caller(self, responder: Responder, received: Received, hops: Hops):
        loop = asyncio.get_running_loop()

        async def call_stream(component: str, inputs: dict):
            spec = self.components[component]
            hop_id, responses = await self._send(component, inputs, responder, received, hops)
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
                    hops.ended(hop_id)  # the component's stream is over: off the board
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

    async def _send(self, component: str, inputs: dict, responder: Responder, received: Received, hops: Hops):
        """One decoupled BLS request to `component` with the walk's time left as its timeout: (its hop id, its
        response iterator). No request is sent once the walk is abandoned or its client gone: whisper's windows kept
        opening decoder streams after their client left (their streaming hops had no check), each one prefilled
        and decoded until the cancel poll saw it."""
        if hops.is_abandoned or responder.is_cancelled():
            raise ComponentError(component, "cancelled: the client went away, or the walk ended without its answer")
        hop_id = hops.new_id(responder.request_id, component)
        request = pb_utils.InferenceRequest(
            model_name=model_name(self.family, component),
            inputs=[received.tensor(name, value) for name, value in inputs.items()],
            requested_output_names=[out.name for out in self.components[component].outputs],
            request_id=hop_id,
            **hops.budget.timeout(),
            **cpu_output_memory(),
        )
        return hop_id, await send_hop(request, hops, hop_id)

    def _caller(self, responder: Responder, received: Received, hops: Hops):
        async def call(component: str, inputs: dict) -> dict[str, np.ndarray]:
            spec = self.components[component]
            started = time.perf_counter()
            outputs: dict[str, np.ndarray] = {}
            hop_id, responses = await self._send(component, inputs, responder, received, hops)
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
                hops.ended(hop_id)
            if not outputs:
                raise ComponentError(component, f"{component} answered without outputs")
            if TIMINGS:
                logger.info("[%s] timing hop %s: %.1f ms", responder.request_id, component,
                            (time.perf_counter() - started) * 1e3)
            return outputs

        return call


@dataclass(frozen=True, slots=True)
class Budget:
    """A walk's deadline (`timeout_s` after `started`, a perf_counter time; None: none), handed on to each of
    its component requests as the Triton timeout they have left."""

    started: float
    timeout_s: float | None

    def timeout(self) -> dict[str, int]:
        """The BLS request's `timeout` keyword (microseconds, at least 1; 0 is Triton's "none"), or nothing."""
        if self.timeout_s is None:
            return {}
        left_s = self.timeout_s - (time.perf_counter() - self.started)
        return {"timeout": max(1, int(left_s * 1e6))}


class Hops:
    """A walk's component requests in flight (their ids) and its Budget. Once its client has gone (`abandon`),
    each is on the server's cancel board until it ends (mstar_common/walk_cancel.py). A stream's hop ends on its
    reader thread, hence the lock."""

    __slots__ = ("budget", "_live", "_lock", "is_abandoned", "_count")

    def __init__(self, budget: Budget):
        self.budget = budget
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self.is_abandoned = False
        self._count = itertools.count()

    def new_id(self, walk_id: str, component: str) -> str:
        """A hop's request id, unique within the walk (whisper opens a decoder stream per window)."""
        return f"{walk_id}/{component}.{next(self._count)}"

    def opened(self, hop_id: str) -> None:
        with self._lock:
            self._live.add(hop_id)
            if self.is_abandoned:
                walk_board().post(hop_id)

    def ended(self, hop_id: str) -> None:
        with self._lock:
            self._live.discard(hop_id)
            if self.is_abandoned:
                walk_board().clear(hop_id)

    def abandon(self) -> None:
        with self._lock:
            if self.is_abandoned:
                return
            self.is_abandoned = True
            for hop_id in self._live:
                walk_board().post(hop_id)


async def send_hop(request, hops: Hops, hop_id: str):
    """Send one component request (a BLS request, decoupled) and return its response iterator.

    A walk that stops waiting while the request is in flight (its deadline, its client gone, a sibling's error:
    the task awaiting here is cancelled) must still take the request's responses: in Triton 2.51 a BLS request
    whose `async_exec` was abandoned before it answered keeps the calling model loaded at shutdown (the server
    then waits its whole exit timeout; found with a whisper upload cancelled mid-walk, every run of three). So the
    request runs on, shielded, and a thread reads its responses to their end and holds them (backends/bls.py)."""
    hops.opened(hop_id)
    sent = asyncio.ensure_future(request.async_exec(decoupled=True))
    try:
        return await asyncio.shield(sent)
    except asyncio.CancelledError:
        sent.add_done_callback(lambda _: threading.Thread(target=_drain, args=(sent, hops, hop_id),
                                                          name=f"drain {hop_id}", daemon=True).start())
        raise
    except BaseException:
        hops.ended(hop_id)
        raise


def _drain(sent: asyncio.Future, hops: Hops, hop_id: str) -> None:
    try:
        if not sent.cancelled() and sent.exception() is None:
            responses = sent.result()
            for _ in responses:
                pass
            KEEPER.hold(responses)
    except Exception:  # noqa: BLE001 - nothing waits for it any more
        logger.exception("reading the abandoned %s failed", hop_id)
    finally:
        hops.ended(hop_id)


async def watch_client(responder: Responder, hops: Hops, on_gone=None) -> None:
    """Until cancelled (the walk's end): once the walk's client has gone, its hops in flight are abandoned and
    `on_gone()` stops the walk itself (one parked on a window slot held its place until a slot freed)."""
    while not hops.is_abandoned:
        await asyncio.sleep(WALK_CANCEL_POLL_S)
        if responder.is_cancelled():
            logger.info("[%s] client cancelled; its component requests in flight are cancelled",
                        responder.request_id)
            hops.abandon()
            if on_gone is not None:
                on_gone()


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
