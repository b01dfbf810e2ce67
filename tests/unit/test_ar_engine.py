"""AREngine end to end on the tiny Qwen3: greedy parity with transformers `generate`, batching, chunked
prefill, paging, cancellation, admission refusals, stops, seeded sampling and failure isolation."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.types import AdmissionError, EngineConfig, FinishReason, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
from mstar_common.families.qwen3.tiny import build_tiny_checkpoint
from tests.unit import collectors

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 20
TINY_EOS_IDS = {0, 2}  # the tiny checkpoint's generation_config eos ids (<|endoftext|>, <|im_end|>)
TEXTS = [
    "Hi",
    "Hello, how are you today?",
    "Once upon a time there was a little robot who wanted to learn how to sing.",
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "Every morning it listened to the birds in the garden.",
    "Good night",
    "Numbers such as 1, 2, 3, 10, 42 and 2026 appear in text too.",
    "Please tell me a story about the sea, the mountains and the stars, and the robot.",
]


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    finals: list[tuple[FinishReason, str | None]] = field(default_factory=list)
    num_calls: int = 0
    num_late_calls: int = 0  # calls after the final one (must stay 0)


class Collector:
    """An `on_output` callback recording every call, keyed by request id."""

    def __init__(self) -> None:
        collectors.COLLECTORS.append(self)  # checked after the test (tests/unit/conftest.py)
        self.streams: dict[str, Stream] = {}
        self.lock = threading.Lock()
        self.all_done = threading.Condition(self.lock)

    def __call__(self, request_id, token_ids, finish_reason, error) -> None:
        with self.lock:
            stream = self.streams.setdefault(request_id, Stream())
            # Recorded, not asserted: the engine logs and swallows a callback's exceptions.
            stream.num_late_calls += bool(stream.finals)
            stream.num_calls += 1
            stream.tokens.extend(token_ids)
            if finish_reason is not None:
                stream.finals.append((finish_reason, error))
                self.all_done.notify_all()

    def reason(self, request_id: str) -> FinishReason:
        stream = self.streams[request_id]
        assert len(stream.finals) == 1 and stream.num_late_calls == 0
        return stream.finals[0][0]

    def wait(self, request_ids, timeout: float = 30.0) -> None:
        with self.lock:
            assert self.all_done.wait_for(
                lambda: all(self.streams.get(r) and self.streams[r].finals for r in request_ids), timeout)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.getbasetemp() / "qwen3_tiny")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model, config = load_qwen3(checkpoint)
    eos = read_eos_token_ids(checkpoint, config)
    assert set(eos) == TINY_EOS_IDS
    return model, eos, config["vocab_size"]


@pytest.fixture(scope="module")
def prompts(checkpoint) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts) -> list[list[int]]:
    """transformers greedy `generate`, one prompt at a time (stops at EOS, which it includes)."""
    hf = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    outputs = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


def make_engine(loaded, **overrides) -> AREngine:
    config = {"num_kv_pages": 128, "page_size": 4, "max_num_seqs": 8, "max_batch_tokens": 64, **overrides}
    return AREngine(loaded[0], EngineConfig(**config), eos_token_ids=loaded[1], vocab_size=loaded[2])


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def run_until_idle(engine: AREngine, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.step():
            break
    assert_pool_empty(engine)


def assert_pool_empty(engine: AREngine) -> None:
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_used_pages"] == stats["num_reserved_pages"] == 0
    assert stats["num_free_pages"] == engine.config.num_kv_pages


def assert_matches_reference(collector: Collector, reference, ids=None) -> None:
    for index in ids if ids is not None else range(len(reference)):
        stream, expected = collector.streams[str(index)], reference[index]
        assert stream.tokens == expected, f"request {index}"
        is_eos = expected[-1] in TINY_EOS_IDS
        assert stream.finals == [(FinishReason.STOP if is_eos else FinishReason.LENGTH, None)]
        assert stream.num_late_calls == 0
        assert stream.num_calls == len(expected)  # one token per call


def test_greedy_alone_matches_transformers(loaded, prompts, reference):
    lengths = [len(r) for r in reference]
    assert MAX_TOKENS in lengths and min(lengths) < MAX_TOKENS  # some hit EOS, some run to max_tokens
    engine, collector = make_engine(loaded), Collector()
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), ids, greedy(), collector)
        run_until_idle(engine)
    assert_matches_reference(collector, reference)


@pytest.mark.parametrize("overrides", [
    {},
    {"max_batch_tokens": 8, "page_size": 2},  # chunked prefill, many pages per sequence
    {"num_kv_pages": 50, "page_size": 2},  # the pool holds only a few requests: the rest queue for pages
    {"max_num_seqs": 3, "max_batch_tokens": 5, "page_size": 1},
])
def test_greedy_batched_matches_transformers(loaded, prompts, reference, overrides):
    engine, collector = make_engine(loaded, **overrides), Collector()
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(plan := schedule()) or plan
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), ids, greedy(), collector)
    run_until_idle(engine)
    assert_matches_reference(collector, reference)
    assert all(plan.num_tokens <= engine.config.max_batch_tokens for plan in plans)
    assert all(len(plan.chunks) <= engine.config.max_num_seqs for plan in plans)
    if engine.config.max_batch_tokens < max(len(p) for p in prompts):
        assert any(not chunk.is_sampling for plan in plans for chunk in plan.chunks), "no prefill was chunked"


def test_staggered_arrival_matches_transformers(loaded, prompts, reference):
    engine, collector = make_engine(loaded, max_batch_tokens=16, page_size=2), Collector()
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), ids, greedy(), collector)
        for _ in range(index % 3 + 1):  # the others arrive mid-prefill or mid-decode
            engine.step()
    run_until_idle(engine)
    assert_matches_reference(collector, reference)


def test_step_loop_thread_matches_transformers(loaded, prompts, reference):
    engine, collector = make_engine(loaded, max_batch_tokens=16), Collector()
    engine.start()
    try:
        for index, ids in enumerate(prompts):
            engine.add_request(str(index), ids, greedy(), collector)
        collector.wait([str(i) for i in range(len(prompts))])
    finally:
        engine.shutdown()
    assert not engine._thread.is_alive()
    assert_matches_reference(collector, reference)
    assert_pool_empty(engine)


def test_step_times_are_summed_and_logged_when_the_loop_goes_idle(loaded, prompts, reference, monkeypatch, caplog):
    """MSTAR_STEP_TIMES=1: the overlapped loop sums where each step's time went and logs it when it goes idle;
    the tokens are unchanged."""
    monkeypatch.setenv("MSTAR_STEP_TIMES", "1")
    engine, collector = AREngine(loaded[0], EngineConfig(num_kv_pages=128, page_size=4, max_num_seqs=8,
                                                         max_batch_tokens=16), eos_token_ids=loaded[1],
                                 vocab_size=loaded[2], overlap=True), Collector()
    assert engine.times is not None and engine.is_overlapped
    caplog.set_level("INFO", logger="mstar_common.engine.loop_times")
    engine.start()
    try:
        for index, ids in enumerate(prompts):
            engine.add_request(str(index), ids, greedy(), collector)
        collector.wait([str(i) for i in range(len(prompts))])
        deadline = time.monotonic() + 10
        while "step times]" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert_matches_reference(collector, reference)
    line = next(r.getMessage() for r in caplog.records if "step times]" in r.getMessage())
    steps = int(line.split("] ")[1].split(" steps")[0])
    assert 0 < steps <= engine.num_steps
    ms = {part: float(re.search(rf"\b{part} ([0-9.]+)", line).group(1))
          for part in ("schedule", "launch", "prepare", "replay", "wait", "deliver")}
    assert min(ms.values()) >= 0.0
    assert ms["prepare"] > 0.0 and ms["prepare"] + ms["replay"] <= ms["launch"]  # launch's parts, within it
    assert ms["replay"] == 0.0  # no graphs here: every step ran eager
    assert "gpu - ms" in line  # no device events on the CPU


def test_cancel_mid_generation_frees_pages_within_a_step(loaded, prompts):
    engine, collector = make_engine(loaded), Collector()
    engine.add_request("a", prompts[2], greedy(max_tokens=50, ignore_eos=True), collector)
    engine.add_request("b", prompts[1], greedy(max_tokens=50, ignore_eos=True), collector)
    for _ in range(5):
        engine.step()
    assert engine.stats()["num_used_pages"] > 0
    num_before = len(collector.streams["a"].tokens)
    engine.cancel("a")
    engine.cancel("a")  # twice: still one CANCELLED
    engine.cancel("nobody")
    engine.step()
    assert collector.streams["a"].finals == [(FinishReason.CANCELLED, None)]
    assert len(collector.streams["a"].tokens) == num_before
    assert engine.stats()["num_running"] == 1
    assert engine.stats()["num_reserved_pages"] == engine.allocator.pages_for(len(prompts[1]) + 50)
    run_until_idle(engine)
    assert collector.reason("b") is FinishReason.LENGTH
    engine.cancel("b")  # after its finish: ignored
    engine.step()
    assert collector.streams["b"].finals == [(FinishReason.LENGTH, None)]


def test_cancel_from_another_thread_while_the_loop_runs(loaded, prompts):
    engine, collector = make_engine(loaded), Collector()

    def cancel_after_three(request_id, token_ids, finish_reason, error):
        collector(request_id, token_ids, finish_reason, error)
        if len(collector.streams[request_id].tokens) == 3 and finish_reason is None:
            threading.Thread(target=engine.cancel, args=(request_id,)).start()

    engine.start()
    try:
        engine.add_request("x", prompts[1], greedy(max_tokens=400, ignore_eos=True), cancel_after_three)
        collector.wait(["x"])
    finally:
        engine.shutdown()
    assert collector.streams["x"].finals == [(FinishReason.CANCELLED, None)]
    assert 3 <= len(collector.streams["x"].tokens) < 400
    assert_pool_empty(engine)


def test_cancel_waiting_and_queued_requests(loaded, prompts):
    engine, collector = make_engine(loaded, num_kv_pages=12, page_size=4), Collector()
    engine.add_request("big", prompts[0], greedy(max_tokens=40, ignore_eos=True), collector)  # 11 pages
    engine.add_request("queued", prompts[1], greedy(), collector)
    engine.step()
    assert engine.stats()["num_waiting"] == 1  # no pages left for it
    engine.add_request("inbox", prompts[0], greedy(), collector)
    engine.cancel("queued")
    engine.cancel("inbox")
    engine.step()
    assert collector.streams["queued"].finals == [(FinishReason.CANCELLED, None)]
    assert collector.streams["inbox"].finals == [(FinishReason.CANCELLED, None)]
    assert collector.streams["queued"].tokens == collector.streams["inbox"].tokens == []
    run_until_idle(engine)
    assert collector.reason("big") is FinishReason.LENGTH


def test_shutdown_cancels_everything(loaded, prompts):
    idle = make_engine(loaded)
    idle.start()
    idle.shutdown()
    engine, collector = make_engine(loaded, num_kv_pages=40), Collector()
    for index, ids in enumerate(prompts[:4]):
        engine.add_request(str(index), ids, greedy(max_tokens=40, ignore_eos=True), collector)
    engine.step()
    assert engine.stats()["num_running"] == 2 and engine.stats()["num_waiting"] == 2  # by KV reservation
    engine.shutdown()
    assert all(collector.reason(str(i)) is FinishReason.CANCELLED for i in range(4))
    assert_pool_empty(engine)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("late", prompts[0], greedy(), collector)


def test_shutdown_from_a_callback_on_the_loop_thread(loaded, prompts):
    engine, collector = make_engine(loaded), Collector()

    def shut_down_at_two(request_id, token_ids, finish_reason, error):
        collector(request_id, token_ids, finish_reason, error)
        if len(collector.streams[request_id].tokens) == 2 and finish_reason is None:
            engine.shutdown()

    engine.start()
    engine.add_request("a", prompts[1], greedy(max_tokens=100, ignore_eos=True), shut_down_at_two)
    engine.add_request("b", prompts[2], greedy(max_tokens=100, ignore_eos=True), collector)
    collector.wait(["a", "b"])
    engine._thread.join(5.0)
    assert not engine._thread.is_alive()
    assert collector.reason("a") is collector.reason("b") is FinishReason.CANCELLED
    assert_pool_empty(engine)


def test_admission_refusals_name_the_field(loaded, prompts):
    engine, collector = make_engine(loaded, num_kv_pages=8, page_size=4, max_model_len=64), Collector()
    with pytest.raises(AdmissionError, match=r"max_tokens \(60\).*max_model_len \(64\)"):
        engine.add_request("long", prompts[1], greedy(max_tokens=60), collector)
    with pytest.raises(AdmissionError, match=r"needs 10 KV pages.*num_kv_pages \(8\)"):
        engine.add_request("big", [5] * 20, greedy(max_tokens=20), collector)
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        engine.add_request("empty", [], greedy(), collector)
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids in \[0, 447\], got 448"):
        engine.add_request("oov", [1, 448], greedy(), collector)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("top_p", [1, 2], SamplingParams(top_p=0.0), collector)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request("stop", [1, 2], greedy(stop_token_ids=[448]), collector)
    engine.add_request("ok", [1, 2], greedy(max_tokens=4), collector)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2], greedy(max_tokens=4), collector)
    run_until_idle(engine)
    assert set(collector.streams) == {"ok"}


def test_engine_config_refusals(loaded):
    with pytest.raises(ValueError, match=r"max_batch_tokens \(4\) must be >= max_num_seqs \(8\)"):
        make_engine(loaded, max_batch_tokens=4)
    with pytest.raises(ValueError, match=r"max_model_len \(513\) must be in \[1, 512\]"):
        make_engine(loaded, max_model_len=513)
    with pytest.raises(ValueError, match="dtype"):
        make_engine(loaded, dtype="bfloat16")  # the weights are float32


def test_stop_token_ids_and_ignore_eos(loaded, prompts, reference):
    """A stop token ends the output (included); ignore_eos runs past the EOS to max_tokens. The EOS is a token the
    greedy output reaches after the stop token (the tiny checkpoint's own EOS ids need not come up at all)."""
    index, expected = next((i, r) for i, r in enumerate(reference) if len(set(r[:8])) >= 6)
    stop = expected[3]
    cut = expected.index(stop) + 1
    eos = next(t for t in expected[cut:] if expected.index(t) >= cut)
    first = expected.index(eos)
    config = EngineConfig(num_kv_pages=128, page_size=4, max_num_seqs=8, max_batch_tokens=64)
    engine, collector = AREngine(loaded[0], config, eos_token_ids=[eos], vocab_size=loaded[2]), Collector()
    engine.add_request("stop", prompts[index], greedy(stop_token_ids=[stop]), collector)
    engine.add_request("eos", prompts[index], greedy(), collector)
    engine.add_request("ignore_eos", prompts[index], greedy(max_tokens=MAX_TOKENS + 5, ignore_eos=True), collector)
    engine.add_request("short", prompts[index], greedy(max_tokens=2), collector)
    run_until_idle(engine)
    assert collector.streams["stop"].tokens == expected[:cut]  # the stop token is included
    assert collector.reason("stop") is FinishReason.STOP
    assert collector.streams["eos"].tokens == expected[:first + 1] and collector.reason("eos") is FinishReason.STOP
    ignore = collector.streams["ignore_eos"]
    assert ignore.tokens[: len(expected)] == expected and len(ignore.tokens) == MAX_TOKENS + 5
    assert collector.reason("ignore_eos") is FinishReason.LENGTH
    assert collector.streams["short"].tokens == expected[:2] and collector.reason("short") is FinishReason.LENGTH


def test_seeded_sampling_is_reproducible(loaded, prompts):
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)

    def run(batch_mates: int, seed: int = 1234) -> list[int]:
        engine, collector = make_engine(loaded), Collector()
        engine.add_request("x", prompts[3], replace(sampled, seed=seed), collector)
        for index in range(batch_mates):  # unseeded neighbours must not disturb the seeded row
            engine.add_request(f"n{index}", prompts[index], SamplingParams(max_tokens=10, temperature=1.0), collector)
        run_until_idle(engine)
        return collector.streams["x"].tokens

    alone = run(0)
    assert len(alone) == 16
    assert run(0) == alone
    assert run(3) == alone
    assert run(0, seed=99) != alone


