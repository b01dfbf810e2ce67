"""Triton node for an autoregressive component (decoupled, continuous batching).

I/O contract: the text-LM tensors in mstar_common/wire.py (inputs text_input | messages | input_ids plus
sampling knobs; streamed outputs text_output, token_ids, finish_reason, prompt_tokens, completion_tokens).

Threads: Triton calls `execute` with new requests; it only parses, validates and enqueues, then returns.
The engine's step loop (one background thread; with `MSTAR_ENGINE_PROCESS=1` a child process,
mstar_common/engine/engine_process.py) batches every running request into each step: prefill chunks and
decodes together over the paged KV cache. The output pump (a second thread) turns tokens into responses.
A request refused at parse time gets one error response (an `invalid_request:` message), one the component
has no room for an `overloaded:` or `unavailable:` one (mstar_common/engine/admission.py); every admitted
request ends with exactly one FINAL, through backends/responder.py. A request's Triton `timeout`
(microseconds, as tritonclient and the proxy set it) is its server-side deadline.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import signal
import time

from backends.bls import release_stub_objects
from backends.metrics import ComponentMetrics
from backends.node_setup import install_stack_dumps, load_node
from backends.responder import Responder, client_request_id, request_inputs, request_timeout_s
from mstar_common.engine.detokenizer import IncrementalDetokenizer
from mstar_common.engine.output_pump import TextStream, enqueue, make_output_pump
from mstar_common.engine.stop_strings import StopStringMatcher
from mstar_common.gc_policy import settle_heap
from mstar_common.stall_watch import StallWatch

logger = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <stub pid>` dumps every thread
        node = load_node(args, kind="autoregressive")
        self.model_name, device = node.model_name, node.device
        self.input_names = [spec.name for spec in node.component.inputs]
        self.runtime = node.build_runtime()  # its engine in a child process with MSTAR_ENGINE_PROCESS=1
        self.engine = self.runtime.engine
        self.pump = make_output_pump(self.engine, name=f"{self.model_name}-output",
                                     watch=StallWatch.from_env(self.engine, self.model_name))
        self._ids = itertools.count()
        self.pump.start()
        self.engine.start()
        labels = {"model": self.model_name, "instance": args["model_instance_name"], "device": device}
        self.metrics = ComponentMetrics(self.engine, self.pump.latency, labels)
        self.metrics.start()
        install_stack_dumps(self.engine.stats)
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready on %s", self.model_name, device)

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        arrival = time.monotonic()  # the TTFT histogram's start: before the parse (chat template, tokenization)
        request_id = f"{client_request_id(request) or 'req'}#{next(self._ids)}"
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
            detokenizer=IncrementalDetokenizer(self.runtime.tokenizer, context=text_request.prompt_ids),
            stops=StopStringMatcher(text_request.stops) if text_request.stops else None,
            num_prompt_tokens=len(text_request.prompt_ids),
            arrival=arrival,
        )
        # A model with per-request state (whisper's decoder: its cross-attention input) gets it from the parse,
        # and a runtime may add tensors read from it to the last response (whisper's window scores).
        state = getattr(text_request, "request_state", None)
        extra = {} if state is None else {"request_state": state}
        final_outputs = getattr(self.runtime, "final_outputs", None)
        if state is not None and final_outputs is not None:
            stream.final_outputs = lambda: final_outputs(state)
        self.pump.register(stream)
        enqueue(self.engine, self.pump, responder, text_request.prompt_ids, text_request.params,
                timeout_s=request_timeout_s(request), **extra)

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        self.metrics.stop()
        self.engine.shutdown()
        self.pump.stop()
        release_stub_objects()
