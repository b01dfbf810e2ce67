"""The walk router's handling of a walk's component requests ("hops") when the walk ends (backends/walk_router.py),
with a stand-in for the backend's module: the cancel board is the only way to stop a hop in flight (Triton 2.51
cannot cancel a BLS request), so every hop a walk leaves behind must be posted on it."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from mstar_common.walk_api import ComponentError
from mstar_common.walk_cancel import CancelBoard


@pytest.fixture()
def router(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.delitem(sys.modules, "backends.walk_router", raising=False)
    import backends.walk_router as module

    board = CancelBoard(str(tmp_path / "board"))
    monkeypatch.setattr(module, "walk_board", lambda: board)
    monkeypatch.setattr(module, "request_inputs", lambda request, names: {})
    return module, board


class Responder:
    request_id = "walk#1"

    def __init__(self, cancelled=False):
        self.sent, self.cancelled = [], cancelled

    def is_cancelled(self):
        return self.cancelled

    def __getattr__(self, name):  # send_error, send_final, send_invalid, send_server_error
        return lambda *args: self.sent.append((name, *args))


class Walk:
    """Opens hops (as send_hop does) and then ends as `ending` says, leaving them in flight."""

    input_names = ()

    def __init__(self, ending):
        self.ending = ending

    async def run(self, inputs, hops):
        for window in range(3):
            hops.opened(f"walk#1/decoder.{window}")
        hops.ended("walk#1/decoder.0")
        if isinstance(self.ending, BaseException):
            raise self.ending
        return self.ending


def serve(module, walk, timeout_s=None, cancelled=False):
    model = object.__new__(module.TritonPythonModel)
    model.walk, model.num_refused, model.num_expired = walk, 0, 0
    model._caller = lambda responder, received, hops: hops
    responder = Responder(cancelled)
    asyncio.run(model._serve_admitted(object(), responder, timeout_s))
    responder.model = model  # its counters
    return responder


@pytest.mark.parametrize("ending, sent", [
    (ComponentError("decoder", "engine step failed (error id 7)"), "send_error"),  # one window failed
    (ComponentError("decoder", "overloaded: 64 requests in whisper_decoder already"), "send_error"),
    (RuntimeError("a fault in the walk"), "send_server_error"),
    (ValueError("file: the audio holds no samples"), "send_invalid"),
])
def test_a_walk_that_ends_without_its_answer_posts_its_hops_still_in_flight(router, ending, sent):
    """Only a client gone posted them: after one whisper window failed, its sibling windows decoded to their ends
    for nobody, holding decoder and cross-KV slots while the walk's window slots went to other uploads."""
    module, board = router
    responder = serve(module, Walk(ending))
    assert responder.sent[0][0] == sent
    assert board.is_posted("walk#1/decoder.1") and board.is_posted("walk#1/decoder.2")
    assert not board.is_posted("walk#1/decoder.0")  # it had ended


def test_a_walk_that_answers_leaves_its_hops_alone(router):
    module, board = router
    responder = serve(module, Walk({"text": "hi"}))
    assert responder.sent == [("send_final", {"text": "hi"})]
    assert not board.is_posted("walk#1/decoder.1") and not board.is_posted("walk#1/decoder.2")


def test_a_walk_that_trips_over_a_hop_its_gone_client_stopped_ends_quietly(router, caplog):
    """A hop the board stopped ends without its output; whisper's walk then raised a RuntimeError (window 0 ended
    without a token, so no language) that was logged as a server fault with an error id, for every upload whose
    client left before its language was detected."""
    module, board = router
    with caplog.at_level("INFO"):
        responder = serve(module, Walk(RuntimeError("window 0's decode ended without a token")), cancelled=True)
    assert responder.sent == [("send_final",)]
    assert "client cancelled" in caplog.text and not [r for r in caplog.records if r.levelname == "ERROR"]
    assert board.is_posted("walk#1/decoder.1")


def test_a_walks_own_queue_wait_past_its_limit_is_counted_with_the_expired(router):
    """Whisper's upload that waited past queue_timeout_s for a window slot ended with its 503 but was counted in no
    series (mstar_requests_expired_total counts the components' queue waits)."""
    from mstar_common import wire
    from mstar_common.walk_api import QueueWaitExpired

    module, _ = router
    waited = QueueWaitExpired("walk", f"{wire.UNAVAILABLE_PREFIX}the upload waited 60 s for admission")
    responder = serve(module, Walk(waited))
    assert responder.sent[0][0] == "send_error" and wire.error_class(responder.sent[0][1]) == wire.UNAVAILABLE_PREFIX
    assert (responder.model.num_expired, responder.model.num_refused) == (1, 0)


