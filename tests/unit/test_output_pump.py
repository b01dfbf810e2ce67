"""The output pump: a cancelled request gets nothing but the closing FINAL, limit errors keep their prefix,
server faults are scrubbed to an error id, and latency samples are recorded."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from mstar_common import wire
from mstar_common.engine.output_pump import OutputPump, TextStream
from mstar_common.engine.types import FinishReason


class FakeTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class FakeSink:
    def __init__(self):
        self.sent: list[tuple[str, object]] = []
        self.is_closed = False
        self.cancelled = False

    def send_chunk(self, outputs):
        self.sent.append(("chunk", outputs))

    def send_final(self, outputs=None):
        self.is_closed = True
        self.sent.append(("final", outputs))

    def send_error(self, message):
        self.is_closed = True
        self.sent.append(("error", message))

    def send_server_error(self, exc):
        self.is_closed = True
        self.sent.append(("server_error", str(exc)))
        return "id"

    def is_cancelled(self):
        return self.cancelled


class FakeEngine:
    def __init__(self):
        self.cancelled: list[str] = []

    def cancel(self, request_id):
        self.cancelled.append(request_id)


def _stream(request_id, sink):
    from mstar_common.engine.detokenizer import IncrementalDetokenizer

    return TextStream(request_id, sink, IncrementalDetokenizer(FakeTokenizer()), None, 3)


def _run(pump, until, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _one_token_then(pump, sink, finish):
    """Stream "r" gets one token, then a last one with `finish`; returns once its sink is closed."""
    pump.on_output("r", [1], None, None)
    _run(pump, lambda: len(sink.sent) == 1)
    pump.on_output("r", [2], finish, None)
    _run(pump, lambda: sink.is_closed)


@contextlib.contextmanager
def _running(engine, **sinks):
    """A started pump with a stream per sink (keyed by request id), stopped on exit."""
    pump = OutputPump(engine)
    for request_id, sink in sinks.items():
        pump.register(_stream(request_id, sink))
    pump.start()
    try:
        yield pump
    finally:
        pump.stop()


def test_a_cancelled_stream_gets_only_a_flags_only_final_then_nothing():
    engine, sink = FakeEngine(), FakeSink()
    with _running(engine, r=sink) as pump:
        pump.on_output("r", [1], None, None)
        _run(pump, lambda: len(sink.sent) == 1)
        sink.cancelled = True
        _run(pump, lambda: engine.cancelled == ["r"])
        assert sink.sent[-1] == ("final", None)
        pump.on_output("r", [2, 3], None, None)  # the engine's last step before it saw the cancel
        pump.on_output("r", [], FinishReason.CANCELLED, None)
        time.sleep(0.2)
        assert [kind for kind, _ in sink.sent] == ["chunk", "final"]


def test_a_stream_the_engine_ends_at_shutdown_gets_a_retryable_error_not_a_cancelled_finish():
    """The engine's shutdown ends every live request CANCELLED; a client still reading must not see a normal end
    with finish reason 'cancelled' (no OpenAI client knows it), but the 503 class a retry is right for."""
    engine, sink = FakeEngine(), FakeSink()
    with _running(engine, r=sink) as pump:
        _one_token_then(pump, sink, FinishReason.CANCELLED)
    kind, message = sink.sent[-1]
    assert kind == "error" and wire.error_class(message) == wire.UNAVAILABLE_PREFIX
    assert "stopped before the request finished" in message and pump.num_streams == 0


def test_the_finals_the_engine_queues_right_before_the_pump_stops_still_go_out():
    """A component's finalize shuts the engine down (every live request CANCELLED) and then stops the pump at once:
    a round the stop cut short, here while it sent to another stream, still delivers them (it dropped them, so
    the client got no final and not the retryable error either)."""

    class BlockingSink(FakeSink):
        def __init__(self):
            super().__init__()
            self.entered, self.release = threading.Event(), threading.Event()

        def send_chunk(self, outputs):
            self.entered.set()
            assert self.release.wait(5)
            super().send_chunk(outputs)

    engine, busy, stopped = FakeEngine(), BlockingSink(), FakeSink()
    pump = OutputPump(engine)
    for request_id, sink in {"busy": busy, "stopped": stopped}.items():
        pump.register(_stream(request_id, sink))
    pump.start()
    pump.on_output("busy", [1], None, None)
    assert busy.entered.wait(5)  # the pump is inside a send
    pump.on_output("stopped", [], FinishReason.CANCELLED, None)  # the engine's shutdown
    stopping = threading.Thread(target=pump.stop)
    stopping.start()
    _run(pump, lambda: not pump._is_running)
    busy.release.set()
    stopping.join(5)
    kind, message = stopped.sent[-1]
    assert kind == "error" and wire.error_class(message) == wire.UNAVAILABLE_PREFIX


def test_limit_errors_keep_their_prefix_and_faults_are_scrubbed():
    engine, limited, faulty = FakeEngine(), FakeSink(), FakeSink()
    with _running(engine, limited=limited, faulty=faulty) as pump:
        pump.on_output("limited", [1], None, None)
        _run(pump, lambda: len(limited.sent) == 1)
        pump.on_output("limited", [], FinishReason.ERROR, wire.DEADLINE_PREFIX + "deadline of 2 s")
        pump.on_output("faulty", [], FinishReason.ERROR, "engine step failed (error id x)")
        _run(pump, lambda: limited.is_closed and faulty.is_closed)
    assert limited.sent[-1] == ("error", wire.DEADLINE_PREFIX + "deadline of 2 s")
    assert faulty.sent[-1][0] == "server_error"
    assert len(pump.latency.ttft) == 1 and len(pump.latency.itl) == 0


def _stop_stream(*stops):
    from mstar_common.engine.detokenizer import IncrementalDetokenizer
    from mstar_common.engine.stop_strings import StopStringMatcher

    return TextStream("r", FakeSink(), IncrementalDetokenizer(FakeTokenizer()), StopStringMatcher(list(stops)), 3)


def _sent(outputs):
    return (outputs[wire.TEXT_OUTPUT][0].decode(), outputs[wire.TOKEN_IDS].tolist(),
            outputs[wire.FINISH_REASON][0].decode(), int(outputs[wire.COMPLETION_TOKENS][0]))


def test_a_stop_string_inside_a_coalesced_response_ends_its_tokens_and_count_there():
    """A stream that fell behind gets several tokens a response; a stop string among them ends the token ids and
    the completion count at the token that completes it, as when each token came alone (usage depended on load)."""
    whole = _stop_stream("cd")
    outputs, reason = whole.update([0, 1, 2, 3, 4, 5], None)  # "abcdef"
    assert reason == "stop" and _sent(outputs) == ("ab", [0, 1, 2, 3], "stop", 4)
    alone = _stop_stream("cd")
    sent = [_sent(alone.update([t], None)[0]) for t in range(4)]
    assert "".join(text for text, *_ in sent) == "ab" and sent[-1][1:] == ([3], "stop", 4)
    spanning = _stop_stream("bcd")  # a match across responses, the last one also the engine's last token
    assert _sent(spanning.update([0, 1], None)[0]) == ("a", [0, 1], "", 2)
    outputs, reason = spanning.update([2, 3, 4], FinishReason.LENGTH)
    assert reason == "stop" and _sent(outputs) == ("", [2, 3], "stop", 4)
    unmatched = _stop_stream("zz")
    outputs, reason = unmatched.update([0, 1, 25], FinishReason.LENGTH)  # "abz": the held "z" goes out at the end
    assert reason == "length" and _sent(outputs) == ("abz", [0, 1, 25], "length", 3)


def test_the_stop_tokens_text_is_not_output_but_its_id_is_counted():
    """A stream the engine ends with STOP ends at a stop token (an EOS or a `stop_token_ids` entry such as "." or a
    newline): as vLLM, its text is left out; its id stays in the ids and in the count. A LENGTH end keeps it."""
    from mstar_common.engine.detokenizer import IncrementalDetokenizer

    for new_ids, finish, want in (([0, 1, 2], FinishReason.STOP, ("ab", [0, 1, 2], "stop", 3)),
                                  ([2], FinishReason.STOP, ("", [2], "stop", 1)),
                                  ([0, 1, 2], FinishReason.LENGTH, ("abc", [0, 1, 2], "length", 3))):
        stream = TextStream("r", FakeSink(), IncrementalDetokenizer(FakeTokenizer()), None, 3)
        assert _sent(stream.update(new_ids, finish)[0]) == want
    stream = _stop_stream("zz")  # with stop strings: the held text still goes out, the stop token's does not
    assert _sent(stream.update([0, 25], None)[0]) == ("a", [0, 25], "", 2)
    assert _sent(stream.update([3], FinishReason.STOP)[0]) == ("z", [3], "stop", 3)


def test_cancellation_polls_ask_a_bounded_slice_of_the_streams_in_turn():
    """Each poll asks at most CANCEL_POLL_STREAMS streams (an IPC round trip each on Triton), the next poll the
    next ones, so every stream is asked within ceil(N / 32) polls and a cancelled one among 100 is found."""
    from mstar_common.engine import output_pump

    class CountingSink(FakeSink):
        asked = 0

        def is_cancelled(self):
            CountingSink.asked += 1
            return self.cancelled

    engine, pump = FakeEngine(), OutputPump(FakeEngine())
    pump._engine = engine
    sinks = {f"r{i}": CountingSink() for i in range(100)}
    for rid, sink in sinks.items():
        pump.register(_stream(rid, sink))
    sinks["r77"].cancelled = True
    for poll in range(4):
        CountingSink.asked = 0
        pump._next_cancel_poll = 0.0
        pump._poll_cancellations()
        assert CountingSink.asked == output_pump.CANCEL_POLL_STREAMS == 32
        assert (engine.cancelled == ["r77"]) == (poll >= 2), poll  # r77 sits in the third slice
    assert sinks["r77"].sent == [("final", None)] and pump.num_streams == 99


def test_the_time_in_sends_is_counted_for_text_streams():
    class SlowSink(FakeSink):
        def send_chunk(self, outputs):
            time.sleep(0.01)
            super().send_chunk(outputs)

        def send_final(self, outputs=None):
            time.sleep(0.01)
            super().send_final(outputs)

    engine, sink = FakeEngine(), SlowSink()
    with _running(engine, r=sink) as pump:
        _one_token_then(pump, sink, FinishReason.LENGTH)
        times = pump.times
    assert times.responses == 2
    assert 0.02 <= times.send_s <= times.deliver_s
    assert f"sends {times.send_s * 1e3 / 2:.2f} ms each" in times.line(time.monotonic())


class _SlowSink(FakeSink):
    """A send that takes 5 ms, as a Triton send waiting for the server and the GIL; each send is logged in order."""

    log: list[tuple[str, str]] = []

    def __init__(self, name):
        super().__init__()
        self.name = name

    def send_chunk(self, outputs):
        time.sleep(0.005)
        _SlowSink.log.append((self.name, "chunk"))
        super().send_chunk(outputs)

    def send_final(self, outputs=None):
        time.sleep(0.005)
        _SlowSink.log.append((self.name, "final"))
        super().send_final(outputs)


def _slow_pump(monkeypatch, first_last: str, names):
    monkeypatch.setenv("MSTAR_PUMP_FIRST_LAST", first_last)
    _SlowSink.log = []
    pump = OutputPump(FakeEngine())
    sinks = {name: _SlowSink(name) for name in names}
    for name, sink in sinks.items():
        pump.register(_stream(name, sink))
    return pump, sinks


def test_a_last_token_queued_during_a_round_goes_ahead_of_the_rest_of_it(monkeypatch):
    """20 streams past their first token each have a token pending; while the round sends them (5 ms a send),
    s19's last token arrives (queued by s1's send, so at the same point of the round however loaded the machine):
    it is sent next, not after the other streams' chunks. With the switch off it waits for the round."""
    names = [f"s{i}" for i in range(20)]
    for first_last, expected_place in (("1", 2), ("0", 20)):
        pump, sinks = _slow_pump(monkeypatch, first_last, names)
        chunk = sinks["s1"].send_chunk

        def send_then_queue_the_last(outputs, chunk=chunk, pump=pump):
            chunk(outputs)
            pump.on_output("s19", [2], FinishReason.LENGTH, None)

        sinks["s1"].send_chunk = send_then_queue_the_last
        for name in names:  # every stream has had its first response
            pump._streams[name].last_output = time.monotonic()
            pump.on_output(name, [1], None, None)
        pump.start()
        try:
            _run(pump, lambda sinks=sinks: sinks["s19"].is_closed)
            _run(pump, lambda sinks=sinks: all(len(sink.sent) >= 1 for sink in sinks.values()))
        finally:
            pump.stop()
        place = _SlowSink.log.index(("s19", "final"))
        assert place == expected_place, (first_last, _SlowSink.log)
        sent = [kind for kind, _ in sinks["s19"].sent]
        assert sent == (["final"] if first_last == "1" else ["chunk", "final"]), sent  # merged when not yet sent
        assert sinks["s19"].sent[-1][1][wire.COMPLETION_TOKENS][0] == 2


