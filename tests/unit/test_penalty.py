"""The device-side repetition-penalty history equals the host rule (HF semantics) step after step."""

import torch

from mstar_common.engine.penalty import PenaltyState
from mstar_common.engine.sampler import apply_repetition_penalty


def test_masks_follow_prompt_and_sampled_tokens_like_the_host_history():
    torch.manual_seed(0)
    offset, width = 100, 50
    state = PenaltyState(num_slots=3, width=width, offset=offset, device=torch.device("cpu"))
    prompts = [[1, 2, 105, 149, 105], [120, 7], []]  # ids below the window are never sampled: no history needed
    factors = [1.3, 0.7, 2.0]
    slots = [state.acquire(p) for p in prompts]
    assert state.num_free == 0 and len(set(slots)) == 3
    history = [[t - offset for t in p if t >= offset] for p in prompts]
    for _ in range(20):
        logits = torch.randn(3, width) * 3
        want = apply_repetition_penalty(logits.clone(), factors, history)
        slot_t = torch.tensor(slots)
        got = state.apply(logits.clone(), slot_t, torch.tensor(factors))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        sampled = got.argmax(dim=-1)
        state.record(slot_t, sampled)
        for row, token in enumerate(sampled.tolist()):
            history[row].append(token)


def test_rows_on_the_scratch_slot_are_untouched_and_slots_are_reused_clean():
    state = PenaltyState(num_slots=1, width=8, offset=0, device=torch.device("cpu"))
    slot = state.acquire([1, 2, 3])
    logits = torch.full((2, 8), 2.0)
    out = state.apply(logits, torch.tensor([slot, state.scratch]), torch.tensor([2.0, 1.0]))
    assert out[0, 1:4].tolist() == [1.0, 1.0, 1.0] and out[0, 0] == 2.0 and (out[1] == 2.0).all()
    state.record(torch.tensor([state.scratch]), torch.tensor([5]))  # padding rows write the scratch slot only
    state.release(slot)
    again = state.acquire([7])
    assert again == slot and state.seen[again].nonzero().flatten().tolist() == [7]
    try:
        state.acquire([])
    except RuntimeError as exc:
        assert "no repetition-penalty slot" in str(exc)
    else:
        raise AssertionError("a full pool must refuse")


def test_greedy_applies_argmaxes_and_records_in_one_call():
    """`PenaltyState.greedy` (the captured greedy step's call; fused on CUDA) == apply, argmax, record."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen).to(torch.bfloat16)
    state, ref = PenaltyState(2, 50, 0, torch.device("cpu")), PenaltyState(2, 50, 0, torch.device("cpu"))
    for s in (state, ref):
        s.seen[0, int(logits[0].float().argmax())] = True
    slots, factors = torch.tensor([0, 2, 1]), torch.tensor([5.0, 1.0, 1.0])
    expected = ref.apply(logits.float(), slots, factors).argmax(dim=-1)
    ref.record(slots, expected)
    got = state.greedy(logits, slots, factors)
    assert torch.equal(got, expected) and int(got[0]) != int(logits[0].float().argmax())
    assert torch.equal(state.seen, ref.seen)