@pytest.mark.parametrize("gone", ["client", "walk"])
def test_no_hop_is_sent_once_the_client_is_gone_or_the_walk_abandoned(router, gone):
    """`call` refused a hop once its client was gone; `call_stream`, whisper's only way to its decoder, did not:
    windows whose encoder call, language or slot came after the client left opened decoder streams that prefilled
    and decoded until the cancel poll saw them."""
    module, _ = router
    built = []
    module.pb_utils.InferenceRequest = lambda **kwargs: built.append(kwargs)
    model = object.__new__(module.TritonPythonModel)
    model.family, model.components = "whisper", {"decoder": None, "encoder": None}
    hops = module.Hops(module.Budget(0.0, None))
    if gone == "walk":
        hops.abandon()
    responder = Responder(cancelled=gone == "client")

    async def walk() -> None:
        with pytest.raises(ComponentError, match="cancelled"):
            async for _ in model._stream_caller(responder, module.Received(), hops)("decoder", {}):
                pass
        with pytest.raises(ComponentError, match="cancelled"):
            await model._caller(responder, module.Received(), hops)("encoder", {})

    asyncio.run(walk())
    assert built == []


def test_a_walk_waiting_when_its_client_goes_ends_then_not_when_its_wait_does(router, monkeypatch):
    """Whisper's upload parked on a window slot (every slot busy) kept its place among the walk's requests, and its
    audio, until another upload freed a slot: the watch posted its hops (none) and left the walk waiting."""
    import time

    module, _ = router
    monkeypatch.setattr(module, "WALK_CANCEL_POLL_S", 0.02)

    class Parked:
        input_names = ()

        async def run(self, inputs, hops):
            await asyncio.Event().wait()  # a window slot that never frees

    model = object.__new__(module.TritonPythonModel)
    model.walk, model.num_refused, model.num_expired = Parked(), 0, 0
    model._caller = lambda responder, received, hops: hops
    responder = Responder()

    async def main() -> float:
        asyncio.get_running_loop().call_later(0.1, setattr, responder, "cancelled", True)
        started = time.monotonic()
        await asyncio.wait_for(model._serve_admitted(object(), responder, 30.0), 5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 1.0
    assert responder.sent == [("send_final",)]


def test_a_streaming_walks_responses_are_sent_as_they_come_and_its_last_with_the_final(router):
    """The router held each response until the walk yielded the next (to flag the last one FINAL): whisper's first
    text delta waited for the decoder's next response, and a window's last delta for the next window's first text,
    which may wait for a window slot. Each is now sent when yielded; the walk's `LastResponse` goes with the FINAL."""
    import time

    from mstar_common.walk_api import LastResponse

    module, _ = router
    sent_at = {}

    class Streaming:
        input_names = ()

        async def stream(self, inputs, call, call_stream):
            yield {"text": "a"}
            await asyncio.sleep(0.5)
            yield {"text": "b"}
            yield LastResponse({"text": "", "finish_reason": "stop"})

    class Timed(Responder):
        def send_chunk(self, outputs):
            sent_at[outputs["text"]] = time.monotonic() - started
            self.sent.append(("send_chunk", outputs))

    model = object.__new__(module.TritonPythonModel)
    model.walk, model.num_refused, model.num_expired = Streaming(), 0, 0
    model._caller = model._stream_caller = lambda responder, received, hops: None
    responder = Timed()
    started = time.monotonic()
    asyncio.run(model._serve_admitted(object(), responder, None))
    assert sent_at["a"] < 0.25 <= sent_at["b"]
    assert responder.sent == [("send_chunk", {"text": "a"}), ("send_chunk", {"text": "b"}),
                              ("send_final", {"text": "", "finish_reason": "stop"})]
    assert isinstance(responder.sent[-1][1], LastResponse)


def test_a_streaming_walk_that_marks_no_last_response_ends_with_a_flags_only_final(router):
    module, _ = router

    class Unmarked:
        input_names = ()

        async def stream(self, inputs, call, call_stream):
            yield {"text": "a"}

    model = object.__new__(module.TritonPythonModel)
    model.walk, model.num_refused, model.num_expired = Unmarked(), 0, 0
    model._caller = model._stream_caller = lambda responder, received, hops: None
    responder = Responder()
    asyncio.run(model._serve_admitted(object(), responder, None))
    assert responder.sent == [("send_chunk", {"text": "a"}), ("send_final", None)]