def test_first_tokens_go_ahead_of_the_streams_already_started(monkeypatch):
    """In one round, the streams still waiting for their first token are sent before the started ones, in
    arrival order; a started stream keeps its arrival order among the others."""
    names = ["old0", "new0", "old1", "new1"]
    pump, sinks = _slow_pump(monkeypatch, "1", names)
    for name in ("old0", "old1"):
        pump._streams[name].last_output = time.monotonic()
    for name in names:
        pump.on_output(name, [1], None, None)
    pump.start()
    try:
        _run(pump, lambda: len(_SlowSink.log) == 4)
    finally:
        pump.stop()
    assert [name for name, _ in _SlowSink.log] == ["new0", "new1", "old0", "old1"]


# ---- MSTAR_PUMP_SHARDS -------------------------------------------------------------------------------------------


def test_pump_shards_parses_and_refuses(monkeypatch):
    import pytest

    from mstar_common.engine.output_pump import pump_shards

    monkeypatch.delenv("MSTAR_PUMP_SHARDS", raising=False)
    assert pump_shards() == 1
    monkeypatch.setenv("MSTAR_PUMP_SHARDS", "4")
    assert pump_shards() == 4
    for bad in ("0", "17", "two", "-1", "1.5"):
        monkeypatch.setenv("MSTAR_PUMP_SHARDS", bad)
        with pytest.raises(ValueError, match="MSTAR_PUMP_SHARDS"):
            pump_shards()


