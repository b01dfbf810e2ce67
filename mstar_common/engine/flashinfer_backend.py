"""FlashInfer's paged attention kernels behind `AttentionBackend` (`attention_backend: flashinfer`).

Status: built and checked on the H200 (tests/gpu/test_flashinfer_backend.py, 2026-12-02) with FlashInfer 0.2.5 (a
2.5 MB source release, JIT-compiled at first use). Slower than the Triton backend there at every measured step
(docs/deployment.md), so `auto` does not pick it; it is here for GPUs and shapes where FlashInfer's kernels win.

What it does. The KV write stays the Triton backend's (the fused q/k-norm + RoPE + KV-write prologue, or
`store_kv`); only `attend` changes. FlashInfer wants each step "planned" on the host before its kernels run: the
rows' page lists as CSR (`indptr`, `indices`, `last_page_len`) and a work partition it writes into its own
workspace. So:

- eager steps: `prepare(metadata)` turns the metadata's host lists into CSR; the first layer's `attend` plans
  (the scale and head counts come with that call) and every layer runs the planned wrapper;
- captured steps: one wrapper per graph bucket, made with FlashInfer's CUDA-graph buffers. `plan_graph_step`,
  which `CudaGraphRunner` calls after filling a bucket's inputs (before capture, and before every replay), plans
  that bucket's wrapper from the same host arrays the graph's own inputs are copied from. Decode buckets run
  FlashInfer's batch decode; prefill/mixed buckets its batch prefill (rows of one token included), with one
  extra dummy row that holds the bucket's padding tokens, so that every plan of a bucket sees the same total
  number of query tokens: FlashInfer derives the captured kernel's query tile from that total.

A decode step whose rows hold the same pages as its wrapper's last plan is not planned again: the partition depends
on the pages only, and the kernels read each row's tokens in its last page from a device buffer, which such a
step refreshes. Served at c=1 on the H200 (Qwen3-0.6B, docs/benchmarks.md, 2026-12-02) the host's launch per step
fell from 0.87-1.20 ms to 0.55-0.65 ms with the skip, and the ITL p50 from 1.124 to 1.062 ms; the GPU tests
(tests/gpu/test_flashinfer_backend.py) replay decode steps that both skip and redo the plan.

A wrapper's plan stages its work partition in a pinned host buffer and copies it to the device asynchronously,
so planning the same wrapper again must wait for that copy: each plan records an event and the next plan of the
wrapper waits on it (with the engine's overlap the wait is normally already over).

Limits: bf16/fp16 pools only (an fp8 pool is refused), decoder self-attention of the text LMs only (Whisper's
decoder refuses it: its cross-attention would run the self-attention's plan), pages of any size FlashInfer
accepts, and the head dims the Triton prologue takes.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, TritonPagedAttention
from mstar_common.engine.cuda_graph import DECODE, MIXED

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partials), shared by all wrappers


def prefill_kernel_family() -> str:
    """`MSTAR_FLASHINFER_PREFILL`: FlashInfer's prefill kernels, auto (its choice: fa3 on Hopper) | fa2 | fa3."""
    value = os.environ.get("MSTAR_FLASHINFER_PREFILL", "") or "auto"
    if value not in ("auto", "fa2", "fa3"):
        raise ValueError(f"MSTAR_FLASHINFER_PREFILL must be auto, fa2 or fa3, got {value!r}")
    return value


def import_flashinfer():
    """The `flashinfer` module, or a clear error naming the package. With CUDA 13 its JIT build needs nvcc's
    `-static-global-template-stub=false` (FlashInfer instantiates a kernel in one file and launches it from
    another; scripts/probe_flashinfer.py), which nvcc reads from `NVCC_APPEND_FLAGS`."""
    if int((torch.version.cuda or "0").split(".")[0]) >= 13:
        os.environ.setdefault("NVCC_APPEND_FLAGS", "-static-global-template-stub=false")
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError("attention backend 'flashinfer' needs the flashinfer-python package (0.2.5 is the release "
                         f"known to build here; docs/deployment.md), which does not import: {exc}") from exc
    return flashinfer