def test_a_failing_step_fails_its_requests_and_the_engine_recovers(loaded, prompts, reference):
    engine, collector = make_engine(loaded), Collector()
    engine.add_request("0", prompts[0], greedy(), collector)
    engine.add_request("1", prompts[1], greedy(), collector)
    engine.step()
    run = engine.runner.run
    engine.runner.run = lambda plan: (_ for _ in ()).throw(RuntimeError("boom /secret/path"))
    engine.step()
    engine.runner.run = run
    for rid in ("0", "1"):
        (reason, error), = collector.streams[rid].finals
        assert reason is FinishReason.ERROR and "error id" in error and "secret" not in error
    assert_pool_empty(engine)
    engine.add_request("2", prompts[2], greedy(), collector)
    run_until_idle(engine)
    assert collector.streams["2"].tokens == reference[2]


def test_a_raising_callback_fails_only_its_request(loaded, prompts, reference):
    engine, collector = make_engine(loaded), Collector()
    calls = []

    def broken(request_id, token_ids, finish_reason, error):
        calls.append((token_ids, finish_reason, error))
        if finish_reason is None:
            raise ConnectionError("client went away")

    engine.add_request("broken", prompts[4], greedy(), broken)
    engine.add_request("0", prompts[0], greedy(), collector)
    run_until_idle(engine)
    assert [c[1] for c in calls] == [None, FinishReason.ERROR]
    assert collector.streams["0"].tokens == reference[0]


