"""Triton node for a speech LM component (decoupled): the decode loop, and the stream edge to its codec.

I/O contract: the speech tensors in mstar_common/wire.py (in: text_input, voice, sampling knobs; streamed
out: audio_chunk PCM16, sample_rate, token_ids, finish_reason, prompt/completion token counts). A request
refused at parse time gets one `invalid_request:` error; every admitted request ends with exactly one FINAL.

Threads: `execute` only parses, validates and enqueues. The engine's step loop (one thread; with
`MSTAR_ENGINE_PROCESS=1` a child process, mstar_common/engine/engine_process.py) batches every
running request into each prefill/decode step over the paged KV cache. The codec pump (a second thread)
turns each step's tokens into codec windows, sends all of a step's windows to the codec component in ONE
BLS request, and streams the decoded PCM to each request's response sender.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.bls import KEEPER, cpu_output_memory, release_stub_objects
from backends.metrics import ComponentMetrics
from backends.node_setup import install_stack_dumps, load_node
from backends.responder import Responder, client_request_id, request_inputs, request_timeout_s
from mstar_common import wire
from mstar_common.engine.codec_pump import AudioStream, CodecPump
from mstar_common.engine.output_pump import enqueue
from mstar_common.families.orpheus.codes import SpeechChunker
from mstar_common.gc_policy import settle_heap
from mstar_common.stall_watch import StallWatch

logger = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        setup = load_node(args, kind="speech_lm")
        self.model_name = setup.model_name
        self.input_names = [spec.name for spec in setup.component.inputs]
        self.runtime = setup.build_runtime()  # its engine in a child process with MSTAR_ENGINE_PROCESS=1
        self.engine = self.runtime.engine
        codec = self.runtime.local_codec or BLSCodec(self.runtime.codec_model)
        self.pump = CodecPump(self.engine, codec, name=f"{self.model_name}-codec",
                              watch=StallWatch.from_env(self.engine, self.model_name))
        self._ids = itertools.count()
        self.pump.start()
        self.engine.start()
        labels = {"model": self.model_name, "instance": args["model_instance_name"], "device": setup.device}
        self.metrics = ComponentMetrics(self, self.pump.latency, labels)
        self.metrics.start()
        install_stack_dumps(self.stats)
        settle_heap(self.model_name)  # start-up objects out of the collector's reach
        logger.info("[%s] ready on %s; codec %s", self.model_name, setup.device,
                    "in process" if self.runtime.local_codec else f"model {self.runtime.codec_model} (BLS)")

    def execute(self, requests: list) -> None:
        for request in requests:
            self._submit(request)
        return None

    def stats(self) -> dict:
        """The engine's stats plus the codec edge's (read by the metrics thread)."""
        return {**self.engine.stats(), "num_codec_streams": self.pump.num_streams,
                "num_codec_calls": self.pump.num_codec_calls}

    def _submit(self, request) -> None:
        arrival = time.monotonic()  # the first-audio histogram's start: before the parse, as the text node's TTFT
        request_id = f"{client_request_id(request) or 'tts'}#{next(self._ids)}"
        responder = Responder(request, request_id)
        try:
            speech = self.runtime.parse_request(request_inputs(request, self.input_names))
        except ValueError as exc:
            responder.send_invalid(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a tokenizer fault must not take down the node
            responder.send_server_error(exc)
            return
        chunker = SpeechChunker(self.runtime.layout, self.runtime.frame_rule)
        self.pump.register(AudioStream(request_id, responder, chunker, self.runtime.sample_rate,
                                       num_prompt_tokens=len(speech.prompt_ids), arrival=arrival,
                                       first_chunk_frames=self.runtime.first_chunk_frames))
        enqueue(self.engine, self.pump, responder, speech.prompt_ids, speech.params,
                timeout_s=request_timeout_s(request))

    def finalize(self) -> None:
        logger.info("[%s] shutting down", self.model_name)
        self.metrics.stop()
        self.engine.shutdown()
        self.pump.stop()
        release_stub_objects()


class BLSCodec:
    """The codec side of the stream edge: one BLS request per call, carrying the step's whole batch."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def decode(self, windows: np.ndarray) -> np.ndarray:
        # Host numpy both ways and CPU output memory asked for explicitly: the hop never hands this stub a
        # GPU buffer (CUDA IPC) or a DLPack view of memory it does not own.
        tensor = pb_utils.Tensor(wire.CODEC_WINDOWS, np.ascontiguousarray(windows, dtype=np.int32))
        request = pb_utils.InferenceRequest(model_name=self.model_name, inputs=[tensor],
                                            requested_output_names=[wire.CODEC_AUDIO], **cpu_output_memory())
        audio = None
        responses = request.exec(decoupled=True)
        try:
            for response in responses:
                if response.has_error():
                    raise RuntimeError(f"{self.model_name}: {response.error().message()}")
                output = pb_utils.get_output_tensor_by_name(response, wire.CODEC_AUDIO)
                if output is not None:
                    audio = np.array(output.as_numpy(), copy=True)
        finally:
            KEEPER.hold(responses)  # backends/bls.py: the stub must not free it off the GIL
        if audio is None or len(audio) != len(windows):
            raise RuntimeError(f"{self.model_name}: expected audio for {len(windows)} windows, got "
                               f"{None if audio is None else len(audio)}")
        return audio

