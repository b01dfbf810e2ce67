"""scripts/probe_pump_round.py: the real output pump in a modelled closed loop. With sends of 2 ms and 16 streams a
round is ~32 ms; a first token sent ahead of the round waits for one send, so the time to first token falls by far
more than the timing noise of a loaded machine."""

from __future__ import annotations

import argparse
import os

from tests.scripts import load_script


def test_first_and_last_tokens_ahead_of_the_round_cut_the_wait_and_idle_rows():
    probe = load_script("probe_pump_round")
    args = argparse.Namespace(streams=16, output_len=32, step_ms=2.0, send_ms=2.0, client_ms=0.5, warmup=0.5,
                              seconds=1.5)
    before = os.environ.get("MSTAR_PUMP_FIRST_LAST")
    in_order, ahead = probe.measure(args, "0"), probe.measure(args, "1")
    assert os.environ.get("MSTAR_PUMP_FIRST_LAST") == before  # the switch is set only while the pump is made
    assert ahead["ttft_ms_p50"] * 3 < in_order["ttft_ms_p50"], (in_order, ahead)
    assert ahead["rows_per_step"] > in_order["rows_per_step"], (in_order, ahead)
    for result in (in_order, ahead):
        assert result["tokens_per_response"] > 1  # a round's sends outlast a step: tokens coalesce
