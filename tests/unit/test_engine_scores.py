"""The engine's optional per-token scores (engine/model_runner.py's docstring) on the tiny Qwen3, with the hooks set
on the model as a family would: every sampled token's log-probability and every probed prompt position reach the
model once, equal between eager steps and replayed graphs with overlap, chunked prompts and staggered arrivals."""

from __future__ import annotations

import collections

import pytest

from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.attention import TorchStaticAttention
from mstar_common.engine.cuda_graph import GraphConfig
from mstar_common.engine.types import EngineConfig, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3, read_eos_token_ids
from tests.unit.test_ar_engine import Collector, checkpoint, prompts  # noqa: F401 - fixtures

GRAPHS = GraphConfig(decode_buckets=[1, 2, 4, 8], token_buckets=[16, 64], capture_sampling=False)


def scored_engine(path, probe_id: int, with_rules: bool, graphs, overlap: bool, **overrides):
    model, config = load_qwen3(path, attn_backend=TorchStaticAttention())
    seen = {"logprobs": collections.defaultdict(dict), "probes": collections.defaultdict(list)}
    model.token_logprobs = True
    model.probe_token_id = probe_id
    model.probe = lambda hidden: hidden[:, 0].float() * 1000 + hidden[:, 1].float()
    model.note_sampled = lambda seq, index, token, lp: seen["logprobs"][seq.request_id].__setitem__(index, (token, lp))
    model.note_probe = lambda seq, value: seen["probes"][seq.request_id].append(value)
    if with_rules:  # a model with its own logits rules samples on the host after a replay
        model.process_logits = lambda logits, seqs: logits
    engine_config = EngineConfig(**{"num_kv_pages": 256, "page_size": 4, "max_num_seqs": 8, "max_batch_tokens": 64,
                                    "max_model_len": 128, **overrides})
    engine = AREngine(model, engine_config, eos_token_ids=read_eos_token_ids(path, config),
                      vocab_size=config["vocab_size"], graphs=graphs, overlap=overlap)
    return engine, seen


def drive(engine: AREngine, requests: list[list[int]], stagger: int = 0) -> Collector:
    collector, pending = Collector(), list(enumerate(requests))
    for step in range(10_000):
        while pending and (stagger == 0 or step % stagger == 0):
            index, ids = pending.pop(0)
            engine.add_request(str(index), ids, SamplingParams(max_tokens=12, temperature=0.0), collector)
            if stagger:
                break
        if not engine.step() and not pending:
            break
    return collector


@pytest.mark.parametrize("with_rules", [True, False], ids=["process_logits", "no_rules"])
@pytest.mark.parametrize(("graphs", "overlap", "stagger", "max_batch_tokens"), [
    (None, True, 3, 6), (GRAPHS, False, 0, 64), (GRAPHS, True, 0, 8), (GRAPHS, True, 2, 5)],
    ids=["eager_staggered", "graphs", "graphs_overlap_chunked", "graphs_overlap_staggered"])
def test_every_sampled_token_and_probe_is_scored_once(checkpoint, prompts, with_rules, graphs, overlap,  # noqa: F811
                                                      stagger, max_batch_tokens):
    """Against each prompt run alone, unchunked and eager. A model without logits rules used to sample inside the
    replayed graphs, where no log-probability was taken: its replayed steps' tokens came without one."""
    probe_id = collections.Counter(t for p in prompts for t in p).most_common(1)[0][0]
    want_lp, want_probes = {}, {}
    for index, ids in enumerate(prompts):
        engine, seen = scored_engine(checkpoint, probe_id, with_rules, None, False, max_batch_tokens=128)
        drive(engine, [ids])
        want_lp[str(index)], want_probes[str(index)] = seen["logprobs"]["0"], seen["probes"].get("0", [])
    engine, seen = scored_engine(checkpoint, probe_id, with_rules, graphs, overlap,
                                 max_batch_tokens=max_batch_tokens, max_num_seqs=min(8, max_batch_tokens))
    collector = drive(engine, prompts, stagger)
    if graphs is not None:
        assert engine.runner.graphs.num_replays > 0
    assert sum(map(len, want_probes.values())) >= 3  # the probe token sits in several prompts
    for index in range(len(prompts)):
        request = str(index)
        got, want = seen["logprobs"][request], want_lp[request]
        # keyed by the token's index in the sequence (prompt included): one for each token the request got
        first = len(prompts[index])
        assert sorted(got) == sorted(want) == list(range(first, first + len(collector.streams[request].tokens)))
        assert [got[i][0] for i in sorted(got)] == collector.streams[request].tokens
        assert all(got[i][0] == want[i][0] and got[i][1] == pytest.approx(want[i][1], abs=1e-3) for i in want)
        assert all(lp <= 0 for _, lp in got.values())
        assert seen["probes"].get(request, []) == pytest.approx(want_probes[request], rel=1e-3, abs=1e-2), request


def test_a_probed_model_keeps_no_prefix_cache(checkpoint):  # noqa: F811
    """A probed position inside a reused prefix would never run, so its probe would never reach the model: a model
    with `probe_token_id` keys no prefix pages, and asking for them is refused."""
    model, config = load_qwen3(checkpoint, attn_backend=TorchStaticAttention())
    model.probe_token_id, model.probe = 5, lambda hidden: hidden[:, 0]
    model.note_probe = lambda seq, value: None
    eos, vocab = read_eos_token_ids(checkpoint, config), config["vocab_size"]
    base = {"num_kv_pages": 64, "page_size": 4, "max_num_seqs": 4, "max_batch_tokens": 64, "max_model_len": 128}
    assert not AREngine(model, EngineConfig(**base), eos_token_ids=eos, vocab_size=vocab).allocator.prefix_caching
    with pytest.raises(ValueError, match="prefix_caching"):
        AREngine(model, EngineConfig(**base, prefix_caching=True), eos_token_ids=eos, vocab_size=vocab)
    del model.probe_token_id
    assert AREngine(model, EngineConfig(**base), eos_token_ids=eos, vocab_size=vocab).allocator.prefix_caching
