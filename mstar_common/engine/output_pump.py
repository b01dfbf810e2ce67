"""From engine tokens to client responses, off the step loop.

The engine's loop thread only queues (request id, new tokens, finish) per step. The pump thread drains
the queue, merges everything pending for a stream into one response (so a stream that falls behind gets
several tokens per response instead of a backlog), detokenizes byte-safely, applies stop strings (and
cancels the engine request when one matches), and polls client cancellation at a bounded rate and cost:
every 50 ms, at most 32 streams in turn (on Triton each ask is an IPC round trip to the server, ~0.1 ms; asking
all of 256 streams 20 times a second would take the pump thread half its time). A busy pump logs where its time
went every 10 s (`PumpTimes`).

The pump sends in rounds: every stream with output pending when a round starts gets one response, oldest first.
On Triton a send waits for the server process to take the response and then for the GIL (~1 ms a send at 64
streams beside a busy step loop, H200, 2026-12-05), so a round over 64 streams takes ~64 ms and a stream's tokens
coalesce (~30 a response). A stream's first tokens, its last ones and errors do not wait for the round
(`MSTAR_PUMP_FIRST_LAST=1`, the default): they go ahead of it, also when they arrive while it runs (the queue is
drained between two sends). A first token then waits for one send instead of a round (time to first token), and
so does a last one, which in a closed loop is what frees the client to send its next request (an idle row until
it arrives). At most `URGENT_RUN` of them go in a row before one of the round's own streams, and a round that has
sent its own ends (those still urgent lead the next), so a steady stream of short requests cannot hold the other
streams' tokens, or the round, for ever. `MSTAR_PUMP_FIRST_LAST=0` sends each round in arrival order, as before.

`MSTAR_PUMP_SHARDS=N` (default 1) splits the streams over N pumps, each its own thread and round (a stream's
outputs stay in one pump, so their order holds). A send waits for the server process with the GIL released, so N
pumps keep up to N sends in flight. With the engine in the stub this slowed the step loop (each thread takes the
GIL from it; 2026-12-03); with `MSTAR_ENGINE_PROCESS=1` the stub holds no step loop.

A cancelled request gets no more output: the poll that notices it closes the stream with a flags-only FINAL
(the handshake Triton needs to release the request) and then cancels it in the engine. Latency samples
(time to first token, inter-token latency) go to `latency` for the metrics exporter.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mstar_common import wire
from mstar_common.config import env_switch
from mstar_common.devices import on_device
from mstar_common.engine.admission import AdmissionRefused
from mstar_common.engine.detokenizer import IncrementalDetokenizer
from mstar_common.engine.stop_strings import StopStringMatcher
from mstar_common.engine.types import FinishReason

logger = logging.getLogger(__name__)

MAX_SHARDS = 16
CANCEL_POLL_S = 0.05  # how often live streams are asked whether their client went away ...
CANCEL_POLL_STREAMS = 32  # ... at most this many per poll, in turn (each ask is an IPC round trip on Triton)
STATS_LOG_S = 10.0  # how often a busy pump logs where its time went (PumpTimes)


class Sink(Protocol):
    """One request's response channel (backends.responder.Responder on Triton)."""

    is_closed: bool

    def send_chunk(self, outputs: dict[str, np.ndarray]) -> None: ...
    def send_final(self, outputs: dict[str, np.ndarray] | None = None) -> None: ...
    def send_error(self, message: str) -> None: ...
    def send_server_error(self, exc: BaseException | str) -> str: ...
    def is_cancelled(self) -> bool: ...


