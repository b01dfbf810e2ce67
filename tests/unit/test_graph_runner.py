"""The CUDA-graph step runner and the overlapped step loop, on the CPU.

`FakeGraph` re-runs each captured closure, and the graph-safe `torch_static` backend reads only the static
buffers, so these tests exercise what a replay does on a GPU (bucket choice, padding rows and tokens, the
device-side gather of pending tokens, launch-before-collect) and check the tokens against transformers.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.attention import TorchStaticAttention
from mstar_common.engine.capture_policy import GraphCaptureError
from mstar_common.engine.cuda_graph import (
    CudaGraphRunner,
    GraphConfig,
    default_decode_buckets,
    default_token_buckets,
)
from mstar_common.engine.types import EngineConfig, FinishReason, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
from tests.unit.test_ar_engine import (  # noqa: F401 - fixtures
    Collector,
    assert_pool_empty,
    checkpoint,
    greedy,
    prompts,
    reference,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def static_model(checkpoint):  # noqa: F811
    model, config = load_qwen3(checkpoint, attn_backend=TorchStaticAttention())
    return model, read_eos_token_ids(checkpoint, config), config["vocab_size"]


def make_engine(static_model, graphs: GraphConfig | None, overlap: bool, **overrides) -> AREngine:
    config = {"num_kv_pages": 128, "page_size": 4, "max_num_seqs": 8, "max_batch_tokens": 64, "max_model_len": 96,
              **overrides}
    model, eos, vocab = static_model
    return AREngine(model, EngineConfig(**config), eos_token_ids=eos, vocab_size=vocab, graphs=graphs,
                    overlap=overlap)


def run_all(engine: AREngine, prompts, params: SamplingParams, stagger: int = 0) -> Collector:  # noqa: F811
    collector = Collector()
    pending = list(enumerate(prompts))
    for step in range(10_000):
        while pending and (stagger == 0 or step % stagger == 0):
            index, ids = pending.pop(0)
            engine.add_request(str(index), ids, params, collector)
            if stagger:
                break
        if not engine.step() and not pending:
            break
    assert_pool_empty(engine)
    return collector


GRAPHS = GraphConfig(decode_buckets=[1, 2, 4, 8], token_buckets=[16, 64], capture_sampling=False)


@pytest.mark.parametrize(("overlap", "stagger"), [(False, 0), (True, 3)])
def test_replayed_steps_match_transformers(static_model, prompts, reference, overlap, stagger):  # noqa: F811
    engine = make_engine(static_model, GRAPHS, overlap)
    collector = run_all(engine, prompts, greedy(), stagger)
    for index, expected in enumerate(reference):
        assert collector.streams[str(index)].tokens == expected, index
        assert len(collector.streams[str(index)].finals) == 1
    assert engine.runner.graphs.num_replays > 0
    assert len(engine.runner.graphs.graphs) == 2 + 4


def test_overlapped_eager_steps_match_transformers(static_model, prompts, reference):  # noqa: F811
    collector = run_all(make_engine(static_model, None, overlap=True), prompts, greedy())
    assert [collector.streams[str(i)].tokens for i in range(len(reference))] == reference


def test_overlap_never_schedules_past_max_tokens(static_model, prompts):  # noqa: F811
    engine = make_engine(static_model, GRAPHS, overlap=True)
    collector = run_all(engine, prompts, greedy(max_tokens=5, ignore_eos=True))
    for index in range(len(prompts)):
        assert len(collector.streams[str(index)].tokens) == 5
        assert collector.reason(str(index)) is FinishReason.LENGTH


def test_step_times_split_the_steps_by_the_graph_that_ran(static_model, prompts, monkeypatch):  # noqa: F811
    """MSTAR_STEP_TIMES=1: each collected step is counted under the graph that ran it, (kind, size), or eager, with
    its packed tokens: every token the requests computed is counted once, no mixed step holds more tokens than its
    graph, and the logged line names the padding."""
    monkeypatch.setenv("MSTAR_STEP_TIMES", "1")
    engine = make_engine(static_model, GRAPHS, overlap=True)
    run_all(engine, prompts, greedy(max_tokens=5, ignore_eos=True), stagger=3)
    by_kind = engine.times.by_kind
    assert sum(record[0] for record in by_kind.values()) == engine.times.steps == engine.num_steps
    # each prompt computed once, then one token for each output but the last
    assert sum(record[1] for record in by_kind.values()) == sum(len(p) + 4 for p in prompts)
    kinds = {kind for kind, _ in by_kind}
    assert kinds <= {"decode", "mixed"} and {"decode", "mixed"} <= kinds
    for (kind, size), (steps, tokens, _, _) in by_kind.items():
        assert size in (GRAPHS.decode_buckets if kind == "decode" else GRAPHS.token_buckets)
        assert steps <= tokens <= steps * size, (kind, size)
    # the component's step counters (backends/metrics.py) agree: every step replayed, the padding is each graph's
    # size beyond its step's rows (decode) or tokens (mixed)
    stats = engine.stats()
    assert stats["num_graph_steps"] == engine.runner.graphs.num_replays == engine.num_steps
    assert stats["num_tokens_stepped"] == sum(record[1] for record in by_kind.values())
    assert stats["num_rows_stepped"] >= stats["num_graph_steps"]
    assert stats["num_tokens_stepped"] + stats["num_graph_padding_tokens"] == sum(
        record[0] * size for (_, size), record in by_kind.items())
    assert stats["num_graph_padding_tokens"] > 0  # prompts of a few tokens padded up to 16 or 64
    mixed = next((size, record) for (kind, size), record in by_kind.items() if kind == "mixed")
    line = engine.times.line(engine.times.since + 1.0)
    assert f"mixed {mixed[0]}: {mixed[1][0]} x - ms, {mixed[1][1] / mixed[1][0]:.0f} of {mixed[0]} tokens" in line
    # launch's split: every step replayed, so time was spent inside replay(), and prepare and replay lie within launch
    times = engine.times
    assert times.replay_s > 0.0 and times.prepare_s > 0.0
    assert times.prepare_s + times.replay_s <= times.launch_s

    eager = make_engine(static_model, None, overlap=True)
    run_all(eager, prompts, greedy(max_tokens=5, ignore_eos=True))
    assert eager.times.replay_s == 0.0 and 0.0 < eager.times.prepare_s <= eager.times.launch_s
    assert list(eager.times.by_kind) == [("eager", 0)]
    assert eager.times.by_kind[("eager", 0)][:2] == [eager.num_steps, sum(len(p) + 4 for p in prompts)]
    assert "by step: eager: " in eager.times.line(eager.times.since + 1.0)
    counts = eager.stats()
    assert counts["num_graph_steps"] == counts["num_graph_padding_tokens"] == 0
    assert counts["num_tokens_stepped"] == sum(len(p) + 4 for p in prompts)


def test_the_step_times_breakdown_puts_the_most_gpu_time_first():
    from mstar_common.engine.loop_times import LoopTimes

    class Event:
        def __init__(self, at_ms: float) -> None:
            self.at_ms = at_ms

        def elapsed_time(self, later: "Event") -> float:
            return later.at_ms - self.at_ms

    times = LoopTimes()
    for at, kind, tokens in [(0.0, ("decode", 64), 64), (2.0, ("decode", 64), 63), (7.0, ("mixed", 1024), 575),
                             (9.0, ("decode", 64), 64), (9.5, ("eager", 0), 3)]:
        times.launched(0.0, 0.0, 0.0)
        times.tokens_ready(Event(at), 0.0, kind, tokens)
    # the first step has no step before it to be timed from
    assert times.breakdown() == ("mixed 1024: 1 x 5.000 ms, 575 of 1024 tokens; decode 64: 3 x 2.000 ms; "
                                 "eager: 1 x 0.500 ms, 3 tokens")
    assert times.gpu_steps == 4 and times.gpu_ms == 9.5


def test_sampled_and_penalised_requests_fall_back_to_eager(static_model, prompts):  # noqa: F811
    engine = make_engine(static_model, GRAPHS, overlap=True)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, repetition_penalty=1.2, ignore_eos=True)
    first = run_all(engine, prompts[:3], params)
    second = run_all(make_engine(static_model, None, overlap=False), prompts[:3], params)
    assert [first.streams[str(i)].tokens for i in range(3)] == [second.streams[str(i)].tokens for i in range(3)]
    assert engine.runner.graphs.num_replays == 0


def test_default_buckets_cover_the_limits():
    assert default_decode_buckets(256)[:4] == [1, 2, 4, 8] and default_decode_buckets(256)[-1] == 256
    assert default_decode_buckets(5) == [1, 2, 4, 5]
    assert default_token_buckets(4096)[-1] == 4096 and default_token_buckets(100) == [64, 100]
    # past 256 rows (8,192 tokens) the ladders kept going: a 257-row step replayed the 1,024-row graph (4x padding)
    rows = default_decode_buckets(1024)
    assert rows[rows.index(256):] == [256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert all(b / a <= 1.5 for a, b in zip(rows[4:], rows[5:], strict=False))
    assert default_decode_buckets(3000)[-3:] == [2048, 2560, 3000]
    tokens = default_token_buckets(65536)
    assert tokens[tokens.index(8192):] == [8192, 12288, 16384, 24576, 32768, 49152, 65536]


def test_graph_capture_refuses_a_backend_that_cannot_be_captured(static_model, checkpoint):  # noqa: F811
    model, config = load_qwen3(checkpoint)  # the per-row reference backend
    with pytest.raises(ValueError, match="cannot be captured"):
        AREngine(model, EngineConfig(num_kv_pages=16, page_size=4), eos_token_ids=[0], vocab_size=config["vocab_size"],
                 graphs=GRAPHS)


def _out_of_memory_at(monkeypatch, buckets: set[tuple[str, int]]) -> None:
    """Make the capture of `buckets` ((kind, size)) raise CUDA's out-of-memory error."""
    real = CudaGraphRunner._capture_one

    def capture_one(self, key, pool):
        if key[:2] in buckets:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return real(self, key, pool)

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", capture_one)


