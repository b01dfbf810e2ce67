"""The Responder (backends/responder.py) builds only the outputs a client asked for, and all of them for a client
that named none. Triton drops unrequested outputs itself, so a client cannot see the difference (the integration
test `test_a_client_that_names_its_outputs_gets_only_those` checks what it receives); here, a stand-in for the
backend's module records the tensors each response was built from."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest


@pytest.fixture()
def responder(monkeypatch):
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Tensor = lambda name, value: (name, value)
    pb.InferenceResponse = lambda output_tensors, error=None: {name for name, _ in output_tensors}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    monkeypatch.delitem(sys.modules, "backends.responder", raising=False)
    import backends.responder as module

    return module


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


class Request:
    def __init__(self, names):
        self.names, self.sender = names, Sender()

    def get_response_sender(self):
        return self.sender

    def requested_output_names(self):
        return self.names


OUTPUTS = {"token_ids": np.array([7], np.int32), "text_output": np.array([b"x"], np.object_),
           "finish_reason": np.array([b""], np.object_)}


@pytest.mark.parametrize("names, built", [
    (["token_ids"], {"token_ids"}),
    (["token_ids", "finish_reason"], {"token_ids", "finish_reason"}),
    ([], set(OUTPUTS)),  # named none: all
])
def test_a_response_carries_the_requested_outputs_only(responder, names, built):
    request = Request(names)
    r = responder.Responder(request, "r")
    r.send_chunk(OUTPUTS)
    r.send_final(OUTPUTS)
    assert request.sender.sent == [(built, 0), (built, 1)]