@dataclass(slots=True)
class TextStream:
    request_id: str
    sink: Sink
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    num_prompt_tokens: int
    num_completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    last_output: float | None = None  # when the previous tokens were sent
    # extra tensors for the last response, read when it is built (whisper's decoder: its window scores)
    final_outputs: Callable[[], dict[str, np.ndarray]] | None = None

    def record_latency(self, latency: LatencySamples, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        if self.last_output is None:
            latency.ttft.append(now - self.arrival)
        else:
            # a coalesced response spreads its gap over its tokens, each an ITL sample, as the clients count them
            latency.itl.append(((now - self.last_output) / num_tokens, num_tokens))
        self.last_output = now

    def update(self, new_ids: list[int], finish: FinishReason | None) -> tuple[dict[str, np.ndarray], str | None]:
        """Outputs for the new tokens, and the finish reason if this is the stream's last response (the text of a
        stop token that ended it left out).

        A stop string ends the stream at the token that completes it: the tokens after it in the same response
        (several per response when the stream falls behind) are neither sent nor counted."""
        reason = finish.value if finish is not None else None
        # a response of several tokens: the state before it, to find the token that completes a stop string
        before = (self.detokenizer.fork(), self.stops.fork()) if self.stops is not None and len(new_ids) > 1 else None
        # The engine's STOP is a stop token (an EOS or one of stop_token_ids), the last id here: its text is not
        # output, as vLLM leaves it out (an EOS is special and decodes to nothing anyway; a `stop_token_ids` entry
        # may be "\n" or "."). Its id stays in the ids and the count.
        shown = new_ids[:-1] if finish is FinishReason.STOP and new_ids else new_ids
        text = self.detokenizer.push(shown)
        if finish is not None:
            text += self.detokenizer.flush()
        if self.stops is not None:
            text, is_hit = self.stops.feed(text)
            if is_hit:
                reason = FinishReason.STOP.value
                if before is not None:
                    new_ids = new_ids[: _num_through_stop(*before, new_ids)]
            elif finish is not None:
                text += self.stops.flush()
        self.num_completion_tokens += len(new_ids)
        outputs = {
            wire.TEXT_OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_),
            wire.TOKEN_IDS: np.asarray(new_ids, dtype=np.int32),
            wire.FINISH_REASON: np.array([(reason or "").encode()], dtype=np.object_),
            wire.PROMPT_TOKENS: np.array([self.num_prompt_tokens], dtype=np.int32),
            wire.COMPLETION_TOKENS: np.array([self.num_completion_tokens], dtype=np.int32),
        }
        if reason is not None and self.final_outputs is not None:
            outputs.update(self.final_outputs())
        return outputs, reason


def _num_sent(outputs: dict[str, np.ndarray], new_ids: list[int]) -> int:
    """The tokens a response carries: its token ids (a stop string leaves out those after it), else all."""
    sent = outputs.get(wire.TOKEN_IDS)
    return len(new_ids) if sent is None else len(sent)


def _num_through_stop(detokenizer: IncrementalDetokenizer, stops: StopStringMatcher, new_ids: list[int]) -> int:
    """How many of `new_ids`, fed one at a time from the state before them, complete a stop string."""
    for num_fed, token_id in enumerate(new_ids, start=1):
        if stops.feed(detokenizer.push([token_id]))[1]:
            return num_fed
    return len(new_ids)  # completed by the end of the stream's flush (a character that never finished)