def test_step_loop_survives_a_failing_step(loaded, prompts, reference):
    engine, collector = make_engine(loaded), Collector()
    schedule = engine.scheduler.schedule
    failures = iter([RuntimeError("scheduler bug")])

    def flaky():
        # Fail the first step that has a request to schedule (an idle pass must not use the failure up).
        error = next(failures, None) if engine.scheduler.waiting else None
        if error is not None:
            raise error
        return schedule()

    engine.scheduler.schedule = flaky
    engine.start()
    try:
        engine.add_request("0", prompts[0], greedy(), collector)
        collector.wait(["0"])
        assert collector.reason("0") is FinishReason.ERROR
        engine.add_request("1", prompts[1], greedy(), collector)
        collector.wait(["1"])
    finally:
        engine.shutdown()
    assert collector.streams["1"].tokens == reference[1]
    assert_pool_empty(engine)


def test_an_auto_pool_needs_a_gpu_and_an_engine_reports_its_pages_as_a_count(loaded):
    with pytest.raises(ValueError, match="'auto' sizes the pool from GPU memory; on cpu give a number of pages"):
        make_engine(loaded, num_kv_pages="auto")
    engine = make_engine(loaded, num_kv_pages=96)
    assert engine.config.num_kv_pages == 96 and engine.kv_cache.num_pages == 96


