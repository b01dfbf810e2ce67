"""The stall watch (mstar_common/stall_watch.py): a component whose output pump or step loop stops is ended by
faulthandler's timer, with every thread's stack in the log, so the supervisor can restart it."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time

import pytest

from mstar_common.engine.output_pump import OutputPump
from mstar_common.stall_watch import StallWatch, stall_exit_s


class Engine:
    def __init__(self):
        self.num_steps = 0
        self.num_live = 0

    def cancel(self, request_id):
        pass


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _watch(engine, seconds=10.0):
    clock, armed, disarmed = Clock(), [], []
    watch = StallWatch(engine, seconds, "m", clock=clock, arm=lambda s, exit, file: armed.append((clock.now, s, exit)),
                       disarm=lambda: disarmed.append(clock.now))
    return watch, clock, armed, disarmed


def test_a_pump_that_beats_rearms_at_most_once_a_second_idle_or_busy():
    engine = Engine()
    watch, clock, armed, _ = _watch(engine)
    for _ in range(40):  # 40 beats 50 ms apart, nothing live: 2 s
        watch.beat()
        clock.now += 0.05
    assert [t for t, _, _ in armed] == pytest.approx([100.0, 101.0], abs=0.06)  # once a second
    assert all(seconds == 10.0 and exit_ for _, seconds, exit_ in armed)
    engine.num_live = 3
    for _ in range(200):  # busy and stepping for 10 s
        engine.num_steps += 1
        watch.beat()
        clock.now += 0.05
    assert 11 <= len(armed) <= 12 and not watch.is_stalled


def test_a_step_loop_that_stops_with_live_requests_is_left_to_the_timer(caplog):
    engine = Engine()
    engine.num_live = 2
    watch, clock, armed, _ = _watch(engine)
    with caplog.at_level(logging.WARNING):
        for _ in range(30):  # no step for 30 s, the pump still beating
            watch.beat()
            clock.now += 1.0
        last_arm = armed[-1][0]
        assert last_arm == pytest.approx(110.0) and watch.is_stalled  # the timer armed at 110 s fires at 120 s
        assert "the step loop has made no step in 11 s with 2 live requests" in caplog.text
        engine.num_steps += 1  # it resumes before the timer fires: armed again
        watch.beat()
        assert armed[-1][0] == clock.now and not watch.is_stalled
    assert "the step loop resumed" in caplog.text
    assert caplog.text.count("made no step") == 1


def test_the_switch(monkeypatch):
    engine = Engine()
    monkeypatch.delenv("MSTAR_STALL_EXIT_S", raising=False)
    monkeypatch.delenv("MSTAR_STACK_DUMP_S", raising=False)
    assert stall_exit_s() == 120.0 and StallWatch.from_env(engine, "m").seconds == 120.0
    monkeypatch.setenv("MSTAR_STALL_EXIT_S", "0")
    assert StallWatch.from_env(engine, "m") is None
    monkeypatch.setenv("MSTAR_STALL_EXIT_S", "30")
    monkeypatch.setenv("MSTAR_STACK_DUMP_S", "10")  # the periodic dumps own faulthandler's timer
    assert StallWatch.from_env(engine, "m") is None
    for bad in ("2", "soon", "-1", "7200"):
        monkeypatch.setenv("MSTAR_STALL_EXIT_S", bad)
        with pytest.raises(ValueError, match="MSTAR_STALL_EXIT_S=.*expected 0 \\(off\\) or seconds in \\[5, 3600\\]"):
            stall_exit_s()


def test_the_pump_beats_its_watch_and_disarms_it_when_stopped():
    engine = Engine()
    watch, clock, armed, disarmed = _watch(engine)
    pump = OutputPump(engine, watch=watch)
    pump.start()
    try:
        deadline = time.monotonic() + 5
        while not armed:
            assert time.monotonic() < deadline, "the idle pump never beat"
            time.sleep(0.01)
    finally:
        pump.stop()
    assert disarmed


def test_a_process_stuck_past_the_timer_exits_with_every_stack_in_its_log():
    """The real timer, in a child process: a thread stuck (here in a sleep, as in an interprocess wait) after
    the last beat; the process exits 1 within the watch's seconds and its stderr names the stuck frame."""
    script = textwrap.dedent("""
        import time
        from mstar_common.stall_watch import StallWatch

        class Engine:
            num_steps, num_live = 0, 0

        def stuck_in_a_send():
            time.sleep(30)

        StallWatch(Engine(), 1.0, "m").beat()
        stuck_in_a_send()
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 20
    assert "Timeout (0:00:01)!" in done.stderr and "stuck_in_a_send" in done.stderr
