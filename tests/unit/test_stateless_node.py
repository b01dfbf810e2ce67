"""The stateless and denoise components' deadline (backends/stateless_node.py), with a stand-in for the backend's
module: a request's Triton timeout capped by the deployment's `admission.request_timeout_s`, which is also the
deadline of a direct call that set none (docs/reliability.md: "enforced by the component, capped by
`admission.request_timeout_s`"). It was the client's timeout alone: a direct call to a text encoder, VAE or the
whisper encoder with no timeout had no deadline, and one with a longer timeout than the deployment's kept it."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest


class Request:
    def __init__(self, timeout_us: int):
        self.timeout_us = timeout_us

    def timeout(self):
        return self.timeout_us

    def parameters(self):
        return "{}"

    def request_id(self):
        return "direct"


@pytest.mark.parametrize("timeout_us, ceiling_s, want_s", [
    (0, 600.0, 600.0),  # none given: the deployment's
    (10**12, 600.0, 600.0),  # 11.6 days asked: capped
    (250_000, 600.0, 0.25),  # a walk's hop with 0.25 s left
    (0, None, None),  # request_timeout_s: null and none given: no deadline
    (2_000_000, None, 2.0),
])
def test_a_component_requests_deadline_is_its_timeout_capped_by_the_deployments(monkeypatch, timeout_us, ceiling_s,
                                                                                 want_s):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    for name in ("backends.stateless_node", "backends.responder", "backends.metrics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import backends.stateless_node as module

    submitted = []

    class Runtime:
        def submit(self, request_id, inputs, on_done, stop):
            submitted.append(stop)

    node = object.__new__(module.ComponentNode)
    node.model_name, node.input_names, node.wire_dtypes = "vae_decode", ["latents"], {}
    node.runtime, node._ids, node.request_timeout_s = Runtime(), iter(range(9)), ceiling_s
    monkeypatch.setattr(module, "Responder", lambda request, request_id: types.SimpleNamespace(
        request_id=request_id, is_cancelled=lambda: False))
    monkeypatch.setattr(module, "request_inputs", lambda request, names: {"latents": np.zeros(2, np.float32)})
    node._submit(Request(timeout_us))
    [stop] = submitted
    assert stop.timeout_s == want_s
