"""The FlashInfer backend's host side, on the CPU: the paged-KV CSR it plans from, and the per-replay planning hook
of the CUDA-graph runner (each replayed step is planned from exactly the inputs the step reads). FlashInfer itself
runs only on a GPU (tests/gpu/test_flashinfer_backend.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mstar_common.config import DeploymentError, deployment_from_dict
from mstar_common.engine.attention import TorchStaticAttention, select_attention_backend
from mstar_common.engine.flashinfer_backend import DECODE, graph_step_plan_inputs, paged_kv_csr
from mstar_common.engine.types import SamplingParams
from tests.unit.test_ar_engine import checkpoint, prompts  # noqa: F401 - fixtures
from tests.unit.test_graph_runner import GRAPHS, make_engine
from tests.unit.test_graph_runner import static_model as static_model  # noqa: F401 - fixture


def test_csr_takes_each_rows_pages_up_to_its_context():
    indptr, indices, last = paged_kv_csr([1, 16, 17, 40], [[7, 9], [3], [4, 5, 6], [8, 2, 1, 0]], page_size=16)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 3, 4, 5, 8, 2, 1]
    assert last.tolist() == [1, 16, 1, 8]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32


def test_csr_refuses_a_row_with_too_few_pages():
    with pytest.raises(ValueError, match="row 1: 1 pages hold fewer than its 20 tokens"):
        paged_kv_csr([4, 20], [[1], [2]], page_size=16)


def test_mixed_bucket_plan_puts_the_padding_tokens_in_a_dummy_row():
    host = {"context_lens": np.array([30, 1, 1], np.int32), "query_start_loc": np.array([0, 14, 14, 14], np.int32),
            "block_tables": np.array([5, 6, 0, 0, 0, 0, 0, 0, 0], np.int32)}
    inputs = graph_step_plan_inputs("mixed", rows=3, tokens=64, host=host, width=3, page_size=16, sink_page=0)
    assert inputs["qo_indptr"].tolist() == [0, 14, 14, 14, 64]
    assert inputs["indptr"].tolist() == [0, 2, 3, 4, 5]
    assert inputs["indices"].tolist() == [5, 6, 0, 0, 0]
    assert inputs["last_page_len"].tolist() == [14, 1, 1, 1]
    decode = graph_step_plan_inputs(DECODE, rows=3, tokens=3, host=host, width=3, page_size=16, sink_page=0)
    assert "qo_indptr" not in decode and decode["indptr"].tolist() == [0, 2, 3, 4]


class _PlanSpy(TorchStaticAttention):
    """The static backend, recording each graph plan and checking, at each attend of a (fake) replay, that the
    last plan was made from the inputs this step reads."""

    def __init__(self) -> None:
        self.plans, self.checked = [], 0
        self.last = None

    def plan_graph_step(self, key, rows, tokens, host, width, page_size, sink_page) -> None:
        self.plans.append(key)
        self.last = (key[0], graph_step_plan_inputs(key[0], rows, tokens, host, width, page_size, sink_page))

    def attend(self, query, k_cache, v_cache, metadata, scale):
        if self.last is not None and metadata.query_start_loc_host == []:  # a graph step (the runner's metadata)
            kind, planned = self.last
            rows, page_size = metadata.context_lens.shape[0], k_cache.shape[1]
            tables = metadata.block_tables.tolist()
            indptr, indices, last = paged_kv_csr(metadata.context_lens.tolist(), tables, page_size)
            if kind != DECODE:
                qo = metadata.query_start_loc.tolist() + [query.shape[0]]
                assert planned["qo_indptr"].tolist() == qo
                indptr = indptr.tolist() + [indptr[-1] + 1]
                indices, last = indices.tolist() + [planned["indices"][-1]], last.tolist() + [1]
            assert [np.asarray(x).tolist() for x in (planned["indptr"], planned["indices"], planned["last_page_len"])] \
                == [np.asarray(x).tolist() for x in (indptr, indices, last)]
            assert rows == len(planned["last_page_len"]) - (kind != DECODE)
            self.checked += 1
        return super().attend(query, k_cache, v_cache, metadata, scale)


def test_every_replay_is_planned_from_the_step_it_replays(static_model, prompts):  # noqa: F811
    model = static_model[0]
    saved, spy = model.attn_backend, _PlanSpy()
    model.attn_backend = spy
    try:
        engine = make_engine(static_model, GRAPHS, overlap=True)
        for index, ids in enumerate(prompts):
            engine.add_request(str(index), ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                               lambda *args: None)
        while engine.step():
            pass
    finally:
        model.attn_backend = saved
    replays = engine.runner.graphs.num_replays
    assert replays > 0
    assert len(spy.plans) == len(engine.runner.graphs.graphs) + replays  # one per capture, one per replay
    assert spy.checked >= replays  # every layer of every replay compared its step with the plan


def test_flashinfer_is_refused_off_the_gpu_and_with_an_fp8_pool():
    with pytest.raises(ValueError, match="'flashinfer' needs a CUDA device"):
        select_attention_backend(torch.device("cpu"), "flashinfer")
    raw = {"name": "m", "family": "qwen3", "checkpoint": "/tmp/none",
           "components": {"llm": {"placement": {"device": "gpu", "gpus": [0]}, "attention_backend": "flashinfer"}},
           "resources": {"kv_cache": {"num_pages": 512, "page_size": 16, "dtype": "fp8_e4m3"}}}
    with pytest.raises(DeploymentError, match="'flashinfer' reads bf16/fp16 KV pools only"):
        deployment_from_dict(raw, source="test")


def test_plan_inputs_are_staged_in_one_buffer_per_wrapper_and_input():
    from mstar_common.engine.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention.__new__(FlashInferAttention)  # no flashinfer on the CPU: only the staging
    backend._staging = {}
    first, second = object(), object()
    a = backend._pinned(first, "indices", np.arange(5, dtype=np.int32))
    b = backend._pinned(first, "indices", np.arange(3, dtype=np.int32) + 10)
    assert b.tolist() == [10, 11, 12] and b.data_ptr() == a.data_ptr()  # the same buffer, refilled
    assert backend._pinned(second, "indices", np.zeros(2, np.int32)).data_ptr() != a.data_ptr()
    grown = backend._pinned(first, "indices", np.arange(100, dtype=np.int32))
    assert grown.tolist() == list(range(100)) and backend._staging[(id(first), "indices")].numel() == 128


def test_prefill_kernel_family_switch(monkeypatch):
    from mstar_common.engine.flashinfer_backend import prefill_kernel_family

    monkeypatch.delenv("MSTAR_FLASHINFER_PREFILL", raising=False)
    assert prefill_kernel_family() == "auto"
    monkeypatch.setenv("MSTAR_FLASHINFER_PREFILL", "fa2")
    assert prefill_kernel_family() == "fa2"
    monkeypatch.setenv("MSTAR_FLASHINFER_PREFILL", "fa4")
    with pytest.raises(ValueError, match="MSTAR_FLASHINFER_PREFILL must be auto, fa2 or fa3, got 'fa4'"):
        prefill_kernel_family()


class _FakeDecodeWrapper:
    """Records FlashInfer-style decode plans; holds the device buffer of last-page lengths the kernels read."""

    def __init__(self) -> None:
        self.plans = 0
        self._paged_kv_last_page_len_buf = None

    def plan(self, indptr, indices, last_page_len, *args, **kwargs) -> None:
        self.plans += 1
        self._paged_kv_last_page_len_buf = last_page_len.clone()


def test_decode_steps_on_the_same_pages_refresh_only_the_last_page_lengths(monkeypatch):
    from mstar_common.engine import flashinfer_backend as fb

    class _Event:  # no CUDA here: the plan's copy fence is a no-op
        def record(self) -> None: ...

        def synchronize(self) -> None: ...

    monkeypatch.setattr(fb.torch.cuda, "Event", _Event)
    backend = fb.FlashInferAttention.__new__(fb.FlashInferAttention)
    backend._staging, backend._plan_events, backend._decode_pages = {}, {}, {}
    backend._workspace = torch.empty(0)
    backend._problem = {"num_heads": 16, "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "scale": 0.1,
                        "dtype": torch.bfloat16, "kv_dtype": torch.bfloat16}
    wrapper = _FakeDecodeWrapper()

    def step(context_lens):
        indptr, indices, last = paged_kv_csr(context_lens, [[3, 4, 5], [7, 8, 9]], page_size=16)
        backend._plan(wrapper, DECODE, {"indptr": indptr, "indices": indices, "last_page_len": last})
        return wrapper._paged_kv_last_page_len_buf.tolist()

    assert step([20, 5]) == [4, 5] and wrapper.plans == 1
    assert step([21, 6]) == [5, 6] and wrapper.plans == 1  # same pages: the lengths only
    assert step([32, 16]) == [16, 16] and wrapper.plans == 1
    assert step([33, 17]) == [1, 1] and wrapper.plans == 2  # each row entered a new page: planned again
    assert step([34, 18]) == [2, 2] and wrapper.plans == 2


@pytest.mark.parametrize("rows", [1, 4, 16, 32])
def test_a_decode_step_of_any_row_count_runs_the_prologue_then_flashinfers_kernel(rows):
    """The Triton backend's rope-in-attention decode (3-16 rows) ran in place of FlashInfer's kernel: the backend
    inherited `prologue_attend`, so `flashinfer` against `triton` compared Triton with itself at those rows."""
    from types import SimpleNamespace

    from mstar_common.engine.flashinfer_backend import FlashInferAttention

    backend = object.__new__(FlashInferAttention)  # no FlashInfer on the CPU: its two halves stand in
    backend.fused_prologue = True
    calls = []
    backend.prologue = lambda qkv, layer, rope, kv, metadata: calls.append("prologue") or qkv
    backend.attend = lambda query, k, v, metadata, scale: calls.append("attend") or query
    kv = (torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16))
    backend.prologue_attend(torch.zeros(rows, 8 * 64), None, None, kv, SimpleNamespace(is_decode=True), 0.125)
    assert calls == ["prologue", "attend"]
