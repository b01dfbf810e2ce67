"""A CUDA-graph bucket that runs out of GPU memory at startup: dropped with a warning, or, with
`MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1`, a refusal to start (mstar_common/engine/capture_policy.py).

The out-of-memory error is raised by a stand-in for one bucket's capture, so this runs on the CPU; the AR engine's
case, with its bucket choice and served tokens, is in tests/unit/test_graph_runner.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mstar_common.engine.capture_policy import GraphCaptureError, capture_or_skip

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"


def _raise(exc):
    raise exc


def test_a_capture_that_fits_is_returned():
    assert capture_or_skip("decode 8", lambda: "graph") == "graph"


def test_out_of_memory_drops_the_bucket_with_a_warning_naming_it(caplog):
    with caplog.at_level(logging.WARNING, logger="mstar_common.engine.capture_policy"):
        assert capture_or_skip("decode 256", lambda: _raise(torch.OutOfMemoryError(OOM))) is None
    assert "decode 256 not captured: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB" in caplog.text
    assert "[cuda graphs] [cuda graphs]" not in caplog.text
    assert "MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1" in caplog.text


def test_required_graphs_refuse_to_start(monkeypatch):
    monkeypatch.setenv("MSTAR_REQUIRE_ACCELERATOR_GRAPHS", "1")
    with pytest.raises(GraphCaptureError, match=r"decode 256: CUDA graph capture ran out of GPU memory .*"
                                                r"MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1 requires every configured bucket"):
        capture_or_skip("decode 256", lambda: _raise(torch.OutOfMemoryError(OOM)))
    assert capture_or_skip("decode 8", lambda: "graph") == "graph"


def test_other_capture_failures_are_bugs_and_propagate():
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        capture_or_skip("decode 8", lambda: _raise(RuntimeError("operation not permitted when stream is capturing")))


def test_the_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("MSTAR_REQUIRE_ACCELERATOR_GRAPHS", "yes")
    with pytest.raises(ValueError, match="MSTAR_REQUIRE_ACCELERATOR_GRAPHS='yes'"):
        capture_or_skip("decode 8", lambda: _raise(torch.OutOfMemoryError(OOM)))


def test_denoise_buckets_out_of_memory_leave_their_rows_to_a_larger_bucket(monkeypatch):
    from mstar_common.diffusion import step_graphs

    real = step_graphs._Bucket

    def bucket(step_fn, shapes, batch, *args):
        if batch in (2, 8):
            raise torch.OutOfMemoryError(OOM)
        return real(step_fn, shapes, batch, *args)

    monkeypatch.setattr(step_graphs, "_Bucket", bucket)
    graphs = step_graphs.StepGraphs()
    shapes = step_graphs.StepShapes(num_tokens=4, channels=2, num_text=3, text_dim=2)
    graphs.capture({"square": (lambda **static: static["latents"], shapes)}, [1, 2, 4, 8], dtype=torch.float32,
                   device=torch.device("cpu"), capture=False)
    assert [graphs.bucket_for("square", rows).batch for rows in (1, 2, 3, 4)] == [1, 4, 4, 4]
    assert graphs.bucket_for("square", 5) is None  # the 8-row bucket is gone: eager


def test_whisper_encoder_buckets_out_of_memory_are_dropped(monkeypatch):
    from mstar_common.families.whisper import encoder_graphs

    real = encoder_graphs._Bucket

    def bucket(forward, batch, *args):
        if batch == 4:
            raise torch.OutOfMemoryError(OOM)
        return real(forward, batch, *args)

    monkeypatch.setattr(encoder_graphs, "_Bucket", bucket)
    graphs = encoder_graphs.EncoderGraphs(lambda pcm: pcm * 2, (3,), [1, 2, 4, 8], "cpu", capture=False)
    assert graphs.batches == [1, 2, 8]
    pcm = torch.ones(3, 3)
    assert torch.equal(graphs.run(pcm), pcm * 2)  # three rows take the 8-row bucket
    assert graphs.num_replays == 1  # the encoder's mstar_graph_steps_total (it stayed 0 while graphs ran)
    assert graphs.run(torch.ones(9, 3)) is None and graphs.num_replays == 1  # past every bucket: eager


@pytest.mark.gpu
def test_an_out_of_memory_inside_a_capture_leaves_the_pool_and_the_gpu_usable():
    """The real case on a GPU: the allocator runs out inside `torch.cuda.graph` (the warm-ups fit). The bucket is
    dropped, and the next bucket captures into the same pool and replays correctly."""
    from mstar_common.diffusion.step_graphs import capture_graph

    pool = torch.cuda.graph_pool_handle()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory

    def too_big():
        if torch.cuda.is_current_stream_capturing():
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        return x * 2

    assert capture_or_skip("mixed 4096", lambda: capture_graph(too_big, pool)) is None
    graph, out = capture_or_skip("decode 8", lambda: capture_graph(lambda: x * 3 + 1, pool))
    x.copy_(torch.full_like(x, 2.0))
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [7.0] * 8


@pytest.fixture(scope="module")
def tiny_engine_graphs(tmp_path_factory):
    """The graph runner of a tiny Qwen3 engine on the CPU (static-shape attention: capturable there)."""
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import TorchStaticAttention
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path_factory.mktemp("q") / "qwen3")
    model, config = load_qwen3(checkpoint, attn_backend=TorchStaticAttention())
    return model, config, checkpoint, lambda graphs: AREngine(
        model, EngineConfig(num_kv_pages=128, page_size=4, max_num_seqs=8, max_batch_tokens=64, max_model_len=96),
        eos_token_ids=read_eos_token_ids(checkpoint, config), vocab_size=config["vocab_size"], graphs=graphs,
        overlap=False)


@pytest.mark.parametrize("required", ["0", "1"])
def test_a_faster_copy_of_a_captured_bucket_that_runs_out_of_memory_leaves_the_bucket_its_graph(
        tiny_engine_graphs, monkeypatch, caplog, required):
    """MSTAR_MID_GEMM=auto captures a decode bucket on cuBLAS, then a mid_gemm copy to time against it. The copy
    running out of memory refused the start under MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1 ("requires every configured
    bucket", which was captured) and otherwise warned that the bucket's steps "take a larger bucket or run eager"."""
    from mstar_common.engine.cuda_graph import DECODE, GREEDY, GraphConfig
    from mstar_common.layers import linear

    runner = tiny_engine_graphs[3](GraphConfig([1, 2], [16], False)).runner.graphs
    mid_on = {"value": False}
    monkeypatch.setattr(linear, "set_mid_rows", lambda model, rows, on, fold=False: mid_on.update(value=on))
    monkeypatch.setattr(runner, "_capture_one", lambda key, pool: _raise(torch.OutOfMemoryError(OOM))
                        if mid_on["value"] else "cublas graph")
    monkeypatch.setenv("MSTAR_REQUIRE_ACCELERATOR_GRAPHS", required)
    with caplog.at_level(logging.WARNING, logger="mstar_common.engine.capture_policy"):
        assert runner._capture_choosing_mid((DECODE, 8, GREEDY), None, "[cuda graphs] decode 8") == "cublas graph"
    assert "decode 8 (mid_gemm) not captured: out of GPU memory" in caplog.text
    assert "the bucket keeps its cuBLAS graph" in caplog.text and "run eager" not in caplog.text


def test_the_capture_summary_names_the_sampling_variants_it_lost(tiny_engine_graphs, monkeypatch, caplog):
    """The summary listed `decode 4` twice where only its two sampling variants ran out of memory (its greedy
    graph was captured), as if the whole bucket were missing."""
    from mstar_common.engine.cuda_graph import PLAIN, SAMPLED, CudaGraphRunner, GraphConfig

    real = CudaGraphRunner._capture_one

    def capture(self, key, pool):
        if key in {("decode", 4, SAMPLED), ("decode", 4, PLAIN)}:
            raise torch.OutOfMemoryError(OOM)
        return real(self, key, pool)

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", capture)
    with caplog.at_level(logging.INFO, logger="mstar_common.engine.cuda_graph"):
        graphs = tiny_engine_graphs[3](GraphConfig([1, 2, 4], [16], True)).runner.graphs
    assert ("decode", 4, 0) in graphs.graphs
    assert ("not captured (out of GPU memory): ['decode 4 (sampling)', 'decode 4 (sampling, temperature alone)']"
            in caplog.text), caplog.text
