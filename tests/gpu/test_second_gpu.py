"""On a host with two GPUs: a component placed on GPU 1 runs there, and only there.

Triton's Python backend does not make an instance's GPU the current CUDA device, and a new thread starts on
device 0; Triton-language kernels, capture streams and synchronizes use the current device. No lent machine has
had two GPUs yet, so this skips on one (docs/deployment.md says placement beyond GPU 0 is untested).
"""

from __future__ import annotations

import threading

import pytest
import torch

from mstar_common.devices import use_device
from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.attention import select_attention_backend
from mstar_common.engine.cuda_graph import GraphConfig
from mstar_common.engine.types import EngineConfig, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3
from tests.gpu.test_graphs_exact import _checkpoint, _prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


def _served_tokens(checkpoint, device: str, prompts) -> list[list[int]]:
    """As a stub does it: the device made current in the loading thread (node_setup.load_node), the step loop on
    a thread of its own. What the thread sees is asserted here, in the test's thread (an assert in another thread
    only warns)."""
    out: dict[str, list[int]] = {}
    seen: dict[str, object] = {"errors": []}
    done = threading.Event()

    def load_and_serve() -> None:
        try:
            use_device(device)
            model, config = load_qwen3(checkpoint, dtype="bfloat16", device=device)
            model.attn_backend = select_attention_backend(device, "triton")
            engine = AREngine(model, EngineConfig(num_kv_pages=128, page_size=16, max_num_seqs=4,
                                                  max_batch_tokens=256, max_model_len=512, dtype="bfloat16",
                                                  device=device),
                              eos_token_ids=[], vocab_size=config["vocab_size"],
                              graphs=GraphConfig([1, 2, 4], [64, 256], capture_sampling=True), overlap=True)
            engine.start()
            remaining = [len(prompts)]

            def on_output(rid, tokens, finished, error):
                if error is not None:
                    seen["errors"].append(error)
                out.setdefault(rid, []).extend(tokens)
                if finished:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()

            for i, ids in enumerate(prompts):
                engine.add_request(str(i), ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                                   on_output)
            seen["finished"] = done.wait(300)
            seen["replays"] = engine.runner.graphs.num_replays
            engine.shutdown()
        except Exception as exc:  # noqa: BLE001 - reported to the test's thread
            seen["errors"].append(repr(exc))

    thread = threading.Thread(target=load_and_serve)
    thread.start()
    thread.join(600)
    assert not thread.is_alive() and seen["errors"] == [], seen
    assert seen["finished"] and seen["replays"] > 0, seen  # every request ended, through the captured graphs
    return [out[str(i)] for i in range(len(prompts))]


def test_a_component_on_gpu_1_gives_gpu_0s_tokens_and_leaves_gpu_0_alone(tmp_path):
    checkpoint = _checkpoint(tmp_path / "qwen3", 0.02, 2)
    prompts = _prompts(3, 40, seed=5)
    on_0 = _served_tokens(checkpoint, "cuda:0", prompts)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    assert _served_tokens(checkpoint, "cuda:1", prompts) == on_0
    assert torch.cuda.memory_allocated(0) == before