def test_make_output_pump_one_or_sharded(monkeypatch):
    from mstar_common.engine.output_pump import ShardedOutputPump, make_output_pump

    monkeypatch.delenv("MSTAR_PUMP_SHARDS", raising=False)
    assert isinstance(make_output_pump(FakeEngine()), OutputPump)
    monkeypatch.setenv("MSTAR_PUMP_SHARDS", "3")
    pump = make_output_pump(FakeEngine())
    assert isinstance(pump, ShardedOutputPump) and len(pump.pumps) == 3


def test_sharded_pump_keeps_each_streams_order_and_spreads_streams():
    """Many streams over 3 pumps: every token reaches its own stream once and in order, each stream ends with one
    FINAL, every pump serves some streams, and the latency samples of all pumps land in one place."""
    from mstar_common.engine.output_pump import ShardedOutputPump

    engine = FakeEngine()
    pump = ShardedOutputPump(engine, 3)
    sinks = {f"r{i}": FakeSink() for i in range(24)}
    for request_id, sink in sinks.items():
        pump.register(_stream(request_id, sink))
    assert pump.num_streams == 24
    assert all(p.num_streams > 0 for p in pump.pumps)
    pump.start()
    try:
        for step in range(20):
            for i, request_id in enumerate(sinks):
                finish = FinishReason.LENGTH if step == 19 else None
                pump.on_output(request_id, [i * 100 + step], finish, None)
        _run(pump, lambda: all(sink.is_closed for sink in sinks.values()))
    finally:
        pump.stop()
    for i, (request_id, sink) in enumerate(sinks.items()):
        kinds = [kind for kind, _ in sink.sent]
        assert kinds[-1] == "final" and kinds.count("final") == 1, request_id
        ids = [int(t) for _, outputs in sink.sent for t in outputs[wire.TOKEN_IDS]]
        assert ids == [i * 100 + step for step in range(20)], request_id
    assert pump.num_streams == 0
    assert len(pump.latency.ttft) == 24
    assert engine.cancelled == []