def pump_shards() -> int:
    """`MSTAR_PUMP_SHARDS`: how many output pumps (threads) share a component's streams; 1 to MAX_SHARDS."""
    raw = os.environ.get("MSTAR_PUMP_SHARDS", "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_SHARDS:
        raise ValueError(f"MSTAR_PUMP_SHARDS={raw!r}: expected a whole number of pumps in [1, {MAX_SHARDS}]")
    return int(raw)


URGENT_RUN = 8  # firsts, lasts and errors a send round takes in a row before one of its own streams' tokens


class LatencySamples:
    """Seconds, appended by the pump thread and drained by the metrics exporter (bounded: oldest dropped). An ITL
    entry is (seconds per token, tokens): one response's gap, which stands for that many samples."""

    MAX_SAMPLES = 100_000

    def __init__(self) -> None:
        self.ttft: deque[float] = deque(maxlen=self.MAX_SAMPLES)
        self.itl: deque[tuple[float, int]] = deque(maxlen=self.MAX_SAMPLES)

    def take(self, name: str) -> list[tuple[float, int]]:
        """The entries of series `name` queued when called, taken off its queue, each as (seconds, samples): a
        TTFT one sample, an ITL entry its response's tokens. Only those: a pump appending meanwhile (20,000 ITL
        samples a second at c=64) cannot keep the exporter draining, its gauges and counters unsampled."""
        queue = getattr(self, name)
        entries = [queue.popleft() for _ in range(len(queue))]
        return [entry if isinstance(entry, tuple) else (entry, 1) for entry in entries]

    def drain(self, name: str) -> Iterator[float]:
        """`take`'s samples one by one (an ITL entry's value once per token)."""
        for value, count in self.take(name):
            for _ in range(count):
                yield value


@dataclass(slots=True)
class PumpTimes:
    """Where a pump thread's time goes, summed since the last log line: delivering (for a codec pump split into
    the codec call and the rest, mostly the sends) and polling the live streams for cancellation."""

    cycles: int = 0
    responses: int = 0
    deliver_s: float = 0.0
    codec_s: float = 0.0
    send_s: float = 0.0  # in the sinks' send calls (with any wait for the GIL inside them)
    polls: int = 0
    polled: int = 0
    poll_s: float = 0.0
    since: float = field(default_factory=time.monotonic)

    def line(self, now: float) -> str:
        span = max(1e-9, now - self.since)
        per_cycle = 1e3 / max(1, self.cycles)
        busy = 100 * (self.deliver_s + self.poll_s) / span
        return (f"{self.cycles / span:.0f} cycles/s, {self.responses / span:.0f} responses/s; per cycle: deliver "
                f"{self.deliver_s * per_cycle:.1f} ms (codec {self.codec_s * per_cycle:.1f} ms, sends "
                f"{self.send_s * 1e3 / max(1, self.responses):.2f} ms each); cancel polls "
                f"{self.polls / span:.1f}/s, {self.poll_s * 1e3 / max(1, self.polls):.1f} ms each over "
                f"{self.polled / max(1, self.polls):.0f} streams; busy {busy:.0f}%")


class OutputPump:
    def __init__(self, engine: Any, name: str = "output-pump", watch: Any = None,
                 latency: LatencySamples | None = None):
        """`watch`: a `mstar_common.stall_watch.StallWatch` that each cycle of the pump's loop beats; `latency`:
        where the samples go (shared by the pumps of a `ShardedOutputPump`)."""
        self._engine = engine
        self._name = name
        self._watch = watch
        self.times = PumpTimes()
        self.latency = latency if latency is not None else LatencySamples()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, TextStream] = {}
        self._lock = threading.Lock()
        self._is_running = False
        self._thread = threading.Thread(target=on_device(self._run), name=name, daemon=True)
        self._next_cancel_poll = 0.0
        self._poll_cursor = 0  # where the next cancellation poll starts among the live streams
        # what the engine queued and the pump has not sent: request id -> (tokens, finish, error), oldest first
        self._pending: dict[str, tuple[list[int], FinishReason | None, str | None]] = {}
        self._first_last = env_switch("MSTAR_PUMP_FIRST_LAST", True)

    def start(self) -> None:
        self._is_running = True
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._is_running = False
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._watch is not None:
            self._watch.stop()  # after the loop's last beat: a shutdown is not a stall

    def register(self, stream: TextStream) -> None:
        with self._lock:
            self._streams[stream.request_id] = stream

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def on_output(self, request_id: str, new_ids: list[int], finish: FinishReason | None, error: str | None) -> None:
        """The engine callback (step-loop thread): queue only."""
        self._queue.put((request_id, list(new_ids), finish, error))

    def _run(self) -> None:
        while self._is_running:
            if not self._pending:
                try:
                    first = self._queue.get(timeout=CANCEL_POLL_S)
                except queue.Empty:
                    first = None
                if first is not None:
                    self._take(first)
            self._drain()
            try:
                if self._pending:
                    started, polled = time.perf_counter(), self.times.poll_s
                    self._send_round()
                    self.times.cycles += 1
                    self.times.deliver_s += time.perf_counter() - started - (self.times.poll_s - polled)
                self._poll_cancellations()
            except Exception:  # never let one bad stream stop every other stream's output
                logger.exception("output pump iteration failed")
            if self._watch is not None and self._is_running:
                self._watch.beat()
            self._log_times()
        self._deliver_the_rest()

    def _deliver_the_rest(self) -> None:
        """At stop, once: what was queued before it still goes out. A component's `finalize` shuts the engine down
        (every live request CANCELLED, each a retryable error to its client) right before it stops the pump; a
        round cut short by the stop, or a queue not yet drained, would leave those streams without a final."""
        self._drain()
        try:
            self._send_all()
        except Exception:
            logger.exception("output pump's last delivery failed")

    def _take(self, item: tuple) -> None:
        """Merge one queued output into the stream's pending one (a stream keeps its place in the order)."""
        request_id, new_ids, finish, error = item
        ids, _, prev_error = self._pending.get(request_id, ((), None, None))
        self._pending[request_id] = ([*ids, *new_ids], finish, error or prev_error)

    def _drain(self) -> list[str]:
        """Take everything queued into the pending outputs; the request ids taken."""
        taken = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return taken
            if item is not None:
                self._take(item)
                taken.append(item[0])

    def _is_urgent(self, request_id: str) -> bool:
        """Whether the stream's pending output holds its first tokens, its last ones or an error."""
        item = self._pending.get(request_id)
        if item is None:
            return False
        if item[1] is not None or item[2] is not None:
            return True
        stream = self._streams.get(request_id)
        return stream is not None and stream.last_output is None

    def _send_all(self) -> None:
        """Every pending output in one `_deliver` call, in arrival order."""
        merged, self._pending = self._pending, {}
        self._deliver(merged)

    def _send_round(self) -> None:
        """One response to each stream with output pending now, oldest first; firsts, lasts and errors ahead of
        the round, including those queued while it runs (module docstring), at most `URGENT_RUN` of them in a row
        before one of the round's own, and the round ends with its own: the urgent ones left go first in the next.
        (Served for as long as they came, a saturated pump serving short requests never left the round, each
        final's client sending its next request's first token into it, and the other streams' tokens waited: the
        stall watch, beaten only between rounds, ended a stub that was answering ~900 requests a second.)"""
        if not self._first_last:
            self._send_all()
            return
        due = list(self._pending)
        urgent = dict.fromkeys(rid for rid in due if self._is_urgent(rid))
        index = run = 0
        while self._is_running:
            while index < len(due) and due[index] not in self._pending:
                index += 1  # sent already, ahead of the round (an urgent one): not one of its own sends
            if urgent and (run < URGENT_RUN or index >= len(due)):
                request_id, run = next(iter(urgent)), run + 1
            elif index < len(due):
                request_id, index, run = due[index], index + 1, 0
            else:
                return
            urgent.pop(request_id, None)
            item = self._pending.pop(request_id, None)
            if item is None:
                continue  # sent already, ahead of the round
            self._deliver({request_id: item})
            if self._watch is not None:
                self._watch.beat()  # a round of slow sends is progress too (StallWatch re-arms once a second)
            if index < len(due):  # (once its own are sent, the round takes no more: it ends)
                urgent.update(dict.fromkeys(rid for rid in self._drain() if self._is_urgent(rid)))
            self._poll_cancellations()

    def _log_times(self) -> None:
        now = time.monotonic()
        if now - self.times.since < STATS_LOG_S:
            return
        if self.times.cycles:
            logger.info("[%s] %s", self._name, self.times.line(now))
        self.times = PumpTimes(since=now)

    def _deliver(self, merged: dict[str, tuple[list[int], FinishReason | None, str | None]]) -> None:
        for request_id, (new_ids, finish, error) in merged.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # already ended (e.g. a stop string matched before the engine saw the cancel)
            # A CANCELLED finish that reaches a stream still registered: a client's cancel unregisters its stream
            # first (the cancel poll, a stop string), so the engine stopped (shutdown). Its client gets a retryable
            # 503 rather than a normal end with a finish reason no OpenAI client knows.
            # Likewise for an error (its deadline, a failed step) after tokens that complete a stop string: the
            # answer was whole before it, and whether the pump had sent them first was only a race.
            if (finish is FinishReason.CANCELLED or error is not None) and self._ends_at_a_stop(stream, new_ids):
                continue
            if finish is FinishReason.CANCELLED and error is None:
                error = wire.SERVER_STOPPED
            if error is not None:
                self.unregister(request_id)
                if wire.error_class(error) is not None:  # a limit the client hit (deadline, queue wait)
                    logger.info("[%s] ended: %s", request_id, error)
                    stream.sink.send_error(error)
                else:
                    stream.sink.send_server_error(error)
                continue
            outputs, reason = stream.update(new_ids, finish)
            stream.record_latency(self.latency, _num_sent(outputs, new_ids))  # a stop string cuts what follows it
            self.times.responses += 1
            if reason is None:
                sending = time.perf_counter()
                stream.sink.send_chunk(outputs)
                self.times.send_s += time.perf_counter() - sending
                continue
            self.unregister(request_id)
            if finish is None:  # a stop string ended the stream: the engine is still decoding it
                self._engine.cancel(request_id)
            sending = time.perf_counter()
            stream.sink.send_final(outputs)
            self.times.send_s += time.perf_counter() - sending

    def _ends_at_a_stop(self, stream: Any, new_ids: list[int]) -> bool:
        """Tokens the engine made before it stopped, delivered with its stop: where they complete a stop string, the
        stream ends as it would have, and its client gets the whole answer rather than the retryable error."""
        if getattr(stream, "stops", None) is None or not new_ids:  # only text streams have stop strings
            return False
        outputs, reason = stream.update(new_ids, None)
        if reason is None:
            return False
        self.unregister(stream.request_id)
        stream.record_latency(self.latency, _num_sent(outputs, new_ids))
        stream.sink.send_final(outputs)
        return True

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        if now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + CANCEL_POLL_S
        started = time.perf_counter()
        with self._lock:
            streams = list(self._streams.values())
        if len(streams) > CANCEL_POLL_STREAMS:  # a slice per poll, so 256 streams are each asked every ~0.4 s
            start = self._poll_cursor % len(streams)
            streams = (streams + streams)[start:start + CANCEL_POLL_STREAMS]
            self._poll_cursor = start + CANCEL_POLL_STREAMS
        self.times.polls += 1
        self.times.polled += len(streams)
        for stream in streams:
            if stream.sink.is_closed or stream.sink.is_cancelled():
                logger.info("[%s] client cancelled; freeing its resources", stream.request_id)
                self.unregister(stream.request_id)
                stream.sink.send_final()  # flags only: nothing more reaches a cancelled request
                self._engine.cancel(stream.request_id)
        self.times.poll_s += time.perf_counter() - started