def test_a_step_whose_tokens_cannot_be_read_fails_its_prefill_rows_too(loaded, prompts, reference):
    """Overlapped: when reading a step's tokens fails, its KV is unknown for every row it ran, so a prompt whose
    prefill chunk was in it (a row that samples nothing) fails with the decode rows instead of carrying on over
    that KV, which the prefix cache would then also key for later prompts."""
    engine = make_engine(loaded, max_batch_tokens=8, page_size=2)
    engine.is_overlapped = True
    collector = Collector()
    engine.add_request("decode", prompts[0], greedy(max_tokens=40, ignore_eos=True), collector)
    for _ in range(3):
        engine.step()
    engine.add_request("prefill", prompts[4], greedy(), collector)  # 30+ tokens: chunks of 7 beside the decode
    launch = engine.runner.launch

    def unreadable(plan):
        pending = launch(plan)
        assert any(not chunk.is_sampling for chunk in plan.chunks)  # the long prompt's chunk samples nothing

        def tokens():
            raise RuntimeError("device fault")

        pending.tokens = tokens
        return pending

    engine.runner.launch = unreadable
    engine.step()  # launches the failing step
    engine.runner.launch = launch
    run_until_idle(engine)
    for rid in ("decode", "prefill"):
        (reason, error), = collector.streams[rid].finals
        assert reason is FinishReason.ERROR and "error id" in error, rid
    engine.add_request("after", prompts[4], greedy(), collector)  # and the engine serves on
    run_until_idle(engine)
    assert collector.streams["after"].tokens == reference[4]