class _CountingWatch:
    def __init__(self):
        self.beats = 0
        self.stops = 0

    def beat(self):
        self.beats += 1

    def stop(self):
        self.stops += 1


def test_sharded_watch_beats_only_when_every_pump_has_beaten():
    from mstar_common.engine.output_pump import _EveryShardBeats

    watch = _CountingWatch()
    beats = _EveryShardBeats(watch, 3)
    shard = [beats.for_shard(k) for k in range(3)]
    for _ in range(5):  # a stuck pump 2: the others beat on, the watch is never beaten
        shard[0].beat()
        shard[1].beat()
    assert watch.beats == 0
    shard[2].beat()
    assert watch.beats == 1
    shard[2].beat()
    shard[0].beat()
    assert watch.beats == 1
    shard[1].beat()
    assert watch.beats == 2
    shard[0].stop()
    assert watch.stops == 1


LATE = wire.DEADLINE_PREFIX + "the request did not finish within 1 s"


@pytest.mark.parametrize("finish, error", [(FinishReason.CANCELLED, None), (FinishReason.ERROR, LATE)])
def test_tokens_queued_with_the_end_that_complete_a_stop_end_the_stream_normally(finish, error):
    """The engine's shutdown ends a request CANCELLED, its deadline or a failed step with an error; tokens it made
    before that, still queued for a stream that fell behind, may complete a stop string: that stream was done, and
    its client gets the answer, not a 503 (or a 504: whether the pump had sent them first was only a race). Tokens
    that complete nothing still end in the retryable error, or in the error."""
    engine, done, cut = FakeEngine(), FakeSink(), FakeSink()
    pump = OutputPump(engine)
    for request_id, sink in {"done": done, "cut": cut}.items():
        stream = _stop_stream("cd")
        stream.request_id, stream.sink = request_id, sink
        pump.register(stream)
    pump.on_output("done", [0, 1, 2, 3], None, None)  # "abcd": "cd" completes at the fourth
    pump.on_output("done", [4], finish, error)
    pump.on_output("cut", [0, 1, 4], None, None)  # "abe"
    pump.on_output("cut", [], finish, error)
    pump.start()
    try:
        _run(pump, lambda: done.is_closed and cut.is_closed)
    finally:
        pump.stop()
    assert [kind for kind, _ in done.sent] == ["final"]
    assert _sent(done.sent[0][1]) == ("ab", [0, 1, 2, 3], "stop", 4)
    kind, message = cut.sent[-1]
    assert kind == "error" and (message == error if error else wire.error_class(message) == wire.UNAVAILABLE_PREFIX)
    assert pump.num_streams == 0 and engine.cancelled == []


