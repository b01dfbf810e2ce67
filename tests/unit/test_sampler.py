"""Sampler vs transformers' own logits processors, plus seeding, batching and draw statistics."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from mstar_common.engine.sampler import Sampler, apply_repetition_penalty, make_generator
from mstar_common.engine.types import SamplingParams

VOCAB = 64


def _logits(batch: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _hf_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row through HF's warpers in the sampler's order (temperature -> top-k -> top-p -> min-p)."""
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(MinPLogitsWarper(params.min_p))
    scores = logits.unsqueeze(0)
    for warper in warpers:
        scores = warper(None, scores)
    return scores[0]


def _assert_same_distribution(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(5, "cpu"), make_generator(5, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_greedy_is_argmax():
    logits = _logits(8)
    params = [SamplingParams(temperature=0.0)] * 8
    tokens = Sampler().sample(logits, params, [None] * 8, [[]] * 8)
    assert tokens.dtype == torch.int64 and tokens.shape == (8,)
    assert torch.equal(tokens, logits.argmax(-1))


def test_repetition_penalty_matches_hf():
    logits = _logits(4)
    history = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1))
    penalties = [1.0, 1.3, 0.7, 2.0]
    ours = apply_repetition_penalty(logits, penalties, history.tolist())
    for row, penalty in enumerate(penalties):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(history[row : row + 1], logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row], theirs[0])


def test_repetition_penalty_steers_greedy():
    logits = _logits(1)
    best = int(logits.argmax())
    params = [SamplingParams(temperature=0.0, repetition_penalty=1e6)]
    token = Sampler().sample(logits, params, [None], [[best, best]])
    assert int(token) != best


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(top_k=1),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(top_p=0.3),
        SamplingParams(min_p=0.05),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.8, min_p=0.02),
    ],
)
def test_filters_match_hf(params):
    logits = _logits(6, seed=3)
    ours = Sampler().filter(logits, [params] * 6)
    for row in range(6):
        _assert_same_distribution(ours[row], _hf_filter(logits[row], params))


def test_mixed_per_row_params_match_hf():
    """Each row keeps its own knobs inside one vectorised batch."""
    params = [
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(top_p=0.5),
        SamplingParams(temperature=2.0, min_p=0.1),
        SamplingParams(top_k=10, top_p=0.95),
        SamplingParams(),
    ]
    logits = _logits(len(params), seed=4)
    ours = Sampler().filter(logits, params)
    for row, row_params in enumerate(params):
        _assert_same_distribution(ours[row], _hf_filter(logits[row], row_params))


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_off(top_k):
    logits = _logits(2)
    SamplingParams(top_k=top_k).validate(VOCAB)  # -1 is vLLM's "off": accepted as 0 is
    ours = Sampler().filter(logits, [SamplingParams(top_k=top_k)] * 2)
    assert torch.equal(ours, logits)


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(Sampler().filter(logits, [SamplingParams(top_p=0.6)]))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(Sampler().filter(logits, [SamplingParams(top_p=0.4)]))
    assert kept.tolist() == [[True, False, False, False]]


def test_sample_does_not_modify_logits():
    logits = _logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, repetition_penalty=1.5)] * 3
    Sampler().sample(logits, params, [None] * 3, [[1, 2, 3]] * 3)
    assert torch.equal(logits, before)


def _seeded_run(logits_rows: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], steps: int):
    sampler = Sampler()
    generators = [make_generator(seed, "cpu") for seed in seeds]
    return torch.stack([sampler.sample(logits_rows, params, generators, [[]] * len(params)) for _ in range(steps)])


def test_seeded_rows_reproducible_and_batch_independent():
    target = SamplingParams(temperature=1.2, top_k=30, top_p=0.95, seed=1234)
    row = _logits(1, seed=7)
    alone = _seeded_run(row, [target], [1234], steps=20)[:, 0]
    assert torch.equal(alone, _seeded_run(row, [target], [1234], steps=20)[:, 0])
    mates = _logits(4, seed=8)
    batch = torch.cat([mates[:2], row, mates[2:]])
    params = [SamplingParams(temperature=0.9), SamplingParams(top_k=3), target, SamplingParams(),
              SamplingParams(temperature=0.0)]
    seeds = [None, 99, 1234, 5, None]
    in_batch = _seeded_run(batch, params, seeds, steps=20)[:, 2]
    assert torch.equal(alone, in_batch)
    assert len(set(alone.tolist())) > 1  # it really sampled


def test_top_k_2_frequencies_follow_probabilities():
    torch.manual_seed(0)
    num_draws = 20_000
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    logits = probs.log().expand(num_draws, -1).contiguous()
    params = [SamplingParams(top_k=2)] * num_draws
    tokens = Sampler().sample(logits, params, [None] * num_draws, [[]] * num_draws)
    counts = torch.bincount(tokens, minlength=5).float() / num_draws
    assert counts[[0, 2, 4]].sum() == 0  # never leaves the top 2
    expected = torch.tensor([0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0])
    assert torch.allclose(counts, expected, atol=0.02)


def test_unfiltered_frequencies_follow_probabilities():
    generator = make_generator(11, "cpu")
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    sampler, params = Sampler(), [SamplingParams(seed=11)]
    tokens = torch.cat([sampler.sample(probs.log()[None], params, [generator], [[]]) for _ in range(4000)])
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(counts, probs, atol=0.03)


def test_mixed_greedy_and_sampled_batch():
    logits = _logits(4, seed=9)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, top_p=0.9, seed=4)]
    mixed = _seeded_run(logits, params, [None, 3, None, 4], steps=10)
    assert torch.equal(mixed[:, 0], logits[0].argmax().expand(10))
    assert torch.equal(mixed[:, 2], logits[2].argmax().expand(10))
    assert torch.equal(mixed[:, 1], _seeded_run(logits[1:2], params[1:2], [3], steps=10)[:, 0])
    assert torch.equal(mixed[:, 3], _seeded_run(logits[3:4], params[3:4], [4], steps=10)[:, 0])


def test_a_temperature_of_1e_5_samples_through_triton_as_through_the_proxy():
    """The wire's FP32 turns 1e-5 into 9.99999975e-06, below the greedy bound of 1e-5: the same request sampled
    from the proxy's Python float and decoded greedily from a Triton tensor."""
    import numpy as np

    from mstar_common.families.text import sampling_params_from_inputs

    for value in (1e-5, 1.2e-5):
        wire = sampling_params_from_inputs({"temperature": np.asarray([value], dtype=np.float32)}, 16)
        assert not wire.is_greedy and not SamplingParams(temperature=value).is_greedy, value
    wire = sampling_params_from_inputs({"temperature": np.asarray([9e-6], dtype=np.float32)}, 16)
    assert wire.is_greedy and SamplingParams(temperature=0.0).is_greedy
