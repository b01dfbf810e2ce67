"""Triton node for a stateless component (text encoder, VAE encode, VAE decode): decoupled, batched.

I/O contract: the component's tensors as its family declares them (e.g. flux2_klein/graph.py); one FINAL
response per request carrying its outputs, or an `invalid_request:` error for input the component refuses.

Threads: `execute` parses each request (a ValueError is refused at once) and hands it to the runtime's engine;
the engine's loop (one background thread) batches every waiting request of the same shapes into one
forward and calls back per request, and the callback sends the response through backends/responder.py.
A request cancelled before its batch runs is dropped unrun; so is one past its deadline (the request's Triton
timeout, which the walk router sets to the time its client has left, at most the deployment's
`admission.request_timeout_s`, which is also the deadline of a call with none), answered `deadline_exceeded:` and
counted in `mstar_requests_expired_total`. With `MSTAR_TIMINGS=1` each request's time from arrival to its response
being sent is logged (with the walk router's per-hop times: where a walk's time goes).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from backends.bls import release_stub_objects
from backends.metrics import ComponentMetrics
from backends.node_setup import load_node
from backends.responder import Responder, client_request_id, deadline_s, request_inputs
from mstar_common import wire
from mstar_common.config import env_switch
from mstar_common.diffusion.batcher import Cancelled, Expired, ShuttingDown, StopCheck
from mstar_common.gc_policy import settle_heap
from mstar_common.graph import MODEL_DTYPE

logger = logging.getLogger(__name__)
WIRE_TORCH_DTYPES = {"FP32": torch.float32, "BF16": torch.bfloat16, "FP16": torch.float16}  # Family.wire_dtype
TIMINGS = env_switch("MSTAR_TIMINGS", False)


class ComponentNode:
    KIND = "stateless"

    def initialize(self, args: dict) -> None:
        setup = load_node(args, kind=self.KIND)
        self.model_name = setup.model_name
        self.input_names = [spec.name for spec in setup.component.inputs]
        self.wire_dtypes = wire_dtypes(setup)  # MODEL_DTYPE outputs -> the torch dtype they are sent in
        # a request's deadline: its Triton timeout (a walk's hop carries the time its client has left), at most the
        # deployment's, which also stands in for none (a direct call had no deadline at all)
        self.request_timeout_s = setup.deployment.admission.request_timeout_s
        self.runtime = setup.build()  # .submit(request_id, inputs, on_done, is_cancelled); .engine
        self.runtime.engine.start()
        self._ids = itertools.count()
        labels = {"model": self.model_name, "instance": args["model_instance_name"], "device": setup.device}
        self.metrics = ComponentMetrics(self.runtime.engine, None, labels)  # steps, running, waiting
        self.metrics.start()
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready on %s", self.model_name, setup.device)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        self.metrics.stop()
        self.runtime.engine.shutdown()
        release_stub_objects()

    def _submit(self, request) -> None:
        responder = Responder(request, f"{client_request_id(request) or 'req'}#{next(self._ids)}")
        try:
            inputs = {name: value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
                      for name, value in request_inputs(request, self.input_names).items()}
            on_done = _on_done(responder, self.wire_dtypes, self.model_name if TIMINGS else None)
            stop = StopCheck(responder.is_cancelled, deadline_s(request, self.request_timeout_s))
            self.runtime.submit(responder.request_id, inputs, on_done, stop)
        except ValueError as exc:
            responder.send_invalid(str(exc))
        except Exception as exc:  # noqa: BLE001 - a fault in one request must not take down the node
            responder.send_server_error(exc)


def wire_dtypes(setup) -> dict[str, torch.dtype]:
    """The component's MODEL_DTYPE outputs and the torch dtype the deployment sends them in."""
    dtype = WIRE_TORCH_DTYPES[setup.family.wire_dtype(setup.deployment)]
    return {spec.name: dtype for spec in setup.component.outputs if spec.dtype == MODEL_DTYPE}


def _on_done(responder: Responder, dtypes: dict[str, torch.dtype], timed_as: str | None = None):
    started = time.perf_counter()

    def on_done(outputs: dict[str, torch.Tensor] | None, error: BaseException | None) -> None:
        if isinstance(error, Expired):
            responder.send_error(wire.DEADLINE_PREFIX + str(error))
        elif isinstance(error, ShuttingDown):  # a 503 the client may retry, as a text component's stop is
            responder.send_error(wire.SERVER_STOPPED)
        elif isinstance(error, Cancelled):
            responder.send_error(f"cancelled: {error}")
        elif error is not None:
            responder.send_server_error(error)
        else:
            # activations in the wire dtype; responder.to_pb_tensor sends bfloat16 through DLPack
            responder.send_final({name: t.to(dtypes[name]) if name in dtypes else t for name, t in outputs.items()})
        if timed_as:
            logger.info("[%s] timing %s: %.1f ms from arrival to response sent", responder.request_id, timed_as,
                        (time.perf_counter() - started) * 1e3)

    return on_done


class TritonPythonModel(ComponentNode):
    pass
