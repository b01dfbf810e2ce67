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
    pb.TritonError = lambda message: message
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
    def __init__(self, names, request_id="r"):
        self.names, self.sender, self.id = names, Sender(), request_id

    def request_id(self):
        return self.id

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


class WatchedSender(Sender):
    """Records every call with whether another call to it was in progress, and can hold `is_cancelled` open."""

    def __init__(self):
        super().__init__()
        import threading

        self.calls, self.inside, self.proceed = [], threading.Event(), threading.Event()
        self.busy = False

    def _enter(self, name):
        self.calls.append((name, self.busy))
        self.busy = True

    def send(self, response=None, flags=0):
        self._enter("send")
        super().send(response, flags)
        self.busy = False

    def is_cancelled(self):
        self._enter("is_cancelled")
        self.inside.set()
        self.proceed.wait(2)
        self.busy = False
        return False


def test_no_thread_asks_the_sender_after_the_final_nor_during_another_call(responder):
    """The output pump polls `is_cancelled()` while `execute` may end the same request (a refusal's error):
    Triton frees the request's response factory at the FINAL and answers a later query from freed memory, so
    the FINAL must wait for a query in progress, and no query may follow it."""
    import threading

    request = Request([])
    sender = request.sender = WatchedSender()
    r = responder.Responder(request, "r")
    polled = threading.Thread(target=r.is_cancelled)
    polled.start()
    assert sender.inside.wait(2)
    ended = threading.Thread(target=r.send_error, args=("refused",))
    ended.start()
    ended.join(0.2)
    assert ended.is_alive(), "the FINAL went out while the sender was answering a query"
    sender.proceed.set()
    polled.join(2)
    ended.join(2)
    assert [name for name, _ in sender.calls] == ["is_cancelled", "send"]
    assert not any(overlapped for _, overlapped in sender.calls)
    assert r.is_cancelled() is True and [name for name, _ in sender.calls] == ["is_cancelled", "send"]
    r.send_chunk(OUTPUTS)
    r.send_final(OUTPUTS)
    assert len(sender.calls) == 2  # nothing after the FINAL


def test_a_walks_component_request_is_cancelled_once_the_walk_posts_it(responder, monkeypatch, tmp_path):
    """Triton 2.51 cannot cancel a BLS request: a walk whose client went away posts its hops' ids on the cancel
    board (mstar_common/walk_cancel.py), and the component's Responder reads it as a cancel; a request whose id
    is not a hop's, or another hop, is not touched."""
    from mstar_common.walk_cancel import CancelBoard

    board = CancelBoard(str(tmp_path / "board"))
    monkeypatch.setattr(responder, "_BOARD", board)

    class Live(Sender):
        def is_cancelled(self):
            return False

    def made(request_id):
        request = Request([], request_id)
        request.sender = Live()
        return responder.Responder(request, request_id + "#0")

    hop, other_hop, direct = made("req#7.0/denoise"), made("req#7.1/denoise"), made("req")
    assert not hop.is_cancelled() and not other_hop.is_cancelled()
    board.post("req#7.0/denoise")
    board.post("req")  # not a hop's form: never asked
    assert hop.is_cancelled() and not other_hop.is_cancelled() and not direct.is_cancelled()
    board.clear("req#7.0/denoise")
    assert not hop.is_cancelled()
    board.clear("req")
    assert not (tmp_path / "board").exists()  # gone with its last entry


def test_the_cancel_board_exists_only_while_something_is_posted(tmp_path):
    from mstar_common.walk_cancel import CancelBoard

    board = CancelBoard(str(tmp_path / "board"))
    board.post("a/x.0")
    board.post("a/x.1")
    board.clear("a/x.0")
    assert board.is_posted("a/x.1") and not board.is_posted("a/x.0")
    board.clear("a/x.1")
    assert not (tmp_path / "board").exists()
    board.clear("a/x.1")  # twice: nothing to do
    board.post("b/y.0")  # and back
    assert board.is_posted("b/y.0")


@pytest.mark.parametrize("timeout", ['"5000000"', "5e6", "true", "-1", "null"])
def test_a_malformed_timeout_parameter_is_refused_not_dropped(responder, timeout):
    """An HTTP generate body's `timeout` (microseconds) is the request's deadline; a string, a float, a bool or a
    negative one was dropped without a word, and the request ran to the deployment's ceiling."""

    class WithParameters(Request):
        def parameters(self):
            return '{"timeout": %s}' % timeout

    with pytest.raises(ValueError, match=r"^parameters\.timeout: must be whole microseconds >= 0"):
        responder.check_no_parameters(WithParameters([]))
    ok = type("Ok", (WithParameters,), {"parameters": lambda self: '{"timeout": 5000000}'})([])
    responder.check_no_parameters(ok)
    assert responder.request_timeout_s(ok) == 5.0


def test_a_direct_clients_text_is_bounded_and_escaped_in_the_component_log(responder, caplog, monkeypatch):
    """A direct Triton client's request id, an unknown parameter's name and a refused value (an unknown voice of a
    megabyte) went into the component's log as sent: a newline in them forged a log line, and every refused request
    wrote the whole value."""
    import json
    import logging

    forged = "x\n2099-01-01 00:00:00,000 ERROR backends.responder FORGED"

    class Direct(Request):
        def request_id(self):
            return ""

        def parameters(self):
            return json.dumps({"id": forged, "k" * 100_000 + "\nFORGED": 1})

    request = Direct([])
    rid = responder.client_request_id(request)
    assert "\n" not in rid and rid.startswith("x\\n2099") and len(rid) <= 256
    hop = "a" * 128 + "#4242.17/text_encoder.0"  # a walk's hop for the longest id the proxy takes: kept whole
    assert responder.client_request_id(type("Hop", (Request,), {"request_id": lambda self: hop})([])) == hop
    with pytest.raises(ValueError) as info:
        responder.check_no_parameters(request)
    assert "\n" not in str(info.value) and len(str(info.value)) < 200
    monkeypatch.setattr(responder.pb_utils, "InferenceResponse", lambda output_tensors, error=None: error)
    r = responder.Responder(request, rid)
    with caplog.at_level(logging.INFO, logger="backends.responder"):
        r.send_invalid(f"voice: unknown voice {'v' * 1_000_000!r}\nFORGED")
    [record] = caplog.records
    assert "\n" not in record.getMessage() and len(record.getMessage()) < 1000
    [(error, _)] = request.sender.sent  # the error message sent, which the proxy relays
    assert error.startswith("invalid_request: voice: unknown voice 'vvv") and len(error) < 2100


def test_a_refusal_quoting_a_lone_surrogate_is_still_sent(responder, monkeypatch):
    """TritonError takes a std::string: a refusal quoting a direct client's lone surrogate (a message key sent as
    "\\ud800") raised UnicodeEncodeError out of execute(), and the client got Triton's generic failure instead."""
    def triton_error(message):
        message.encode("utf-8")  # as pybind11's conversion to std::string
        return message

    monkeypatch.setattr(responder.pb_utils, "TritonError", triton_error)
    monkeypatch.setattr(responder.pb_utils, "InferenceResponse", lambda output_tensors, error=None: error)
    request = Request([])
    responder.Responder(request, "r").send_invalid("messages[0].x\ud800: not accepted")
    [(error, _)] = request.sender.sent
    assert error == "invalid_request: messages[0].x\\ud800: not accepted"