def test_buckets_out_of_memory_at_capture_are_passed_over(static_model, prompts, reference, monkeypatch,  # noqa: F811
                                                          caplog):
    """Decode 2 and 8 and mixed 16 run out of memory: the engine starts, says so, and their steps take the next
    larger captured bucket (or run eager past the last) with the same tokens."""
    _out_of_memory_at(monkeypatch, {("decode", 2), ("decode", 8), ("mixed", 16)})
    with caplog.at_level(logging.WARNING):
        engine = make_engine(static_model, GRAPHS, overlap=True)
    graphs = engine.runner.graphs
    assert sorted(key[:2] for key in graphs.uncaptured) == [("decode", 2), ("decode", 8), ("mixed", 16)]
    assert "[cuda graphs] decode 2 not captured: out of GPU memory (CUDA out of memory" in caplog.text
    assert "[cuda graphs] [cuda graphs]" not in caplog.text
    assert len(graphs.graphs) == 3

    def batch(rows, tokens):
        return SimpleNamespace(needs_history=False, is_greedy=True, is_decode=rows == tokens, num_rows=rows,
                               num_tokens=tokens)

    picks = [graphs.pick(batch(rows, tokens)) for rows, tokens in ((1, 1), (2, 2), (3, 3), (5, 5), (2, 10), (9, 40))]
    assert picks == [("decode", 1, False), ("decode", 4, False), ("decode", 4, False), ("mixed", 64, False),
                     ("mixed", 64, False), None]  # 9 rows: more than max_num_seqs holds in a captured bucket
    collector = run_all(engine, prompts, greedy(), stagger=3)
    assert [collector.streams[str(i)].tokens for i in range(len(reference))] == reference
    assert graphs.num_replays > 0