class _LeftSink:
    """A client that left while its prompt was parsed (backends.responder.Responder as the pump sees it)."""

    def __init__(self, request_id: str):
        self.request_id, self.is_closed, self.sent = request_id, False, []

    def send_chunk(self, outputs):
        self.sent.append("chunk")

    def send_final(self, outputs=None):
        self.is_closed = True
        self.sent.append("final")

    def send_error(self, message):
        self.is_closed = True
        self.sent.append("error")

    def send_invalid(self, message):
        self.send_error(message)

    def send_server_error(self, exc):
        self.send_error(str(exc))
        return "id"

    def is_cancelled(self):
        return True


def test_a_cancel_polled_before_the_engine_holds_the_request_still_ends_it(loaded):
    """The node registers a stream with the pump, then hands the request to the engine. A cancel the pump's poll
    sent in between reached an engine that did not hold the id yet and was dropped: the request then decoded all
    its tokens for no one, holding its pages, a batch slot and a place under the cap."""
    from mstar_common.engine.detokenizer import IncrementalDetokenizer
    from mstar_common.engine.output_pump import OutputPump, TextStream, enqueue

    class Letters:
        def decode(self, ids, **_):
            return "x" * len(ids)

    engine = make_engine(loaded)
    pump = OutputPump(engine)  # not started: its cancel poll is driven here, in the order of the race
    sink = _LeftSink("r")
    pump.register(TextStream("r", sink, IncrementalDetokenizer(Letters()), None, 4))
    pump._poll_cancellations()  # unregisters the stream, sends the flags-only FINAL, cancels "r" in the engine
    engine.step()  # the engine takes that cancel before it holds "r"
    enqueue(engine, pump, sink, [5, 6, 7, 8], greedy(max_tokens=40, ignore_eos=True), timeout_s=None)
    steps = 0
    while engine.step():
        steps += 1
        assert steps < 40, "the cancelled request ran on"
    assert steps <= 1 and sink.sent == ["final"]
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_used_pages"] == 0
