"""Where an engine's step loop spends its time, with `MSTAR_STEP_TIMES=1` (off by default: it adds timing events).

Summed over a busy stretch of steps and logged when the loop goes idle (or every `LOG_S` while busy), per step:
intake and scheduling, preparing and launching the step (graph replay or eager), blocking on the device for a step's
tokens, and handing the tokens to the streams. `launch` is split further: `prepare` (the step's host-side inputs,
Python; a wait for the GIL there counts too), and `replay` (inside the graph's `replay()`: the driver's
`cudaGraphLaunch`, with the GIL released, and getting the GIL back after it, which a busy output pump can hold for
up to the switch interval); the rest of `launch` is filling the graph's input buffers, or the whole eager step. With
overlap, `gpu` is the device time between the token events of consecutive steps: what a step costs on the GPU as
served (a step's kernels plus anything the device waits for between them). Where `wait` is near zero the host is the
bottleneck; where `gpu` exceeds a captured step's replay time (scripts/ab_decode_step.py), the device waited on the
host.

The line then splits the steps by what ran (`by step`): each captured graph (`decode 64`, `mixed 1024`) or `eager`,
with its count, its mean GPU time, and for a mixed graph the mean packed tokens against the graph's size, the
padding every such replay computes too: `mixed 1024: STEPS x MS ms, TOKENS of 1024 tokens`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from mstar_common.config import env_switch

logger = logging.getLogger(__name__)

LOG_S = 10.0


def enabled() -> bool:
    return env_switch("MSTAR_STEP_TIMES", False)


@dataclass(slots=True)
class LoopTimes:
    steps: int = 0
    schedule_s: float = 0.0
    launch_s: float = 0.0
    prepare_s: float = 0.0  # of launch_s: ModelRunner.prepare
    replay_s: float = 0.0  # of launch_s: inside a graph's replay()
    wait_s: float = 0.0
    deliver_s: float = 0.0
    gpu_ms: float = 0.0
    gpu_steps: int = 0
    since: float = field(default_factory=time.perf_counter)
    last_event: object = None  # the previous collected step's token event (gpu intervals)
    # (kind, size) of what ran -> [steps, packed tokens, gpu ms, steps with a gpu time]
    by_kind: dict[tuple[str, int], list] = field(default_factory=dict)

    def launched(self, started: float, launched: float, done: float, prepare_s: float = 0.0,
                 replay_s: float = 0.0) -> None:
        """A step was scheduled from `started` to `launched` and launched by `done` (perf_counter seconds), of which
        `prepare_s` preparing its inputs and `replay_s` inside a graph's replay."""
        if self.steps == 0:
            self.since = started
        self.steps += 1
        self.schedule_s += launched - started
        self.launch_s += done - launched
        self.prepare_s += prepare_s
        self.replay_s += replay_s

    def tokens_ready(self, event, waited_s: float, kind: tuple[str, int] = ("eager", 0), num_tokens: int = 0) -> None:
        """A step's tokens were read after blocking `waited_s`; with its event, the device time since the previous
        step's tokens. `kind`: the graph that ran, (kind, size), or ("eager", 0); `num_tokens`: the step's packed
        tokens."""
        self.wait_s += waited_s
        record = self.by_kind.setdefault(kind, [0, 0, 0.0, 0])
        record[0] += 1
        record[1] += num_tokens
        if event is None:
            return
        if self.last_event is not None:
            ms = self.last_event.elapsed_time(event)
            self.gpu_ms += ms
            self.gpu_steps += 1
            record[2] += ms
            record[3] += 1
        self.last_event = event

    def breakdown(self) -> str:
        """The steps by what ran, the most GPU time first (see the module's doc)."""
        parts = []
        for (kind, size), (steps, tokens, gpu_ms, gpu_steps) in sorted(
                self.by_kind.items(), key=lambda item: (-item[1][2], -item[1][0])):
            gpu = f"{gpu_ms / gpu_steps:.3f} ms" if gpu_steps else "- ms"
            part = f"{kind} {size}: {steps} x {gpu}" if size else f"{kind}: {steps} x {gpu}"
            if kind != "decode" and steps:
                part += f", {tokens / steps:.0f} of {size} tokens" if size else f", {tokens / steps:.0f} tokens"
            parts.append(part)
        return "; ".join(parts)

    def line(self, now: float) -> str:
        per = 1e3 / max(1, self.steps)
        span_ms = (now - self.since) * 1e3
        gpu = f"{self.gpu_ms / self.gpu_steps:.3f}" if self.gpu_steps else "-"
        return (f"{self.steps} steps in {span_ms:.0f} ms, {span_ms / max(1, self.steps):.3f} ms each: schedule "
                f"{self.schedule_s * per:.3f}, launch {self.launch_s * per:.3f} (prepare "
                f"{self.prepare_s * per:.3f}, replay {self.replay_s * per:.3f}), wait {self.wait_s * per:.3f}, "
                f"deliver {self.deliver_s * per:.3f}; gpu {gpu} ms per step"
                + (f"; by step: {self.breakdown()}" if self.by_kind else ""))

    def maybe_log(self, name: str, idle: bool) -> LoopTimes:
        """Log and start over when the loop went idle after steps, or every LOG_S; returns the live record."""
        now = time.perf_counter()
        if not self.steps or not (idle or now - self.since >= LOG_S):
            return self
        logger.info("[%s step times] %s", name, self.line(now))
        return LoopTimes()