def test_a_step_with_no_filtering_row_takes_the_temperature_alone_variant(static_model):
    """The sampling variants: greedy steps the argmax graph; a step whose sampling rows ask for no top-k, top-p
    or min-p the graph without the filters' launches (or the full sampler where that one was not captured); a
    step with one filtering row, greedy rows and top-k past the vocabulary aside, the full sampler."""
    from mstar_common.engine.cuda_graph import GREEDY, PLAIN, SAMPLED, CudaGraphRunner
    from mstar_common.engine.model_runner import HostBatch

    _, _, vocab = static_model
    graphs = make_engine(static_model, GRAPHS, overlap=False).runner.graphs
    graphs.config = GraphConfig(decode_buckets=[1, 2, 4, 8], token_buckets=[16, 64], capture_sampling=True)
    graphs.graphs = {key: None for key in CudaGraphRunner.keys(graphs) if key != ("decode", 4, PLAIN)}
    assert len(graphs.graphs) == 3 * 6 - 1

    def batch(*params, prompt=1):
        seqs = [SimpleNamespace(params=p) for p in params]
        return HostBatch(input_ids=[0] * (prompt * len(seqs)), query_lens=[prompt] * len(seqs), sampling_seqs=seqs)

    plain, hot = SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=vocab)
    picks = [graphs.pick(b) for b in (
        batch(greedy()), batch(plain, greedy(), hot), batch(plain, SamplingParams(temperature=0.7, top_p=0.9)),
        batch(SamplingParams(temperature=0.7, top_k=20)), batch(SamplingParams(temperature=1.0, min_p=0.05)),
        batch(greedy(), SamplingParams(temperature=0.0, top_k=5)), batch(plain, plain, plain),
        batch(plain, hot, prompt=5))]
    assert picks == [("decode", 1, GREEDY), ("decode", 4, SAMPLED), ("decode", 2, SAMPLED),  # no plain 4: sampled
                     ("decode", 1, SAMPLED), ("decode", 1, SAMPLED), ("decode", 2, GREEDY),
                     ("decode", 4, SAMPLED), ("mixed", 16, PLAIN)]
    picks = [graphs.pick(b) for b in (batch(plain, hot), batch(plain))]
    assert picks == [("decode", 2, PLAIN), ("decode", 1, PLAIN)]


