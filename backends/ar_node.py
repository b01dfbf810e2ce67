"""Triton node for an autoregressive component (decoupled, continuous batching).

I/O contract: the text-LM tensors in mstar_common/wire.py (inputs text_input | messages | input_ids plus
sampling knobs; streamed outputs text_output, token_ids, finish_reason, prompt_tokens, completion_tokens).

Threads: Triton calls `execute` with new requests; it only parses, validates and enqueues, then returns.
The engine's step loop (one background thread) batches every running request into each step: prefill
chunks and decodes together over the paged KV cache. The output pump (a second thread) turns tokens
into responses. A request refused at parse time gets one error response (an `invalid_request:` message),
one the component has no room for an `overloaded:` or `unavailable:` one (mstar_common/engine/admission.py);
every admitted request ends with exactly one FINAL, through backends/responder.py. A request's Triton
`timeout` (microseconds, as tritonclient and the proxy set it) is its server-side deadline.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import logging
import signal

import triton_python_backend_utils as pb_utils

from backends.metrics import ComponentMetrics
from backends.responder import Responder, request_inputs
from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.config import deployment_from_dict
from mstar_common.engine.admission import AdmissionRefused
from mstar_common.engine.detokenizer import IncrementalDetokenizer
from mstar_common.engine.output_pump import OutputPump, TextStream
from mstar_common.engine.stop_strings import StopStringMatcher
from mstar_common.families.registry import get_family

logger = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <stub pid>` dumps every thread
        self.model_name = args["model_name"]
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException(f"{self.model_name}: an autoregressive node must be decoupled")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        for key in ("family", "component", "deployment"):
            if key not in params:
                raise pb_utils.TritonModelException(f"{self.model_name}: config.pbtxt lacks parameter {key!r}")
        deployment = deployment_from_dict(json.loads(params["deployment"]), source=self.model_name)
        family = get_family(params["family"])
        component = family.graph.components[params["component"]]
        self.input_names = [spec.name for spec in component.inputs]
        checkpoint = resolve_checkpoint(deployment.checkpoint, family.builtin_checkpoints)
        device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
        self.runtime = family.build_component(params["component"], deployment, checkpoint, device)
        self.engine = self.runtime.engine
        self.pump = OutputPump(self.engine, name=f"{self.model_name}-output")
        self._ids = itertools.count()
        self.pump.start()
        self.engine.start()
        labels = {"model": self.model_name, "instance": args["model_instance_name"], "device": device}
        self.metrics = ComponentMetrics(self.engine, self.pump.latency, labels)
        self.metrics.start()
        logger.info("[%s] ready on %s", self.model_name, device)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        responder = Responder(request, request_id)
        try:
            text_request = self.runtime.parse_request(request_inputs(request, self.input_names))
        except ValueError as exc:
            responder.send_invalid(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a tokenizer/template fault must not take down the node
            responder.send_server_error(exc)
            return
        stream = TextStream(
            request_id=request_id,
            sink=responder,
            detokenizer=IncrementalDetokenizer(self.runtime.tokenizer),
            stops=StopStringMatcher(text_request.stops) if text_request.stops else None,
            num_prompt_tokens=len(text_request.prompt_ids),
        )
        self.pump.register(stream)
        try:
            # A model with per-request state (whisper's decoder: its cross-attention input) gets it from the parse.
            state = getattr(text_request, "request_state", None)
            extra = {} if state is None else {"request_state": state}
            self.engine.add_request(request_id, text_request.prompt_ids, text_request.params, self.pump.on_output,
                                    timeout_s=_timeout_s(request), **extra)
        except AdmissionRefused as exc:
            self.pump.unregister(request_id)
            logger.debug("[%s] refused: %s", request_id, exc)  # counted in mstar_requests_overloaded_total
            responder.send_error(exc.wire_message)
        except ValueError as exc:
            self.pump.unregister(request_id)
            responder.send_invalid(str(exc))
        except Exception as exc:  # noqa: BLE001
            self.pump.unregister(request_id)
            responder.send_server_error(exc)

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        self.metrics.stop()
        self.engine.shutdown()
        self.pump.stop()


def _timeout_s(request) -> float | None:
    """The request's Triton timeout (microseconds; 0 = none) in seconds."""
    try:
        timeout_us = int(request.timeout())
    except Exception:  # noqa: BLE001 - an older stub without timeout(): no client deadline
        return None
    return timeout_us / 1e6 if timeout_us > 0 else None
