"""The captured steps' input buffers (engine/cuda_graph.py `StepBuffers`): one flat byte buffer with typed views,
moved to the device as one prefix copy; and the token readback keeping the tokens' dtype, or reading tokens a graph
published itself (engine/model_runner.py `TokenReadback`, on the GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_common.engine.cuda_graph import StepBuffers


def _filled(buffers: StepBuffers, parity: int, rows: int) -> dict[str, np.ndarray]:
    host = buffers.host_views(parity)
    rng = np.random.default_rng(rows + parity)
    for view in host.values():
        view[:] = rng.integers(1, 1000, view.shape) if view.dtype.kind == "i" else rng.random(view.shape)
    return host


def test_a_step_copy_moves_the_prefix_up_to_the_rows_in_use():
    buffers = StepBuffers(max_rows=8, max_tokens=32, max_pages=5, device=torch.device("cpu"))
    assert buffers.views["seeds"].dtype == torch.int64 and buffers.views["temperature"].dtype == torch.float32
    assert buffers.views["input_ids"].dtype == torch.int32 and buffers.views["block_tables"].shape == (8, 5)
    starts = [buffers.views[name].data_ptr() - buffers.raw_device.data_ptr() for name in ("seeds", "temperature",
                                                                                         "input_ids")]
    assert starts[0] == 0 and all(start % 8 == 0 for start in starts)  # regions in copy order, aligned
    host = _filled(buffers, parity=1, rows=3)
    buffers.copy_in(1, num_rows=3)
    for name, view in host.items():
        got = buffers.views[name].numpy().reshape(-1)
        want = view.reshape(-1)
        if name == "block_tables":  # only the rows in use
            got, want = got[:3 * 5], want[:3 * 5]
        assert np.array_equal(got, want), name
    assert not buffers.views["block_tables"][3:].any()  # the rows past the step's stay as they were


def test_the_input_prefix_and_the_mirrors():
    buffers = StepBuffers(max_rows=4, max_tokens=16, max_pages=3, device=torch.device("cpu"))
    end = buffers.input_bytes(2)
    block_tables = buffers.views["block_tables"]
    assert end == block_tables[2:].data_ptr() - buffers.raw_device.data_ptr()  # up to the third row's table
    assert buffers.host_pair.shape == (2, buffers.raw_device.numel())
    assert buffers.parity.tolist() == [0] and buffers.host_tokens.shape == (2, 4)
    _filled(buffers, parity=1, rows=4)
    assert not torch.equal(buffers.raw_host[0], buffers.raw_host[1])
    buffers.mirror(1)
    assert torch.equal(buffers.raw_host[0], buffers.raw_host[1])


@pytest.mark.gpu
@pytest.mark.parametrize("native", ["1", "0"])
def test_the_readback_keeps_the_tokens_dtype_unless_told(monkeypatch, native):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.engine.model_runner import TokenReadback

    monkeypatch.setenv("MSTAR_READBACK_NATIVE", native)
    readback = TokenReadback(16, torch.device("cuda"))
    for dtype in (torch.int32, torch.int64, torch.int32):
        tokens = torch.arange(5, dtype=dtype, device="cuda") * 7
        pending = readback.start([None] * 3, tokens)
        assert pending._tokens.dtype == (dtype if native == "1" else torch.int64)
        assert pending.tokens() == [0, 7, 14]
    published = torch.tensor([4, 5], dtype=torch.int32).pin_memory()  # a graph's own page-locked tokens
    pending = readback.start([None] * 2, tokens, published)
    assert pending._tokens is published and pending.tokens() == [4, 5]


@pytest.mark.gpu
def test_a_step_of_more_rows_than_the_readback_holds_gets_a_larger_pair():
    """The pinned pair was 4,096 rows whatever max_concurrent_requests allowed: a step of more sampling rows (or
    more scores) raised in `copy_` and failed every row of the step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mstar_common.engine.model_runner import TokenReadback

    readback = TokenReadback(4, torch.device("cuda"))
    small = readback.start([None] * 3, torch.arange(3, device="cuda"))
    big = readback.start([None] * 9, torch.arange(9, device="cuda") * 2, floats=torch.ones(20, device="cuda"))
    assert small.tokens() == [0, 1, 2] and big.tokens() == [2 * i for i in range(9)]
    assert readback.start([None] * 2, torch.arange(2, device="cuda") + 5).tokens() == [5, 6]


@pytest.mark.parametrize("name", ["MSTAR_ZERO_COPY_STEP_IO", "MSTAR_READBACK_NATIVE", "MSTAR_EMBED_KERNEL"])
def test_the_step_io_and_embedding_switches_refuse_a_bad_value_by_name(monkeypatch, name):
    from mstar_common.engine.cuda_graph import zero_copy_step_io
    from mstar_common.engine.model_runner import TokenReadback
    from mstar_common.layers.causal_lm import DecoderOnlyLM
    from mstar_common.layers.decoder import DecoderLayerConfig

    monkeypatch.setenv(name, "on")
    layer = DecoderLayerConfig(hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8)
    checks = {"MSTAR_ZERO_COPY_STEP_IO": zero_copy_step_io,
              "MSTAR_READBACK_NATIVE": lambda: TokenReadback(4, torch.device("cpu")),
              "MSTAR_EMBED_KERNEL": lambda: DecoderOnlyLM(layer, 1, 50, 10000.0, 64, False).enable_fused_ops(True)}
    with pytest.raises(ValueError, match=name):
        checks[name]()