def test_the_server_itl_is_one_sample_a_token_as_the_client_counts_it(monkeypatch):
    """A response of k tokens after a gap g was one ITL sample of g/k (the histogram's mean weighted responses),
    where the bench's client counts k samples of g/k: 1 token at 1 ms then 3 at 7 ms gave a server mean of 1.5 ms
    beside a client mean of 1.75 ms for the same tokens."""
    import pytest

    from mstar_common.bench.metrics import RequestRecord
    from mstar_common.engine import output_pump
    from mstar_common.engine.output_pump import LatencySamples

    clock = iter([0.0, 0.001, 0.007])
    monkeypatch.setattr(output_pump.time, "monotonic", lambda: next(clock))
    stream = TextStream("r", FakeSink(), None, None, 3)
    stream.arrival = -0.002
    latency = LatencySamples()
    for tokens in (1, 1, 3):
        stream.record_latency(latency, tokens)
    assert list(latency.ttft) == [0.002]
    itls = list(latency.drain("itl"))
    assert itls == [0.001, 0.002, 0.002, 0.002] and not latency.itl
    client = RequestRecord(start=-0.002, chunks=[(0.0, 1), (0.001, 1), (0.007, 3)])
    assert itls == pytest.approx(client.itls()) and sum(itls) / len(itls) * 1e3 == pytest.approx(1.75)


