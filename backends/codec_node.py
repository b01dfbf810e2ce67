"""Triton node for a codec component (decoupled; one step loop batches every pending request).

I/O contract: `codec_windows` INT32 [N, ...] in, `codec_audio` FP32 [N, S] out (mstar_common/wire.py). Callers
(a speech LM node, through BLS) send one request per step carrying that step's whole batch of windows;
every request gets exactly one response, flagged FINAL (an `invalid_request:` error for malformed input).

Threads: `execute` only enqueues. The step loop takes every pending request, decodes them as one batch
(the runtime slices it into CUDA-graph buckets on a GPU), splits the audio back per request and responds,
so requests from several LM instances share one decoder run.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.bls import release_stub_objects
from backends.node_setup import install_stack_dumps, load_node
from backends.responder import Responder
from mstar_common import wire
from mstar_common.devices import on_device
from mstar_common.gc_policy import settle_heap

logger = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        setup = load_node(args, kind="codec")
        self.model_name = setup.model_name
        self.codec = setup.build()  # decode(np [N, ...]) -> np [N, S]; check(np) raises ValueError
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._is_running = True
        self._thread = threading.Thread(target=on_device(self._loop, setup.device), name=f"{self.model_name}-step",
                                        daemon=True)
        self._thread.start()
        install_stack_dumps()
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready on %s", self.model_name, setup.device)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._queue.put(request)
        return None

    def finalize(self) -> None:
        self._is_running = False
        self._queue.put(None)
        self._thread.join(5)
        release_stub_objects()

    def _loop(self) -> None:
        while self._is_running:
            batch = [self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            requests = [r for r in batch if r is not None]
            if requests:
                self._step(requests)
        # stopped: what came after the last step is answered too (a speech LM's codec pump waits on each request)
        while not self._queue.empty():
            request = self._queue.get_nowait()
            if request is not None:
                Responder(request, request.request_id() or "codec").send_error(wire.SERVER_STOPPED)

    def _step(self, requests: list) -> None:
        accepted: list[tuple[Responder, np.ndarray]] = []
        for request in requests:
            responder = Responder(request, request.request_id() or "codec")
            try:
                windows = _windows(request)
                self.codec.check(windows)
            except ValueError as exc:
                responder.send_invalid(str(exc))
                continue
            accepted.append((responder, windows))
        if not accepted:
            return
        try:
            audio = self.codec.decode(np.concatenate([w for _, w in accepted]))
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
            for responder, _ in accepted:
                responder.send_server_error(exc)
            return
        offset = 0
        for responder, windows in accepted:
            part, offset = audio[offset:offset + len(windows)], offset + len(windows)
            responder.send_final({wire.CODEC_AUDIO: np.ascontiguousarray(part)})


def _windows(request) -> np.ndarray:
    tensor = pb_utils.get_input_tensor_by_name(request, wire.CODEC_WINDOWS)
    if tensor is None:
        raise ValueError(f"{wire.CODEC_WINDOWS}: required")
    return tensor.as_numpy()
