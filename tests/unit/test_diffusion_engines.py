"""The diffusion runtimes: the denoise loop batches rows of one layout at their own step indices, a new request
joins at its step 0, full batches rotate fairly, cancelled requests leave; the stateless batcher groups equal
shapes in arrival order; the step-graph buckets (eager replay on the CPU) give the eager step's result."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mstar_common.diffusion.batcher import BatchingEngine, Cancelled, Expired, StopCheck
from mstar_common.diffusion.denoise import DenoiseEngine, DenoiseJob


class RecordingStepper:
    """x <- x + dt (each row's own dt), recording every batch's (layout, step timesteps). When gated, every
    step signals `entered` and waits for `release`, so a test can act while the first step runs."""

    def __init__(self, gated: bool = False):
        self.calls: list[tuple[str, list[float]]] = []
        self.entered, self.release = threading.Event(), threading.Event()
        if not gated:
            self.release.set()

    def __call__(self, layout, latents, prompt, refs, timesteps, dts):
        self.entered.set()
        assert self.release.wait(5)
        self.calls.append((layout, timesteps.tolist()))
        return latents + dts[:, None, None]


class Result:
    def __init__(self):
        self.done = threading.Event()
        self.value = self.error = None

    def __call__(self, value, error):
        self.value, self.error = value, error
        self.done.set()


def job(name: str, layout: str, steps: int, rows: int = 1, start: float = 0.0) -> tuple[DenoiseJob, Result]:
    result = Result()
    timesteps = [float(1000 - 100 * i) for i in range(steps)]  # recognisable per step index
    sigmas = [1.0 - 0.1 * i for i in range(steps)] + [0.0]
    return DenoiseJob(name, layout, torch.full((rows, 2, 1), start), torch.zeros(rows, 3, 1), None, timesteps, sigmas,
                      result), result


def test_rows_step_together_each_at_its_own_index_and_newcomers_join():
    stepper = RecordingStepper(gated=True)
    engine = DenoiseEngine("test", stepper, max_rows=8)
    first, first_done = job("a", "64x64", steps=3)
    engine.submit(first)
    engine.start()
    assert stepper.entered.wait(5)  # the first request's step 0 is running alone
    late, late_done = job("b", "64x64", steps=2, rows=2)
    engine.submit(late)
    stepper.release.set()
    assert first_done.done.wait(5) and late_done.done.wait(5)
    engine.shutdown()
    # a: steps 0,1,2; b joins at its own step 0 while a is at step 1: that batch mixes step indices.
    assert stepper.calls[1] == ("64x64", [900.0, 1000.0, 1000.0])  # least recently stepped first, then by arrival
    assert sum(len(ts) for _, ts in stepper.calls) == 3 + 2 * 2
    assert torch.allclose(first_done.value, torch.full((1, 2, 1), -1.0))  # sum of its dts: 3 steps to sigma 0
    assert late_done.value.shape == (2, 2, 1) and torch.allclose(late_done.value, torch.full((2, 2, 1), -1.0))


def test_layouts_batch_separately_and_full_batches_rotate():
    stepper = RecordingStepper()
    engine = DenoiseEngine("test", stepper, max_rows=2)
    results = []
    for name, layout in (("a", "64x64"), ("b", "96x64"), ("c", "64x64"), ("d", "64x64")):
        j, r = job(name, layout, steps=2)
        engine.submit(j)
        results.append(r)
    engine.start()
    assert all(r.done.wait(5) for r in results)
    engine.shutdown()
    assert all(len(ts) <= 2 for _, ts in stepper.calls)  # max_rows
    assert {layout for layout, _ in stepper.calls} == {"64x64", "96x64"}
    # three 64x64 jobs, two rows per step: the one left out runs first next time, so nobody waits two turns
    assert sum(len(ts) for layout, ts in stepper.calls if layout == "64x64") == 6


def test_cancelled_request_leaves_the_batch():
    stepper = RecordingStepper(gated=True)
    engine = DenoiseEngine("test", stepper, max_rows=4)
    cancelled = threading.Event()
    j, result = job("a", "64x64", steps=50)
    j.is_cancelled = cancelled.is_set
    engine.submit(j)
    engine.start()
    assert stepper.entered.wait(5)
    cancelled.set()  # while step 0 runs
    stepper.release.set()
    assert result.done.wait(5)
    engine.shutdown()
    assert isinstance(result.error, Cancelled) and len(stepper.calls) == 1


def test_a_job_past_its_deadline_leaves_the_batch_as_expired_and_is_counted():
    """A StopCheck's deadline (the walk's time left, as the request's Triton timeout) ends a job at the next
    step with Expired, which the node answers deadline_exceeded; a client that goes away is still Cancelled."""
    stepper = RecordingStepper(gated=True)
    engine = DenoiseEngine("test", stepper, max_rows=4)
    late, late_result = job("a", "64x64", steps=50)
    gone, gone_result = job("b", "64x64", steps=50)
    client_gone = threading.Event()
    gone.is_cancelled = StopCheck(client_gone.is_set, 60.0)
    kept, kept_result = job("c", "64x64", steps=3)
    kept.is_cancelled = StopCheck(lambda: False, None)
    for j in (late, gone, kept):
        engine.submit(j)
    engine.start()
    assert stepper.entered.wait(5)
    # its deadline starts while step 0 runs: one started before the loop thread could pass first on a loaded machine
    late.is_cancelled = StopCheck(lambda: False, 0.05)
    time.sleep(0.1)  # step 0 outlasts the first job's deadline
    client_gone.set()
    stepper.release.set()
    assert late_result.done.wait(5) and gone_result.done.wait(5) and kept_result.done.wait(5)
    engine.shutdown()
    assert isinstance(late_result.error, Expired) and "deadline of 0.05 s at step 1" in str(late_result.error)
    assert isinstance(gone_result.error, Cancelled) and not isinstance(gone_result.error, Expired)
    assert kept_result.error is None
    assert engine.stats()["num_expired"] == 1
    assert [len(timesteps) for _, timesteps in stepper.calls] == [3, 1, 1]  # the two left after step 0


def test_the_batcher_drops_an_item_past_its_deadline_unrun():
    runs = []
    gate = threading.Event()

    def run_batch(payloads):
        gate.wait(5)
        runs.append(list(payloads))
        return payloads

    engine = BatchingEngine("test", run_batch, max_rows=1)
    first, late, on_time = Result(), Result(), Result()
    engine.submit("r0", 0, first)
    engine.submit("r1", 1, late, StopCheck(lambda: False, 0.05))
    engine.submit("r2", 2, on_time, StopCheck(lambda: False, 60.0))
    engine.start()
    time.sleep(0.1)  # the first batch holds the loop past r1's deadline
    gate.set()
    assert first.done.wait(5) and late.done.wait(5) and on_time.done.wait(5)
    engine.shutdown()
    assert runs == [[0], [2]]
    assert isinstance(late.error, Expired) and on_time.value == 2
    assert engine.stats()["num_expired"] == 1


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving():
    class Flaky(RecordingStepper):
        def __call__(self, layout, *args):
            if layout == "bad":
                raise RuntimeError("boom")
            return super().__call__(layout, *args)

    engine = DenoiseEngine("test", Flaky(), max_rows=4)
    bad, bad_result = job("a", "bad", steps=2)
    good, good_result = job("b", "good", steps=2)
    engine.submit(bad)
    engine.submit(good)
    engine.start()
    assert bad_result.done.wait(5) and good_result.done.wait(5)
    engine.shutdown()
    assert isinstance(bad_result.error, RuntimeError) and good_result.error is None


def test_too_many_rows_are_refused_at_submit():
    engine = DenoiseEngine("test", RecordingStepper(), max_rows=2)
    with pytest.raises(ValueError, match="batch limit of 2"):
        engine.submit(job("a", "x", steps=1, rows=3)[0])


def test_batcher_groups_equal_keys_in_arrival_order():
    batches = []

    def run_batch(payloads):
        batches.append(list(payloads))
        return [p * 10 for p in payloads]

    engine = BatchingEngine("test", run_batch, max_rows=2, key_of=lambda p: p % 2)
    results = [Result() for _ in range(5)]
    for value, result in zip([1, 2, 3, 5, 4], results, strict=True):
        engine.submit(f"r{value}", value, result)
    engine.start()
    assert all(r.done.wait(5) for r in results)
    engine.shutdown()
    assert batches == [[1, 3], [2, 4], [5]]
    assert [r.value for r in results] == [10, 20, 30, 50, 40]
    # the metrics' view (backends/metrics.py): 3 batches of 5 rows; graph runs as the component reports them
    assert engine.stats() == {"num_running": 0, "num_waiting": 0, "num_steps": 3, "num_rows_stepped": 5,
                              "num_expired": 0, "num_graph_steps": 0}
    engine.graph_replays = lambda: 2
    assert engine.stats()["num_graph_steps"] == 2


def test_step_graph_buckets_pad_rows_and_match_the_eager_step(tmp_path):
    pytest.importorskip("diffusers")
    from mstar_common.families.flux2_klein.components import DenoiseComponent, DenoiseLimits
    from mstar_common.families.flux2_klein.family import capture_denoise_graphs
    from mstar_common.families.flux2_klein.loader import load_transformer, scheduler_config
    from mstar_common.families.flux2_klein.options import Flux2KleinOptions
    from mstar_common.families.flux2_klein.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "tiny")
    limits = DenoiseLimits(multiple=16, max_area=65536, max_images=4, max_steps=50, default_steps=4)
    runtime = DenoiseComponent(load_transformer(checkpoint, "float32", "cpu"), scheduler_config(checkpoint), limits,
                               "cpu", max_batch=4)
    options = Flux2KleinOptions(capture_sizes=["64x48"], capture_batch_sizes=[1, 4], capture_edit_sizes=["64x48"])
    capture_denoise_graphs(runtime, options, capture=False)
    torch.manual_seed(0)
    for refs in (None, torch.randn(3, 12, 16)):
        layout = runtime.layout_for(64, 48, [(3, 4)] if refs is not None else [])
        args = (torch.randn(3, 12, 16), torch.randn(3, 512, 48), refs, torch.tensor([900.0, 500.0, 100.0]),
                torch.tensor([-0.1, -0.2, -0.3]))
        assert runtime.stepper.graphs.bucket_for(layout, 3).batch == 4
        eager = runtime.stepper.step_fn(layout)(*args)
        bucketed = runtime.stepper(layout, *args)
        assert bucketed.shape == eager.shape and torch.allclose(bucketed, eager, atol=1e-5)
    assert runtime.stepper.graphs.bucket_for(runtime.layout_for(64, 64), 1) is None  # uncaptured size: eager


@pytest.mark.gpu
def test_captured_step_buckets_are_timed_and_replay_the_eager_step(tmp_path):
    """On a GPU: the buckets are captured, each replay timed at capture (what rows_to_run weighs), and a padded
    replay equals the eager step."""
    pytest.importorskip("diffusers")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.families.flux2_klein.components import DenoiseComponent, DenoiseLimits
    from mstar_common.families.flux2_klein.family import capture_denoise_graphs
    from mstar_common.families.flux2_klein.loader import load_transformer, scheduler_config
    from mstar_common.families.flux2_klein.options import Flux2KleinOptions
    from mstar_common.families.flux2_klein.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "tiny")
    limits = DenoiseLimits(multiple=16, max_area=65536, max_images=4, max_steps=50, default_steps=4)
    runtime = DenoiseComponent(load_transformer(checkpoint, "float32", "cuda"), scheduler_config(checkpoint), limits,
                               "cuda", max_batch=4)
    capture_denoise_graphs(runtime, Flux2KleinOptions(capture_sizes=["64x48"], capture_batch_sizes=[1, 2, 4],
                                                      capture_edit_sizes=[]))
    layout = runtime.layout_for(64, 48)
    costs = runtime.stepper.graphs.costs[layout]
    assert sorted(costs) == [1, 2, 4] and all(t > 0 for t in costs.values())
    assert runtime.stepper.rows_to_run(layout, 3) in (2, 3)
    torch.manual_seed(0)
    args = (torch.randn(3, 12, 16, device="cuda"), torch.randn(3, 512, 48, device="cuda"), None,
            torch.tensor([900.0, 500.0, 100.0], device="cuda"), torch.tensor([-0.1, -0.2, -0.3], device="cuda"))
    with torch.no_grad():
        eager = runtime.stepper.step_fn(layout)(*args)
        replayed = runtime.stepper(layout, *args)
    assert runtime.stepper.graphs.num_replays == 1
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)


def test_want_png_rows_is_0_or_1():
    from mstar_common.diffusion import image_components

    assert image_components.wants_png_rows({}) is False
    assert image_components.wants_png_rows({"want_png_rows": torch.tensor([1], dtype=torch.int32)}) is True
    with pytest.raises(ValueError, match="want_png_rows: must be 0 or 1"):
        image_components.wants_png_rows({"want_png_rows": torch.tensor([2], dtype=torch.int32)})


def test_rows_to_run_steps_fewer_rows_exactly_when_padding_costs_more():
    """Per-row costs (large images): 12 waiting rows step 8 now rather than pad to 16; costs dominated by a fixed
    part (small images): all 12 pad to 16. Untimed layouts and rows above the largest bucket step as they are."""
    from mstar_common.diffusion.step_graphs import StepGraphs

    graphs = StepGraphs()
    graphs.costs["big"] = {1: 0.06, 2: 0.12, 4: 0.24, 8: 0.47, 16: 0.95}
    graphs.costs["small"] = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.018}
    assert [graphs.rows_to_run("big", rows) for rows in (1, 3, 8, 12, 16, 20)] == [1, 2, 8, 8, 16, 20]
    assert [graphs.rows_to_run("small", rows) for rows in (3, 12)] == [3, 12]
    assert graphs.rows_to_run("untimed", 12) == 12


def test_the_exact_batches_switch_names_the_variable(monkeypatch):
    from mstar_common.diffusion.step_graphs import exact_batches

    assert exact_batches()
    monkeypatch.setenv("MSTAR_DENOISE_EXACT_BATCHES", "0")
    assert not exact_batches()
    monkeypatch.setenv("MSTAR_DENOISE_EXACT_BATCHES", "yes")
    with pytest.raises(ValueError, match="MSTAR_DENOISE_EXACT_BATCHES='yes': expected 0 or 1"):
        exact_batches()


def test_the_engine_steps_no_more_rows_than_the_stepper_asks():
    class Bucketed(RecordingStepper):
        def rows_to_run(self, layout, rows):
            return 1 << (rows.bit_length() - 1)  # the largest power of two <= rows

    stepper = Bucketed()
    engine = DenoiseEngine("test", stepper, max_rows=8)
    results = []
    for name in "abcdef":  # six single-row jobs: steps of 4 and 2 rows, never 6
        j, r = job(name, "64x64", steps=3)
        engine.submit(j)
        results.append(r)
    engine.start()
    assert all(r.done.wait(5) for r in results)
    engine.shutdown()
    assert {len(ts) for _, ts in stepper.calls} <= {1, 2, 4}
    assert sum(len(ts) for _, ts in stepper.calls) == 6 * 3
    assert all(torch.allclose(r.value, torch.full((1, 2, 1), -1.0)) for r in results)


def test_a_shutdown_answers_the_running_jobs_and_the_ones_that_came_during_the_last_step():
    """The loop took new jobs only at the top of an iteration, so a denoise hop submitted during the last step was
    never answered: its walk waited for its deadline (or for ever without one), and the client got a 504 for a
    shutdown. Every job now ends ShuttingDown, which the node sends as a retryable unavailable:."""
    from mstar_common.diffusion.batcher import ShuttingDown

    stepper = RecordingStepper(gated=True)
    engine = DenoiseEngine("test", stepper, max_rows=4)
    running, running_done = job("a", "64x64", steps=50)
    engine.submit(running)
    engine.start()
    assert stepper.entered.wait(5)  # step 0 runs
    late, late_done = job("b", "64x64", steps=2)
    engine.submit(late)  # waits in the queue for the next iteration, which never comes
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    deadline = time.monotonic() + 10
    while not engine._is_stopped:  # the shutdown has begun (a fixed sleep was a guess on a loaded machine)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    stepper.release.set()
    stopper.join(10)
    assert running_done.done.wait(5) and late_done.done.wait(5)
    assert isinstance(running_done.error, ShuttingDown) and isinstance(late_done.error, ShuttingDown)
    assert "stopped before the request finished" in str(late_done.error)


def test_the_running_gauges_count_a_batch_being_computed_and_a_decode_after_the_denoise():
    """A batched component (text encoder, VAE, whisper encoder) reported no requests running: a batch being
    computed was out of the waiting list and in no count. A denoise request whose latents went on to the
    in-process decoder (vae_in_denoise) left the denoise component's running count, and its expiry there was
    counted only on the decoder, which exports nothing."""
    release, entered = threading.Event(), threading.Event()

    def run_batch(payloads):
        entered.set()
        assert release.wait(5)
        return payloads

    decoder = BatchingEngine("decoder", run_batch, max_rows=4)
    result = Result()
    decoder.submit("r0", 1, result)
    decoder.submit("r1", 2, Result())
    decoder.start()
    assert entered.wait(5)
    assert decoder.stats()["num_running"] == 2 and decoder.stats()["num_waiting"] == 0
    denoise = DenoiseEngine("test", RecordingStepper(), max_rows=2)
    denoise.companions.append(decoder)
    decoder.num_expired = 1  # as _finish counts one that its deadline ended in the decoder
    assert denoise.stats()["num_running"] == 2 and denoise.stats()["num_expired"] == 1
    release.set()
    assert result.done.wait(5)
    decoder.shutdown()
    assert decoder.stats()["num_running"] == 0


def test_a_job_of_more_images_than_a_smaller_batch_is_not_passed_over_by_younger_ones():
    """With captured batches of 1, 2, 4, 8 (the docs' replay times), an n=5 job beside an n=1 job made rows_to_run
    pick 4: the oldest job never fit, was skipped every iteration while the n=1 job stepped, and ran only once
    nothing smaller was left (under steady small requests, until its deadline)."""
    costs = {1: 0.041, 2: 0.082, 4: 0.164, 8: 0.342}

    class Captured(RecordingStepper):
        def rows_to_run(self, layout, rows):
            above = min((b for b in costs if b >= rows), default=None)
            below = max((b for b in costs if b < rows), default=None)
            if above is None or below is None or above == rows:
                return rows
            return below if below / costs[below] > rows / costs[above] else rows

    stepper = Captured(gated=True)
    engine = DenoiseEngine("test", stepper, max_rows=8)
    small, small_done = job("small", "64x64", steps=20)
    big, big_done = job("big", "64x64", steps=4, rows=5)
    engine.submit(small)
    engine.submit(big)
    engine.start()
    stepper.release.set()
    assert big_done.done.wait(5) and small_done.done.wait(5)
    engine.shutdown()
    big_steps = [i for i, (_, ts) in enumerate(stepper.calls) if len(ts) >= 5]
    assert len(big_steps) == 4 and big_steps[-1] < 12, stepper.calls  # interleaved, not after the 20 small steps


def test_rows_left_out_of_a_full_batch_are_not_passed_over_by_newer_requests():
    """A new job sorted ahead of every job that had stepped (last_run -1), also of the rows a full batch had left
    out: under steady arrivals those waited every iteration (one new job a step at max_rows 2: none of 20 finished).
    The loop body is driven by hand, one new one-row request before each iteration."""
    finished = []
    engine = DenoiseEngine("test", lambda layout, latents, prompt, refs, ts, dts: latents + dts[:, None, None],
                           max_rows=2)

    def submit(name):
        engine.submit(DenoiseJob(name, "64x64", torch.zeros(1, 2, 1), torch.zeros(1, 3, 1), None,
                                 [1000.0, 900.0, 800.0, 700.0], [1.0, 0.75, 0.5, 0.25, 0.0],
                                 lambda value, error, name=name: finished.append(name)))

    for name in ("old0", "old1", "old2"):
        submit(name)
    waits = {}
    for iteration in range(20):
        submit(f"new{iteration}")
        engine._admit(block=False)
        for layout, jobs in engine._schedule():
            engine._step(layout, jobs)
        for running in engine._running:
            waits[running.request_id] = iteration - running.last_run  # iterations since it last stepped
        engine._iteration += 1
    assert {"old0", "old1", "old2"} <= set(finished), finished
    assert max(waits.values()) <= 8, waits  # round robin over the running rows (the old jobs waited 19)


def test_a_finish_that_raises_fails_its_request_at_once():
    """Without an in-process decoder a job's latents go through the family's `finish` (a copy to the host, where an
    eager step's asynchronous CUDA error surfaces): one that raised was only logged, and the request went
    unanswered until the walk's deadline."""
    from mstar_common.diffusion.image_components import DenoiseComponent

    class Failing(DenoiseComponent):
        def __init__(self):
            self.engine = DenoiseEngine("test", lambda layout, x, prompt, refs, ts, dts: x + dts[:, None, None],
                                        max_rows=4)

        def parse(self, inputs):
            return DenoiseJob("", "64x64", torch.zeros(1, 2, 1), torch.zeros(1, 3, 1), None, [1000.0], [1.0, 0.0],
                              None)

        def finish(self, layout, latents):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    component = Failing()
    component.engine.start()
    result = Result()
    try:
        component.submit("r", {}, result)
        assert result.done.wait(5)
    finally:
        component.engine.shutdown()
    assert result.value is None and "illegal memory access" in str(result.error)


@pytest.mark.gpu
def test_dit_attention_calls_on_two_threads_keep_the_order_and_set_no_context():
    """test_flux2_config.py's order test on the GPU, through `attention.attention` itself (on the CPU it picks no
    backend, so that test could not see a per-call `sdpa_kernel` put back inside it): calls from eight threads with
    the context manager made to raise, the outputs equal to SDPA's own, and cuDNN first afterwards."""
    import subprocess
    import sys

    code = """
import threading, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
import torch.nn.attention as nn_attention

def no_context(*args, **kwargs):
    raise AssertionError("no per-call sdpa_kernel context")
nn_attention.sdpa_kernel = no_context  # before the import: a module-level `from ... import sdpa_kernel` sees it too
from mstar_common.diffusion import attention
torch.manual_seed(0)
q, k, v = (torch.randn(2, 96, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
want = F.scaled_dot_product_attention(*(t.permute(0, 2, 1, 3) for t in (q, k, v))).permute(0, 2, 1, 3).flatten(2, 3)
errors, outs = [], []
def call():
    try:
        for _ in range(20):
            outs.append(attention.attention(q, k, v))
        torch.cuda.synchronize()
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=call) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors[:2]
assert len(outs) == 160 and all((o.float() - want.float()).abs().max().item() < 2e-2 for o in outs)
assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.CUDNN_ATTENTION)
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "MSTAR_DIT_ATTENTION"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_thread_sends_at_most_a_bounded_number_of_new_shapes_to_cudnn(monkeypatch):
    """cuDNN keeps a plan per exact shape in a thread-local cache nothing bounds (and builds each for ~0.4 s):
    clients choose image sizes, so past CUDNN_EAGER_SHAPES new ones a thread goes to FlashAttention instead; a
    shape it sent before still goes to cuDNN, and another thread has its own count, as cuDNN's cache is per thread."""
    from mstar_common.diffusion import attention

    monkeypatch.setattr(attention, "_cudnn_shapes", threading.local())  # (this test's counts, not the process's)

    def shape(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(1, 4, n, 64, dtype=torch.bfloat16), torch.empty(1, 4, n + 512, 64, dtype=torch.bfloat16)

    def run() -> list[bool]:
        return [attention.cudnn_may_plan(*shape(n)) for n in range(attention.CUDNN_EAGER_SHAPES + 10)]

    verdicts, other = run(), []
    assert verdicts == [True] * attention.CUDNN_EAGER_SHAPES + [False] * 10
    assert attention.cudnn_may_plan(*shape(3)) and not attention.cudnn_may_plan(*shape(1000))
    thread = threading.Thread(target=lambda: other.extend(run()))
    thread.start()
    thread.join()
    assert other == verdicts
    q = torch.empty(1, 4, 8, 64, dtype=torch.bfloat16)
    assert attention.flash_can_run(q, q, q)
    assert not attention.flash_can_run(q.float(), q.float(), q.float())  # flash takes half precision only
    wide = torch.empty(1, 4, 8, 320, dtype=torch.bfloat16)
    assert not attention.flash_can_run(wide, wide, wide)
    # a graph's warm-ups and capture keep SDPA's order past the budget (spent above), nested or not
    new_shape = torch.empty(1, 4, 999, 64, dtype=torch.bfloat16)
    with attention.for_capture(), attention.for_capture():
        assert not attention._flash_instead_of_cudnn(new_shape, new_shape, new_shape)
    assert attention._cudnn_shapes.capture == 0


@pytest.mark.gpu
def test_dit_attention_past_the_cudnn_shape_budget_runs_flash_with_the_same_result(monkeypatch):
    """On the GPU: the first CUDNN_EAGER_SHAPES new shapes of a thread go through SDPA (cuDNN first), the later
    ones through FlashAttention, each equal to an fp32 reference; a captured call keeps SDPA's order."""
    from mstar_common.diffusion import attention

    monkeypatch.setattr(attention, "CUDNN_EAGER_SHAPES", 4)
    monkeypatch.setattr(attention, "_cudnn_shapes", threading.local())  # earlier GPU tests' shapes not counted
    flashed = []
    flash = attention.flash_attention
    monkeypatch.setattr(attention, "flash_attention", lambda *a: flashed.append(a[0].shape) or flash(*a))
    torch.manual_seed(0)
    for n in range(1, 9):
        q, k, v = (torch.randn(2, 16 * n, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        got = attention.attention(q, k, v).float()
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8.0
        want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).flatten(2, 3)
        assert (got - want).abs().max().item() < 3e-2, n
    assert len(flashed) == 4  # shapes 5-8 (the budget's 4 spent by 1-4; torch's probe call is no DiT shape)
    # a step captured as start-up captures (warm-ups and capture), at a shape new to the thread past the budget,
    # keeps SDPA's order throughout: its cuDNN plan is built in the warm-up, not inside the capture
    from mstar_common.diffusion.step_graphs import capture_graph

    q, k, v = (torch.randn(2, 16 * 9, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    graph, captured = capture_graph(lambda: attention.attention(q, k, v), None)
    graph.replay()
    torch.cuda.synchronize()
    assert len(flashed) == 4
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / 8.0
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).flatten(2, 3)
    assert (captured.float() - want).abs().max().item() < 3e-2