def paged_kv_csr(context_lens, page_rows, page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's paged-KV layout of some rows: `indptr` `[B + 1]`, `indices` (each row's first
    ceil(context / page_size) pages, at least one) and `last_page_len` `[B]` (tokens in each row's last page),
    all int32. `page_rows[r]` lists row r's pages in order (more may follow; they are ignored)."""
    counts = [max(1, -(-int(c) // page_size)) for c in context_lens]
    indptr = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int32)
    for row, (pages, n) in enumerate(zip(page_rows, counts, strict=True)):
        if len(pages) < n:
            raise ValueError(f"row {row}: {len(pages)} pages hold fewer than its {int(context_lens[row])} tokens")
        indices[indptr[row]:indptr[row + 1]] = np.asarray(pages[:n], dtype=np.int32)
    last = np.array([int(c) - (n - 1) * page_size for c, n in zip(context_lens, counts, strict=True)], dtype=np.int32)
    return indptr, indices, last


def graph_step_plan_inputs(kind: str, rows: int, tokens: int, host: dict, width: int, page_size: int,
                           sink_page: int) -> dict[str, np.ndarray]:
    """A captured bucket's plan inputs from the step buffers' host arrays (engine/cuda_graph.py `StepBuffers`):
    padded rows hold one token of the sink page, as the runner fills them. For a prefill/mixed bucket, one dummy
    row after the bucket's rows takes the padding tokens (those past the step's last real token) over one sink
    token, so the plan's total query tokens is always `tokens`."""
    context_lens = host["context_lens"][:rows]
    table = host["block_tables"]
    page_rows = [table[r * width:(r + 1) * width] for r in range(rows)]
    indptr, indices, last = paged_kv_csr(context_lens, page_rows, page_size)
    if kind == DECODE:
        return {"indptr": indptr, "indices": indices, "last_page_len": last}
    qo = np.empty(rows + 2, dtype=np.int32)
    qo[: rows + 1] = host["query_start_loc"][: rows + 1]
    qo[rows + 1] = tokens  # the dummy row: the padding tokens, fully masked over one sink token
    indptr = np.append(indptr, indptr[-1] + 1).astype(np.int32)
    indices = np.append(indices, np.int32(sink_page)).astype(np.int32)
    last = np.append(last, np.int32(1)).astype(np.int32)
    return {"qo_indptr": qo, "indptr": indptr, "indices": indices, "last_page_len": last}


class FlashInferAttention(TritonPagedAttention):
    """See the module docstring. Graph safe: captured steps are planned through `plan_graph_step`."""

    name = "flashinfer"
    is_graph_safe = True

    def __init__(self, fused_prologue: bool = True) -> None:
        super().__init__(fused_prologue)
        self._fi = import_flashinfer()
        self._workspace: torch.Tensor | None = None
        self._eager: dict[str, object] = {}  # DECODE / MIXED -> wrapper without graph buffers
        self._graph: dict[tuple, object] = {}  # (kind, size) -> wrapper with graph buffers
        self._plan_events: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's copy
        self._staging: dict[tuple[int, str], torch.Tensor] = {}  # (id(wrapper), input) -> the plan's input
        self._decode_pages: dict[int, tuple] = {}  # id(decode wrapper) -> (indptr, indices) of its last full plan
        self._problem: dict | None = None  # heads, head dim, page size, scale, dtypes: from the first attend
        self._pending: tuple | None = None  # (wrapper, kind, inputs) to plan at the next attend
        self._active = None  # the wrapper `attend` runs

    def prologue_attend(self, qkv, layer, rope, kv, metadata, scale) -> torch.Tensor:
        """The prologue, then FlashInfer's kernel, at every row count: the Triton backend's rope-in-attention decode
        (3-16 rows) would run in its place, so `flashinfer` against `triton` compared Triton with itself there."""
        return AttentionBackend.prologue_attend(self, qkv, layer, rope, kv, metadata, scale)

    # ---- eager steps -------------------------------------------------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> None:
        if metadata.page_tables_host is None:
            raise ValueError("the flashinfer backend needs metadata.page_tables_host (build_attention_metadata "
                             "sets it)")
        kind = DECODE if metadata.is_decode else MIXED
        wrapper = self._eager_wrapper(kind, metadata.block_tables.device)
        self._pending = (wrapper, kind, {"context_lens": metadata.context_lens_host,
                                          "page_rows": metadata.page_tables_host,
                                          "qo_indptr": metadata.query_start_loc_host})
        self._active = wrapper

    def attend(self, query, k_cache, v_cache, metadata, scale) -> torch.Tensor:
        self._learn(query, k_cache, scale)
        if self._pending is not None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("flashinfer backend: a step was captured before it was planned")
            wrapper, kind, inputs = self._pending
            self._pending = None
            if "page_rows" in inputs:  # eager: CSR from the metadata's host lists
                indptr, indices, last = paged_kv_csr(inputs["context_lens"], inputs["page_rows"],
                                                     self._problem["page_size"])
                inputs = {"indptr": indptr, "indices": indices, "last_page_len": last,
                          "qo_indptr": np.asarray(inputs["qo_indptr"], dtype=np.int32)}
            self._plan(wrapper, kind, inputs)
        return self._active.run(query, (k_cache, v_cache))

    # ---- captured steps ----------------------------------------------------------------------------------------

    def plan_graph_step(self, key: tuple, rows: int, tokens: int, host: dict, width: int, page_size: int,
                        sink_page: int) -> None:
        """Plan bucket `key` = (kind, size, sampling) from the host arrays its inputs are copied from."""
        kind, size = key[0], key[1]
        inputs = graph_step_plan_inputs(kind, rows, tokens, host, width, page_size, sink_page)
        wrapper = self._graph.get((kind, size))
        if wrapper is None:
            wrapper = self._graph[(kind, size)] = self._graph_wrapper(kind, rows, width)
        self._active = wrapper
        if self._problem is None:  # before the first capture's warm-up: plan at its first attend
            self._pending = (wrapper, kind, inputs)
        else:
            self._pending = None
            self._plan(wrapper, kind, inputs)

    # ---- wrappers and plans -----------------------------------------------------------------------------------

    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _eager_wrapper(self, kind: str, device: torch.device):
        if kind not in self._eager:
            ws = self._workspace_on(device)
            self._eager[kind] = (self._fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD") if kind == DECODE
                                 else self._fi.BatchPrefillWithPagedKVCacheWrapper(
                                     ws, "NHD", backend=prefill_kernel_family()))
        return self._eager[kind]

    def _graph_wrapper(self, kind: str, rows: int, width: int):
        device = torch.device("cuda", torch.cuda.current_device())
        ws = self._workspace_on(device)

        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        if kind == DECODE:
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=ints(rows + 1),
                paged_kv_indices_buffer=ints(rows * width), paged_kv_last_page_len_buffer=ints(rows))
        batch = rows + 1  # the dummy row of the padding tokens
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=ints(batch + 1), paged_kv_indptr_buf=ints(batch + 1),
            paged_kv_indices_buf=ints(rows * width + 1), paged_kv_last_page_len_buf=ints(batch),
            backend=prefill_kernel_family())

    def _learn(self, query: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
        if self._problem is not None:
            return
        if k_cache.element_size() == 1:
            raise ValueError("attention backend 'flashinfer' supports bf16/fp16 KV pools only; "
                             "resources.kv_cache.dtype fp8_e4m3 needs the 'triton' backend")
        self._problem = {"num_heads": query.shape[1], "num_kv_heads": k_cache.shape[2], "head_dim": query.shape[2],
                         "page_size": k_cache.shape[1], "scale": float(scale), "dtype": query.dtype,
                         "kv_dtype": k_cache.dtype}

    def _buffer(self, wrapper, name: str, size: int, device: torch.device | None = None) -> torch.Tensor:
        """The first `size` int32 of this wrapper's staging buffer `name`: page-locked host memory, or `device`
        memory; grown by doubling."""
        key = (id(wrapper), name)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < size:
            capacity = max(64, 1 << max(0, size - 1).bit_length())
            buf = self._staging[key] = (torch.empty(capacity, dtype=torch.int32, device=device) if device is not None
                                        else torch.empty(capacity, dtype=torch.int32,
                                                         pin_memory=torch.cuda.is_available()))
        return buf[:size]

    def _pinned(self, wrapper, name: str, array: np.ndarray) -> torch.Tensor:
        """`array` in this wrapper's page-locked buffer `name`, so that the plan's copies to the device queue
        behind the running step instead of going through a pageable staging copy. The caller has waited for this
        wrapper's previous plan's copies, the only readers of the buffer."""
        view = self._buffer(wrapper, name, array.size)
        view.numpy()[:] = array
        return view

    def _device_copy(self, wrapper, staged: torch.Tensor) -> torch.Tensor:
        """The page indices on the device, queued from their page-locked stage. FlashInfer's plan reads only their
        length on the host, and copies host indices into its graph buffer with `non_blocking=False`, which waits
        for the stream: for a captured bucket, for the step that is running."""
        view = self._buffer(wrapper, "indices@device", staged.numel(), self._workspace.device)
        view.copy_(staged, non_blocking=True)
        return view

    def _plan(self, wrapper, kind: str, inputs: dict[str, np.ndarray]) -> None:
        event = self._plan_events.get(id(wrapper))
        if event is not None:
            event.synchronize()  # the wrapper's previous plan has left its pinned staging buffer

        def host(name: str) -> torch.Tensor:
            return self._pinned(wrapper, name, np.ascontiguousarray(inputs[name], dtype=np.int32))

        if kind == DECODE and self._same_pages(wrapper, inputs):
            # The decode plan's work partition depends on each row's pages only; the kernels read the tokens in
            # each last page from the device buffer at run time. A step whose rows hold the same pages as the
            # wrapper's last plan (63 of 64 decode steps with pages of 64) only refreshes that buffer.
            wrapper._paged_kv_last_page_len_buf.copy_(host("last_page_len"), non_blocking=True)
        else:
            self._plan_fully(wrapper, kind, inputs, host)
        if event is None:
            event = self._plan_events[id(wrapper)] = torch.cuda.Event()
        event.record()

    def _same_pages(self, wrapper, inputs: dict[str, np.ndarray]) -> bool:
        last = self._decode_pages.get(id(wrapper))
        return (last is not None and not getattr(wrapper, "use_tensor_cores", False)
                and hasattr(wrapper, "_paged_kv_last_page_len_buf")
                and np.array_equal(last[0], inputs["indptr"]) and np.array_equal(last[1], inputs["indices"]))

    def _plan_fully(self, wrapper, kind: str, inputs: dict[str, np.ndarray], host) -> None:
        p = self._problem
        common = {"q_data_type": p["dtype"], "kv_data_type": p["kv_dtype"], "sm_scale": p["scale"]}
        indices = self._device_copy(wrapper, host("indices"))
        if kind == DECODE:
            wrapper.plan(host("indptr"), indices, host("last_page_len"), p["num_heads"], p["num_kv_heads"],
                         p["head_dim"], p["page_size"], **common)
            self._decode_pages[id(wrapper)] = (np.array(inputs["indptr"], dtype=np.int32),
                                               np.array(inputs["indices"], dtype=np.int32))
        else:
            wrapper.plan(host("qo_indptr"), host("indptr"), indices, host("last_page_len"), p["num_heads"],
                         p["num_kv_heads"], p["head_dim"], p["page_size"], causal=True, **common)