def test_required_graphs_refuse_to_start_when_a_bucket_is_out_of_memory(static_model, monkeypatch):
    _out_of_memory_at(monkeypatch, {("decode", 4)})
    monkeypatch.setenv("MSTAR_REQUIRE_ACCELERATOR_GRAPHS", "1")
    with pytest.raises(GraphCaptureError, match=r"\[cuda graphs\] decode 4: CUDA graph capture ran out of GPU memory"):
        make_engine(static_model, GRAPHS, overlap=True)


def test_the_mirror_parity_flips_once_per_launched_replay(static_model, prompts, monkeypatch):  # noqa: F811
    """The host fills mirror `_parity` and, with zero-copy IO on a GPU, the graph reads the mirror its own counter
    names: both must flip exactly once per replay, and a step that fails before its replay flips neither."""
    engine = make_engine(static_model, GRAPHS, overlap=True)
    runner = engine.runner.graphs
    assert runner.zero_copy is False and runner.last_host_tokens is None  # the CPU copies; nothing published
    run_all(engine, prompts[:2], greedy(max_tokens=5))
    assert runner.num_replays > 0 and runner._parity == runner.num_replays % 2
    before = (runner._parity, runner.num_replays)

    def broken_fill(*args, **kwargs):
        raise RuntimeError("fill failed")

    monkeypatch.setattr(runner, "_fill", broken_fill)
    collector = run_all(engine, prompts[:1], greedy(max_tokens=3))
    assert collector.streams["0"].finals[0][0] == FinishReason.ERROR  # the step failed, the request with it
    assert (runner._parity, runner.num_replays) == before


def test_the_timing_inputs_give_each_row_pages_of_its_own_and_the_step_runs(static_model):
    """MSTAR_MID_GEMM=auto times a decode bucket's replays with every row reading up to 512 tokens of its own pages
    (the choice itself is timed on a GPU only): here pages of 4 tokens, 128 of them, 24 to a row at most."""
    import numpy as np

    from mstar_common.engine.cuda_graph import DECODE, GREEDY

    engine = make_engine(static_model, GRAPHS, overlap=False)
    runner = engine.runner.graphs
    key = (DECODE, 8, GREEDY)
    assert runner._fill_timing(key) == 64  # 128 pages // 8 rows = 16 pages a row
    host = runner.buffers.host_views(0)
    assert host["context_lens"][:8].tolist() == [64] * 8
    assert host["slot_mapping"][:8].tolist() == [runner.sink_slot] * 8
    width = runner.buffers.max_pages
    tables = [host["block_tables"][r * width: r * width + 16].tolist() for r in range(8)]
    assert sorted(np.concatenate(tables).tolist()) == list(range(128))  # every page once: no row shares one
    runner.graphs[key].replay()  # the CPU stand-in re-runs the step over those pages
    assert runner.buffers.out_tokens[:8].min() >= 0
    assert runner._fill_timing((DECODE, 1, GREEDY)) == 96  # one row: its block table's width (max_model_len 96)


