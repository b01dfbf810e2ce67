"""The only place that calls `response_sender.send`: every request ends with exactly one FINAL.

A Responder wraps one request's response sender. `send_chunk` streams outputs, `send_final` ends the
request (with or without outputs) and `send_error` ends it with an error; after the FINAL every further
call is a no-op, so racing paths (a stop string found while the engine reports a cancel) cannot send
twice or send after the end.

Two threads reach one Responder: `execute` (a refusal's error) and the output pump (chunks, the FINAL, the
cancellation polls). A lock makes "is it still open?" and the call to the sender one step, so that no thread
asks the sender anything after another has sent the FINAL. Triton's Python backend answers `is_cancelled()` by
reading the request's response factory, by its address, in the server process; after the FINAL that factory may
be freed, and a stub whose query gets no answer waits for it forever. A hung stub seen once after a burst of
refusals and cancellations (docs/reliability.md) fits that race; its stacks were not captured to confirm it.

A request from a walk (its id `<walk id>/<component>`) is also cancelled once the walk posts it on the cancel
board, when the walk's own client has gone (mstar_common/walk_cancel.py; a BLS request cannot be cancelled in
Triton 2.51).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from mstar_common import wire
from mstar_common.walk_cancel import CancelBoard, is_hop_id

logger = logging.getLogger(__name__)


class Responder:
    """`_wanted`: the outputs the client asked for (Triton's requested outputs; a client that names none asks for
    all). Triton drops the others after the backend has sent them, so they are never built: each output is a
    tensor copied into the backend's shared memory, under the GIL that the step loop needs, on every response."""

    __slots__ = ("_sender", "_request", "_wanted", "_lock", "is_closed", "request_id", "_hop_id")

    def __init__(self, request, request_id: str):
        self._request = request
        hop_id = request.request_id() or ""
        self._hop_id = hop_id if is_hop_id(hop_id) else None  # a walk's component request: ask the board too
        self._sender = request.get_response_sender()
        self._wanted = frozenset(request.requested_output_names())
        self._lock = threading.Lock()  # "still open?" and the sender's call as one step (module docstring)
        self.request_id = request_id
        self.is_closed = False

    def send_chunk(self, outputs: dict[str, np.ndarray]) -> None:
        response = _response(outputs, self._wanted)
        with self._lock:
            if not self.is_closed:
                self._send(response, 0)

    def send_final(self, outputs: dict[str, np.ndarray] | None = None) -> None:
        response = _response(outputs, self._wanted) if outputs else None
        with self._lock:
            if self.is_closed:
                return
            self.is_closed = True
            self._send(response, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_error(self, message: str) -> None:
        # TritonError takes a std::string: a message quoting a client's lone surrogate raised out of execute()
        error = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(wire.encodable(message)))
        with self._lock:
            if self.is_closed:
                return
            self.is_closed = True
            self._send(error, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def send_invalid(self, detail: str) -> None:
        """The client's fault: the proxy turns this prefix into an HTTP 400."""
        logger.info("[%s] refused: %s", self.request_id, wire.loggable(detail))
        self.send_error(wire.invalid_request_message(detail))

    def send_server_error(self, exc: BaseException | str) -> str:
        """A server fault: log the cause under an error id and send the client only the id."""
        error_id = uuid.uuid4().hex[:12]
        logger.error("[%s] error id %s: %s", self.request_id, error_id, exc, exc_info=isinstance(exc, BaseException))
        self.send_error(f"{wire.SERVER_ERROR_PREFIX}{error_id})")
        return error_id

    def is_cancelled(self) -> bool:
        """Whether the client went away; True once the FINAL is sent (the sender is not asked then)."""
        with self._lock:
            if self.is_closed:
                return True
            if self._hop_id is not None and walk_board().is_posted(self._hop_id):
                return True
            try:
                return bool(self._sender.is_cancelled())
            except Exception:  # the stub raises once the request is gone
                return True

    def _send(self, response, flags: int) -> None:
        try:
            if response is None:
                self._sender.send(flags=flags)
            else:
                self._sender.send(response, flags=flags)
        except Exception as exc:  # a cancelled or released request; nothing else can be sent to it
            self.is_closed = True
            logger.debug("[%s] send failed: %s", self.request_id, exc)


_BOARD: CancelBoard | None = None


def walk_board() -> CancelBoard:
    """This server's walk cancel board (made on first use: a stub's parent is its server)."""
    global _BOARD
    if _BOARD is None:
        _BOARD = CancelBoard()
    return _BOARD


def _response(outputs: dict[str, np.ndarray | torch.Tensor], wanted: frozenset[str] = frozenset()):
    """A response with the `outputs` the client asked for (`wanted`; all of them where it is empty)."""
    return pb_utils.InferenceResponse(output_tensors=[to_pb_tensor(k, v) for k, v in outputs.items()
                                                      if not wanted or k in wanted])


def to_pb_tensor(name: str, value: np.ndarray | torch.Tensor) -> pb_utils.Tensor:
    """A numpy array, or a CPU torch tensor (bfloat16 ones travel through DLPack), as a Triton tensor."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            return pb_utils.Tensor.from_dlpack(name, value)
        value = value.numpy()
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def tensor_value(tensor: pb_utils.Tensor) -> np.ndarray | torch.Tensor:
    """A received tensor's values: a numpy array, or for BF16 a CPU torch tensor.

    Neither copies again: the stub already copied a numeric tensor into the array `as_numpy` returns (pybind11
    copies an array made from a pointer without a base), and a BF16 tensor's DLPack view holds a reference to
    the Triton tensor that owns its shared memory."""
    try:
        return tensor.as_numpy()
    except Exception:  # noqa: BLE001 - BF16, which as_numpy refuses (the 2.51 stub cannot return triton_dtype())
        return torch.from_dlpack(tensor.to_dlpack())


def request_inputs(request, names) -> dict[str, np.ndarray | torch.Tensor]:
    """The request's tensors among `names` (`tensor_value`); absent optional inputs are left out. A request
    parameter is refused (ValueError naming it): every knob is an input tensor, so a parameter (or a field of
    Triton's HTTP generate body that names no input) would otherwise be dropped without a word."""
    check_no_parameters(request)
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor_value(tensor)
    return inputs


# request parameters that are Triton's own, not the model's: its reserved names (the parameters extension) and the
# `id` of its HTTP generate body, which reach the model as parameters
TRITON_PARAMETERS = frozenset({"id", "priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                               "headers"})


def request_parameters(request) -> dict:
    """The request's parameters ({} where the stub has none or they cannot be read)."""
    try:
        text = request.parameters()
        params = json.loads(text) if text else {}
    except Exception:  # noqa: BLE001 - a stub without parameters(): none
        return {}
    return params if isinstance(params, dict) else {}


def check_no_parameters(request) -> None:
    """ValueError naming the first request parameter that is not Triton's own (`TRITON_PARAMETERS`, `triton_...`)."""
    params = request_parameters(request)
    if unknown := sorted(key for key in params if not key.startswith("triton_") and key not in TRITON_PARAMETERS):
        raise ValueError(f"parameters.{wire.loggable(unknown[0], 64)}: unknown request parameter; the knobs are "
                         f"input tensors (docs/api.md lists them)")
    # an HTTP generate body's `timeout` is the request's deadline (request_timeout_s): a string, a float or a
    # negative one was dropped without a word, leaving the deployment's ceiling
    if "timeout" in params and (isinstance(timeout := params["timeout"], bool) or not isinstance(timeout, int)
                                or timeout < 0):
        raise ValueError(f"parameters.timeout: must be whole microseconds >= 0 (0: none), got {timeout!r}")


def client_request_id(request) -> str:
    """The client's id of the request: Triton's request id, or the `id` of an HTTP generate body ('' if none), as
    the component's log lines carry it: control characters escaped and at most 256 characters (a direct client's id
    is not checked as the proxy checks its header; a walk's hop id, `<proxy id of up to 128>#<pid>.<n>/<component>`,
    fits whole)."""
    rid = request.request_id()
    if not rid:
        given = request_parameters(request).get("id")
        rid = given if isinstance(given, str) else ""
    return wire.loggable(rid, 256)


def request_timeout_s(request) -> float | None:
    """The request's Triton timeout (microseconds; 0 = none) in seconds: gRPC's and tritonclient's `timeout`, or the
    `timeout` field of an HTTP generate body, which arrives as a parameter."""
    try:
        timeout_us = int(request.timeout())
    except Exception:  # noqa: BLE001 - an older stub without timeout(): none there
        timeout_us = 0
    if timeout_us <= 0:
        given = request_parameters(request).get("timeout")
        timeout_us = given if isinstance(given, int) and not isinstance(given, bool) else 0
    return timeout_us / 1e6 if timeout_us > 0 else None


def deadline_s(request, ceiling_s: float | None) -> float | None:
    """The request's Triton timeout in seconds, at most `ceiling_s` (the deployment's `admission.request_timeout_s`;
    either may be None: none)."""
    return min((t for t in (request_timeout_s(request), ceiling_s) if t is not None), default=None)
