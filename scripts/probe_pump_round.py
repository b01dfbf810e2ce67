#!/usr/bin/env python
"""The output pump in a closed loop with a modelled engine and modelled sends, no server: how the order of a
round (`MSTAR_PUMP_FIRST_LAST`) changes the busy rows, the time to first token and the tokens per response.

    python scripts/probe_pump_round.py [--streams 64] [--step-ms 2.6] [--send-ms 1.0] [--seconds 6]

The pump is the real one (mstar_common/engine/output_pump.py, with its TextStreams and detokenizer). The engine is
a thread that every `--step-ms` gives each running request one token (a request's first step is its prompt's,
which also gives one), and frees its row after `--output-len` tokens. Each send sleeps `--send-ms`: the time a
Triton send took at 64 streams on the H200 (0.99 ms, 2026-12-05, waiting for the server process and the GIL).
When a stream's last response is sent its client sends the next request `--client-ms` later, which the engine
admits at its next step. Printed per setting: the rows busy per step (of `--streams`), output tokens/s, time to
first token (request sent -> first response sent) and tokens per response. A model, not a measurement of the
server: it takes the send's cost as given and leaves out the GIL the step loop and the pump share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_common.bench.fusion import scoped_environment  # noqa: E402
from mstar_common.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from mstar_common.engine.output_pump import OutputPump, TextStream  # noqa: E402
from mstar_common.engine.types import FinishReason  # noqa: E402


class Letters:
    """A tokenizer whose every id is one letter."""

    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class Loop:
    """The modelled engine and clients around one real OutputPump."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pump = OutputPump(self)
        self.lock = threading.Lock()
        self.waiting: list[str] = []
        self.running: dict[str, int] = {}  # request id -> tokens given
        self.sent_at: dict[str, float] = {}
        self.ttft: list[float] = []
        self.rows: list[int] = []
        self.tokens = self.responses = self.count = 0
        self.measuring = False
        self.stopped = False

    def cancel(self, request_id: str) -> None:  # the pump's engine interface (stop strings; none here)
        pass

    def submit(self) -> None:
        request_id = f"r{self.count}"
        self.count += 1
        self.pump.register(TextStream(request_id, Sink(self, request_id), IncrementalDetokenizer(Letters()), None, 8))
        with self.lock:
            self.sent_at[request_id] = time.perf_counter()
            self.waiting.append(request_id)

    def on_sent(self, request_id: str, is_last: bool) -> None:
        """A response left the pump (the sink's send returned)."""
        now = time.perf_counter()
        sent = self.sent_at.pop(request_id, None)
        if sent is not None and self.measuring:
            self.ttft.append(now - sent)
        if self.measuring:
            self.responses += 1
        if is_last and not self.stopped:
            threading.Timer(self.args.client_ms / 1e3, self.submit).start()

    def run_engine(self) -> None:
        output_len = self.args.output_len
        while not self.stopped:
            started = time.perf_counter()
            with self.lock:
                for request_id in self.waiting:
                    self.running[request_id] = 0
                self.waiting.clear()
                outputs = []
                for request_id, given in list(self.running.items()):
                    given += 1
                    is_last = given == output_len
                    outputs.append((request_id, is_last))
                    if is_last:
                        del self.running[request_id]
                    else:
                        self.running[request_id] = given
            if self.measuring:
                self.rows.append(len(outputs))
                self.tokens += len(outputs)
            for request_id, is_last in outputs:
                self.pump.on_output(request_id, [1], FinishReason.LENGTH if is_last else None, None)
            time.sleep(max(0.0, self.args.step_ms / 1e3 - (time.perf_counter() - started)))


class Sink:
    def __init__(self, loop: Loop, request_id: str) -> None:
        self.loop, self.request_id = loop, request_id
        self.is_closed = False

    def _send(self, is_last: bool) -> None:
        time.sleep(self.loop.args.send_ms / 1e3)
        self.loop.on_sent(self.request_id, is_last)

    def send_chunk(self, outputs) -> None:
        self._send(False)

    def send_final(self, outputs=None) -> None:
        self.is_closed = True
        self._send(True)

    def send_error(self, message) -> None:
        raise AssertionError(message)

    def send_server_error(self, exc) -> str:
        raise AssertionError(exc)

    def is_cancelled(self) -> bool:
        return False


def measure(args: argparse.Namespace, first_last: str) -> dict:
    with scoped_environment({"MSTAR_PUMP_FIRST_LAST": first_last}):
        loop = Loop(args)  # the pump reads the switch when it is made
    loop.pump.start()
    engine = threading.Thread(target=loop.run_engine, daemon=True)
    engine.start()
    for _ in range(args.streams):
        loop.submit()
    time.sleep(args.warmup)
    loop.measuring, started = True, time.perf_counter()
    time.sleep(args.seconds)
    loop.measuring, span = False, time.perf_counter() - started
    loop.stopped = True
    engine.join()
    loop.pump.stop()
    ttft = sorted(loop.ttft)
    return {
        "rows_per_step": statistics.fmean(loop.rows),
        "tok_per_s": loop.tokens / span,
        "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2] if ttft else float("nan"),
        "tokens_per_response": loop.tokens / max(1, loop.responses),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=2.6)
    parser.add_argument("--send-ms", type=float, default=1.0)
    parser.add_argument("--client-ms", type=float, default=0.5)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--settings", nargs="+", default=["0", "1"], help="MSTAR_PUMP_FIRST_LAST values")
    args = parser.parse_args(argv)
    print(f"{args.streams} streams x {args.output_len} tokens, step {args.step_ms} ms, send {args.send_ms} ms, "
          f"client turnaround {args.client_ms} ms")
    for setting in args.settings:
        result = measure(args, setting)
        print(f"MSTAR_PUMP_FIRST_LAST={setting}: rows {result['rows_per_step']:.1f} of {args.streams}, "
              f"{result['tok_per_s']:,.0f} tok/s, TTFT p50 {result['ttft_ms_p50']:.1f} ms, "
              f"{result['tokens_per_response']:.1f} tokens a response")
    return 0


if __name__ == "__main__":
    sys.exit(main())