class _EveryShardBeats:
    """A stall watch shared by the pumps of a `ShardedOutputPump`: the watch is beaten once every shard has beaten
    since its last beat, so one stuck pump (a send that never returns) stops the re-arming as a lone pump would."""

    def __init__(self, watch: Any, shards: int) -> None:
        self._watch, self._shards = watch, shards
        self._lock = threading.Lock()
        self._seen: set[int] = set()

    def for_shard(self, shard: int) -> _ShardBeat:
        return _ShardBeat(self, shard)

    def beat(self, shard: int) -> None:
        with self._lock:
            self._seen.add(shard)
            if len(self._seen) < self._shards:
                return
            self._seen.clear()
        self._watch.beat()

    def stop(self) -> None:
        self._watch.stop()


@dataclass(slots=True)
class _ShardBeat:
    beats: _EveryShardBeats
    shard: int

    def beat(self) -> None:
        self.beats.beat(self.shard)

    def stop(self) -> None:
        self.beats.stop()


class ShardedOutputPump:
    """`MSTAR_PUMP_SHARDS` output pumps behind the calls the node makes of one (module docstring): each stream
    belongs to the pump its request id hashes to, and the pumps share one set of latency samples."""

    def __init__(self, engine: Any, shards: int, name: str = "output-pump", watch: Any = None) -> None:
        beats = None if watch is None else _EveryShardBeats(watch, shards)
        self.latency = LatencySamples()
        self.pumps = [OutputPump(engine, f"{name}-{k}", None if beats is None else beats.for_shard(k), self.latency)
                      for k in range(shards)]

    def _pump(self, request_id: str) -> OutputPump:
        return self.pumps[hash(request_id) % len(self.pumps)]

    def start(self) -> None:
        for pump in self.pumps:
            pump.start()

    def stop(self, timeout: float = 5.0) -> None:
        for pump in self.pumps:
            pump.stop(timeout)

    def register(self, stream: TextStream) -> None:
        self._pump(stream.request_id).register(stream)

    def unregister(self, request_id: str) -> None:
        self._pump(request_id).unregister(request_id)

    @property
    def num_streams(self) -> int:
        return sum(pump.num_streams for pump in self.pumps)

    def on_output(self, request_id: str, new_ids: list[int], finish: FinishReason | None, error: str | None) -> None:
        self._pump(request_id).on_output(request_id, new_ids, finish, error)


