"""Replay one perf_analyzer input-data entry against a running server as perf_analyzer would: the file checked
against the entry model's config as served, the entry's tensors sent on a gRPC stream, every response read
(mstar_common/bench/replay.py's pieces, with an entry's inputs overridable to fit a tiny checkpoint)."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import tritonclient.grpc as grpcclient

from mstar_common.bench.pa_files import check_against_config
from mstar_common.bench.replay import EntryInputs, served_config

ROOT = Path(__file__).resolve().parents[2]


def replay(url: str, model: str, path: str | Path, index: int = 0, timeout: float = 300.0,
           **override) -> tuple[set[str], int]:
    """(the outputs its responses carried, how many responses) of entry `index` of `path` (`override`: inputs
    replaced, as values of the entry's own JSON form); AssertionError on a server error."""
    data = json.loads((ROOT / path).read_text())
    config = served_config(url, model)
    check_against_config(data, config)
    tensors = EntryInputs(config)({**data["data"][index], **override})
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    names, count = set(), 0
    try:
        client.async_stream_infer(model, tensors, request_id="pa-0", enable_empty_final_response=True)
        deadline = time.monotonic() + timeout
        while True:
            result, error = results.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, str(error)
            response = result.get_response()
            names |= {output.name for output in response.outputs}
            count += bool(response.outputs)
            if response.parameters["triton_final_response"].bool_param:
                return names, count
    finally:
        client.stop_stream()
        client.close()
