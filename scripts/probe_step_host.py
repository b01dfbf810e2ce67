#!/usr/bin/env python3
"""The engine's own host work per step, with no model: what the step loop holds the GIL for, by rows.

    python scripts/probe_step_host.py [--rows 1 8 64] [--steps 300] [--prompt-len 512]

The real AREngine (scheduler, page allocator, step preparation, token collection, delivery through an output pump's
`on_output`) runs on the tiny Qwen3 checkpoint with the overlapped step path, but each step's model run is replaced
by a stand-in that returns a token per sampling row at once. `rows` requests with `--prompt-len`-token prompts are
prefilled first; then the mean wall time of a decode step is printed, per row count (the pump's queue is emptied
between steps, untimed, as its thread would). On the GPU the graph replay's
input fill (numpy, ~80 us at 64 rows) and the driver's launch come on top of this.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(rows: int, steps: int, prompt_len: int) -> dict:
    import torch

    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.model_runner import PendingStep
    from mstar_common.engine.output_pump import OutputPump
    from mstar_common.engine.types import EngineConfig, SamplingParams
    from mstar_common.families.qwen3.loader import load_qwen3
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(Path(tempfile.gettempdir()) / "mstar-probe-step-host" / "qwen3-tiny")
    model, hf_config = load_qwen3(checkpoint)
    vocab = int(hf_config["vocab_size"])
    max_len = prompt_len + steps + 64
    model.max_position_embeddings = max(model.max_position_embeddings, max_len)  # positions are never computed here
    page_size = 64
    pages = rows * (-(-max_len // page_size))
    config = EngineConfig(num_kv_pages=pages, page_size=page_size, max_num_seqs=rows,
                          max_batch_tokens=max(2048, rows), dtype="float32", device="cpu")
    engine = AREngine(model, config, [0], vocab, overlap=True)
    runner = engine.runner

    def launch(plan):  # the step's host preparation, then tokens at once instead of the model
        batch = runner.prepare(plan)
        return PendingStep(batch.sampling_seqs, torch.full((len(batch.sampling_seqs),), 5, dtype=torch.int64))

    runner.launch = launch
    pump = OutputPump(engine)  # its queue only: the pump's thread is not started
    prompt = [10 + (i % (vocab - 20)) for i in range(prompt_len)]
    for i in range(rows):
        engine.add_request(f"r{i}", list(prompt), SamplingParams(max_tokens=steps + 32, ignore_eos=True),
                           pump.on_output)
    while engine.scheduler.num_waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    taken = 0.0
    for _ in range(steps):
        _drain(pump)  # as the pump's thread would, outside the step's time (kept, its outputs would swell the heap)
        started = time.perf_counter()
        engine.step()
        taken += time.perf_counter() - started
    step_s = taken / steps
    engine.shutdown()
    return {"rows": rows, "steps": steps, "host_us_per_step": round(step_s * 1e6, 1),
            "us_per_row": round(step_s * 1e6 / rows, 2)}


def _drain(pump) -> None:
    import queue

    try:
        while True:
            pump._queue.get_nowait()
    except queue.Empty:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    for rows in args.rows:
        print(json.dumps(measure(rows, args.steps, args.prompt_len)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