def test_a_mixed_bucket_of_an_undecided_row_count_is_captured_after_the_choice(static_model, monkeypatch):
    """MSTAR_MID_GEMM=auto: where a token bucket has as many tokens as a decode bucket still to be timed, the mixed
    graph is captured after the decode bucket's choice, so both hold the projections the choice put on that many
    rows (eager steps of that many tokens run them too)."""
    from mstar_common.engine.cuda_graph import DECODE, GREEDY, MIXED

    engine = make_engine(static_model, GraphConfig([1, 2, 4, 8], [8, 64], capture_sampling=False), overlap=False)
    runner = engine.runner.graphs
    order = []
    real = runner._capture_one
    monkeypatch.setattr(runner, "_mid_rows_to_time", lambda: {8})
    monkeypatch.setattr(runner, "_capture_one", lambda key, pool: order.append(key) or real(key, pool))
    monkeypatch.setattr(runner, "_capture_choosing_mid",
                        lambda key, pool, what: order.append(("chose", key[1])) or real(key, pool))
    runner.capture()
    assert order.index(("chose", 8)) < order.index((MIXED, 8, GREEDY))
    assert order.index((MIXED, 64, GREEDY)) < order.index(("chose", 8))  # the others keep largest-first
    assert set(runner.graphs) == {(MIXED, 8, GREEDY), (MIXED, 64, GREEDY)} | {(DECODE, b, GREEDY) for b in (1, 2, 4)} \
        | {(DECODE, 8, GREEDY)}


@pytest.mark.parametrize("form, fold", [("cuBLAS", ""), ("mid_gemm", ""), ("cuBLAS", "auto"), ("mid_gemm", "auto"),
                                        ("mid_gemm with the folds", "auto")])  # the folds are timed only with auto
def test_auto_captures_each_form_times_them_and_keeps_the_chosen_graph(static_model, monkeypatch, fold, form):
    """MSTAR_MID_GEMM=auto captures a bucket on cuBLAS, then on mid_gemm, then (MSTAR_MID_GEMM_FOLD=auto) on
    mid_gemm with the folds, each capture under its own state of the model; it times them in one alternation and
    keeps the graph of the form `choose_mid_form` took from those times."""
    from mstar_common.engine.cuda_graph import DECODE, GREEDY

    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", fold)
    engine = make_engine(static_model, GRAPHS, overlap=False)
    runner = engine.runner.graphs
    state, captured, timed, chosen = {"on": False, "fold": False}, [], [], []
    monkeypatch.setattr("mstar_common.layers.linear.set_mid_rows",
                        lambda model, rows, on, fold=False: state.update(on=on, fold=fold))
    monkeypatch.setattr(runner, "_capture_one", lambda key, pool: captured.append(dict(state)) or len(captured))
    monkeypatch.setattr(runner, "_time_replays",
                        lambda key, graphs: timed.append(graphs) or (512, [1.3, 1.2, 1.1][:len(graphs)]))
    monkeypatch.setattr("mstar_common.layers.linear.choose_mid_form", lambda *a: chosen.append(a[2:]) or form)
    monkeypatch.setattr("mstar_common.layers.linear.default_gemv_cache", lambda: None)
    graph = runner._capture_choosing_mid((DECODE, 8, GREEDY), None, "[cuda graphs] decode 8")
    forms = [{"on": False, "fold": False}, {"on": True, "fold": False}] + [{"on": True, "fold": True}] * bool(fold)
    assert captured == forms and timed == [list(range(1, len(forms) + 1))]
    assert chosen == [(1.3, 1.2, None, 1.1)] if fold else chosen == [(1.3, 1.2, None)]
    assert graph == {"cuBLAS": 1, "mid_gemm": 2, "mid_gemm with the folds": 3}[form]


def test_a_failed_mid_gemm_timing_keeps_cublas_and_the_start_goes_on(static_model, monkeypatch, caplog):
    """Timing the two captures of a bucket is a speed choice: if the model's step cannot take the timing inputs,
    the cuBLAS graph is kept, nothing is stored, and the capture goes on."""
    from mstar_common.engine.cuda_graph import DECODE, GREEDY

    engine = make_engine(static_model, GRAPHS, overlap=False)
    runner = engine.runner.graphs
    captured = []
    monkeypatch.setattr(runner, "_capture_one", lambda key, pool: captured.append(key) or f"graph{len(captured)}")

    def broken(key, graphs):
        raise IndexError("no such slot")

    monkeypatch.setattr(runner, "_time_replays", broken)
    stored = []
    monkeypatch.setattr("mstar_common.layers.linear.choose_mid_form", lambda *a, **k: stored.append(a))
    with caplog.at_level(logging.WARNING):
        graph = runner._capture_choosing_mid((DECODE, 8, GREEDY), None, "[cuda graphs] decode 8")
    assert graph == "graph1" and len(captured) == 2 and not stored  # the cuBLAS capture, nothing chosen
    assert "timing mid_gemm against cuBLAS failed (IndexError: no such slot); cuBLAS kept" in caplog.text