def enqueue(engine: Any, pump: Any, responder: Any, prompt_ids: list[int], params: Any, timeout_s: float | None,
            **extra: Any) -> None:
    """Hand a parsed request, whose stream `pump` already holds, to the engine; a refusal unregisters its stream
    and answers the client once (`responder`: backends.responder.Responder). A client that left while its request
    was parsed is cancelled here as well: the pump's cancel poll may have seen it before the engine held the id,
    and an engine drops a cancel for an id it does not hold, so the request would otherwise run to its end for no
    one, holding its KV pages, a batch slot and a place under the admission cap."""
    request_id = responder.request_id
    try:
        engine.add_request(request_id, prompt_ids, params, pump.on_output, timeout_s=timeout_s, **extra)
    except AdmissionRefused as exc:
        pump.unregister(request_id)
        logger.debug("[%s] refused: %s", request_id, exc)  # counted in mstar_requests_overloaded_total
        responder.send_error(exc.wire_message)
    except ValueError as exc:
        pump.unregister(request_id)
        responder.send_invalid(str(exc))
    except Exception as exc:  # noqa: BLE001 - one bad request must not take down the node
        pump.unregister(request_id)
        responder.send_server_error(exc)
    else:
        if responder.is_closed:  # closed by the poll (set before its own cancel) or already finished: a no-op then
            engine.cancel(request_id)


def make_output_pump(engine: Any, name: str = "output-pump", watch: Any = None) -> OutputPump | ShardedOutputPump:
    """One pump, or `MSTAR_PUMP_SHARDS` of them behind one face."""
    shards = pump_shards()
    if shards == 1:
        return OutputPump(engine, name, watch)
    logger.info("[%s] %d output pumps share the streams (MSTAR_PUMP_SHARDS)", name, shards)
    return ShardedOutputPump(engine, shards, name, watch)