def test_the_itl_samples_are_the_tokens_sent_when_a_stop_string_cuts_a_response():
    """A coalesced response that a stop string cut (2 of 5 tokens sent) gave 5 ITL samples of a fifth of its gap:
    the histogram's mean fell below the client's, which counts the 2 tokens it got."""
    engine, stream = FakeEngine(), _stop_stream("c")
    pump = OutputPump(engine)
    pump.register(stream)
    pump.start()
    try:
        pump.on_output("r", [0], None, None)  # "a": the first output (TTFT)
        _run(pump, lambda: len(stream.sink.sent) == 1)
        pump.on_output("r", [1, 2, 3, 4, 5], None, None)  # "bcdef": the stop completes at the second
        _run(pump, lambda: stream.sink.is_closed)
    finally:
        pump.stop()
    kind, outputs = stream.sink.sent[-1]
    assert kind == "final" and outputs[wire.TOKEN_IDS].tolist() == [1, 2] and engine.cancelled == ["r"]
    assert len(pump.latency.ttft) == 1 and len(list(pump.latency.drain("itl"))) == 2


def test_a_pump_saturated_by_short_requests_keeps_beating_its_stall_watch(monkeypatch):
    """Each final freed a client whose next request's first token was urgent again, so under steady load of short
    requests a send round never ended: the stall watch, beaten between rounds, saw no beat and ended a stub that was
    answering ~900 requests a second (MSTAR_STALL_EXIT_S, 120 s by default)."""
    import itertools

    monkeypatch.setenv("MSTAR_PUMP_FIRST_LAST", "1")
    watch = _CountingWatch()
    pump = OutputPump(FakeEngine(), watch=watch)
    ids = itertools.count()
    answered = []

    class ClosedLoop(FakeSink):  # a client that sends its next request as soon as its answer is in
        def send_final(self, outputs=None):
            time.sleep(0.001)
            super().send_final(outputs)
            answered.append(1)
            if pump._is_running:
                request_id = f"r{next(ids)}"
                pump.register(_stream(request_id, ClosedLoop()))
                pump.on_output(request_id, [1], FinishReason.LENGTH, None)

    for _ in range(4):
        request_id = f"r{next(ids)}"
        pump.register(_stream(request_id, ClosedLoop()))
        pump.on_output(request_id, [1], FinishReason.LENGTH, None)
    pump.start()
    try:
        _run(pump, lambda: len(answered) >= 200, timeout=60)  # (a count, not a time: CI machines are loaded)
        beats = watch.beats
    finally:
        pump.stop()
    assert beats >= 20, (len(answered), beats)  # 0 before: the round never ended


def test_a_round_started_with_many_firsts_and_lasts_still_sends_its_own_streams_within_the_urgent_run(monkeypatch):
    """The round's own entries already sent as urgent each reset the run without a send: with 20 short requests in
    the round, each final starting the client's next request, a decoding stream's chunk waited 168 sends."""
    import itertools

    from mstar_common.engine.output_pump import URGENT_RUN

    monkeypatch.setenv("MSTAR_PUMP_FIRST_LAST", "1")
    pump = OutputPump(FakeEngine())
    ids = itertools.count()
    order: list[str] = []

    class ClosedLoop(FakeSink):
        def __init__(self, request_id):
            super().__init__()
            self.request_id = request_id

        def send_chunk(self, outputs):
            order.append(self.request_id)
            super().send_chunk(outputs)

        def send_final(self, outputs=None):
            order.append(self.request_id)
            super().send_final(outputs)
            request_id = f"new{next(ids)}"
            pump.register(_stream(request_id, ClosedLoop(request_id)))
            pump.on_output(request_id, [1], FinishReason.LENGTH, None)

    for k in range(20):
        pump.register(_stream(f"short{k}", ClosedLoop(f"short{k}")))
        pump.on_output(f"short{k}", [1], FinishReason.LENGTH, None)
    long_stream = _stream("long", ClosedLoop("long"))
    long_stream.last_output = time.monotonic()  # decoding: its next tokens are not urgent
    pump.register(long_stream)
    pump.on_output("long", [1, 2], None, None)
    pump._is_running = True
    pump._drain()
    pump._send_round()
    own = {f"short{k}" for k in range(20)} | {"long"}
    last_own = max(i for i, rid in enumerate(order) if rid in own)
    # the new requests' firsts sent before the round's last own send: each run of them delays an own stream
    runs = [len(list(group)) for is_new, group in itertools.groupby(order[:last_own], key=lambda rid: rid not in own)
            if is_new]
    assert "long" in order and max(runs, default=0) <= URGENT_RUN, (runs, order.index("long"))
