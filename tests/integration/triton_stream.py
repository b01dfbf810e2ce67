"""A minimal tritonclient gRPC streaming driver for tests: send N requests on one stream, collect all."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from mstar_common import wire


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    num_responses: int = 0
    error: str | None = None
    is_final: bool = False
    output_names: set[str] = field(default_factory=set)  # every output any of its responses carried


def make_inputs(**values) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in values.items():
        if name in (wire.INPUT_IDS, wire.STOP_TOKEN_IDS):
            arr = np.asarray(value, dtype=np.int32)
            dtype = "INT32"
        elif name in wire.SAMPLING_INPUTS:
            dtype, np_dtype = wire.SAMPLING_INPUTS[name]
            arr = np.asarray([value], dtype=np_dtype)
        elif name == wire.STOP:
            arr = np.asarray([s.encode() for s in value], dtype=np.object_)
            dtype = "BYTES"
        else:
            arr = np.asarray([value.encode() if isinstance(value, str) else value], dtype=np.object_)
            dtype = "BYTES"
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


def run_stream(url: str, model: str, requests: dict[str, dict], timeout: float = 120.0,
               outputs: list[str] | None = None) -> dict[str, Collected]:
    """Send every request (id -> input values) on one gRPC stream, asking for `outputs` (None: names none, so
    all); return what each one received."""
    asked = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    collected = {rid: Collected() for rid in requests}
    try:
        for rid, values in requests.items():
            client.async_stream_infer(model, make_inputs(**values), request_id=rid, outputs=asked,
                                      enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while not all(c.is_final for c in collected.values()):
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                # errors carry no request id in tritonclient's callback: attribute to the first open request
                rid = _error_owner(error, collected)
                collected[rid].error = str(error)
                collected[rid].is_final = True
                continue
            response = result.get_response()
            c = collected[response.id]
            c.output_names |= {output.name for output in response.outputs}
            if result.as_numpy(wire.TOKEN_IDS) is not None:
                c.num_responses += 1
                c.token_ids += result.as_numpy(wire.TOKEN_IDS).tolist()
                if result.as_numpy(wire.TEXT_OUTPUT) is not None:
                    c.text += result.as_numpy(wire.TEXT_OUTPUT)[0].decode()
                if result.as_numpy(wire.FINISH_REASON) is not None:
                    c.finish_reason = result.as_numpy(wire.FINISH_REASON)[0].decode() or c.finish_reason
            if response.parameters["triton_final_response"].bool_param:
                c.is_final = True
    finally:
        client.stop_stream()
        client.close()
    return collected


def _error_owner(error, collected: dict[str, Collected]) -> str:
    return next(rid for rid, c in collected.items() if not c.is_final)
