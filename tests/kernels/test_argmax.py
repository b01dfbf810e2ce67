"""The two-launch row argmax (mstar_kernels/argmax.py) against torch's argmax, and the fused Gumbel draw against
torch's argmax of the noised logits written out."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mstar_kernels.argmax import BLOCK, gumbel_argmax, gumbel_noise, penalised_argmax, row_argmax  # noqa: E402


@triton.jit
def _noised_kernel(logits_ptr, seed_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    logit = tl.load(logits_ptr + row * vocab + cols, mask=mask)
    noise = gumbel_noise(tl.load(seed_ptr + row), tl.program_id(1) * BLOCK, BLOCK)
    tl.store(out_ptr + row * vocab + cols, logit + noise, mask=mask)


def _noised(logits, seeds):
    out = torch.empty_like(logits)
    _noised_kernel[(logits.shape[0], triton.cdiv(logits.shape[1], BLOCK))](logits, seeds, out, logits.shape[1],
                                                                         BLOCK=BLOCK)
    return out

VOCABS = sweep([128256, 151936, 28672, 4096, 5000, 1], [2 * BLOCK + 7, BLOCK, 300, 1])


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torchs(vocab, rows, dtype):
    gen = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=gen).to(dtype)
    if vocab > 2:  # the maximum twice in one row, in different chunks where there are several: the first wins
        top = x[0].max() + 1
        x[0, vocab // 2], x[0, vocab - 1] = top, top
    if rows > 1:
        x[1] = float("-inf")  # an all -inf row gives 0, as torch does
        x[2] = 0.0  # all ties: 0
    x = x.to(DEVICE)
    assert torch.equal(row_argmax(x).cpu(), x.cpu().argmax(dim=-1))


def test_row_argmax_reads_a_strided_batch():
    x = torch.randn(3, 2 * BLOCK + 100, device=DEVICE)[:, : BLOCK + 50]  # row stride > width
    assert torch.equal(row_argmax(x).cpu(), x.cpu().argmax(dim=-1))
    assert row_argmax(torch.empty(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_argmax_stores_into_a_given_token_buffer(dtype):
    """A decode graph's greedy step passes its token buffer (int32, a prefix of a larger one) as `out`: the tokens
    land there, the buffer itself is returned (so no copy follows), and the rest of the buffer is not touched; the
    same for the penalised argmax, which also records its tokens."""
    gen = torch.Generator().manual_seed(7)
    vocab = 3 * BLOCK + 11
    x = torch.randn(3, vocab, generator=gen)
    x[1, vocab - 1] = 10.0  # a token id above 2**12 in the last chunk
    buffer = torch.full((8,), -5, dtype=dtype, device=DEVICE)
    out = buffer[:3]
    got = row_argmax(x.to(DEVICE), out)
    assert got is out and got.dtype == dtype
    assert buffer.cpu().tolist() == x.argmax(dim=-1).tolist() + [-5] * 5
    seen = torch.zeros(4, vocab, dtype=torch.uint8, device=DEVICE)
    slots = torch.tensor([0, 1, 3], device=DEVICE)
    factors = torch.ones(3, device=DEVICE)
    buffer.fill_(-5)
    got = penalised_argmax(x.to(DEVICE), seen, slots, factors, out)
    assert got is out and buffer.cpu().tolist() == x.argmax(dim=-1).tolist() + [-5] * 5
    assert seen.sum().item() == 3 and seen[1, vocab - 1].item() == 1
    with pytest.raises(AssertionError, match="out must be"):
        row_argmax(x.to(DEVICE), torch.empty(3, dtype=torch.float32, device=DEVICE))


def test_the_noise_is_gumbel_and_the_draws_follow_the_softmax():
    """One Philox call serves four columns: the noise is still Gumbel(0, 1) (mean 0.5772, variance pi^2/6), with
    no correlation between neighbouring columns (which share a call) nor between seeds, and the race over noised
    logits draws each token at its softmax probability."""
    rows, vocab = 8, 4 * BLOCK
    seeds = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 7919 + 11
    noise = _noised(torch.zeros(rows, vocab, device=DEVICE), seeds).double().cpu()
    assert abs(float(noise.mean()) - 0.5772) < 0.01 and abs(float(noise.var()) - 1.6449) < 0.05
    for lag in (1, 2, 3, 4):  # columns of one call, and the next call's
        r = torch.corrcoef(torch.stack([noise[:, :-lag].flatten(), noise[:, lag:].flatten()]))[0, 1]
        assert abs(float(r)) < 0.02, (lag, float(r))
    assert abs(float(torch.corrcoef(noise[:2])[0, 1])) < 0.03  # two seeds
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * 4, device=DEVICE)).repeat(4000, 1)
    drawn = gumbel_argmax(logits, torch.arange(4000, dtype=torch.int64, device=DEVICE) * 104729 + 3)
    freq = torch.bincount(drawn.cpu(), minlength=8).double() / 4000
    assert torch.allclose(freq[:4], torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), atol=0.025), freq
    assert int(freq[4:].sum() * 4000) <= 2


@pytest.mark.parametrize("vocab", sweep([128256, 28672, 1000], [BLOCK + 9, 300]))
def test_gumbel_argmax_is_the_race_argmax(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    logits[1, : vocab // 2] = float("-inf")  # filtered tokens never win
    logits, seeds = logits.to(DEVICE), torch.tensor([1, 2, 3, 1 << 40], device=DEVICE)
    drawn = gumbel_argmax(logits, seeds)
    assert torch.equal(drawn.cpu(), _noised(logits, seeds).argmax(dim=-1).cpu())
    assert int(drawn[1]) >= vocab // 2


@pytest.mark.parametrize("vocab", sweep([151936, 1000], [BLOCK + 9]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalised_argmax_is_penalty_state_apply_argmax_record(vocab, dtype):
    """The fused greedy step under the repetition penalty (engine/penalty.py `PenaltyState.greedy` on CUDA)
    against the torch ops it replaces: the same tokens and the same seen mask afterwards. Each row's best
    logit is a seen one, so the penalty decides the token."""
    from mstar_common.engine.penalty import PenaltyState

    gen = torch.Generator().manual_seed(vocab)
    rows = 5
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    state = PenaltyState(4, vocab, 0, torch.device("cpu"))  # slots 0-3, scratch 4
    state.seen[:] = torch.rand(5, vocab, generator=gen) < 0.3
    for row, slot in enumerate([0, 1, 4, 4, 2]):
        best = int(logits[row].float().argmax())
        state.seen[slot, best] = True  # the unpenalised winner is seen: a penalty above 1 must move the token
    logits[3, : vocab // 2] = -2.0  # negative logits are multiplied
    slots = torch.tensor([0, 1, 4, 4, 2])
    factors = torch.tensor([1.3, 2.0, 1.0, 1.0, 0.7])  # scratch rows carry 1.0; below 1 boosts seen ids
    ref_state = PenaltyState(4, vocab, 0, torch.device("cpu"))
    ref_state.seen.copy_(state.seen)
    expected = ref_state.apply(logits.float(), slots, factors).argmax(dim=-1)
    ref_state.record(slots, expected)
    assert not torch.equal(expected, logits.float().argmax(dim=-1)), "the penalty changes some tokens"
    seen = state.seen.to(DEVICE).view(torch.uint8)
    got = penalised_argmax(logits.to(DEVICE), seen, slots.to(DEVICE), factors.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(seen.cpu().bool(), ref_state.seen)


@pytest.mark.parametrize("vocab", sweep([151936, 1000], [BLOCK + 9]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalised_logits_and_record_are_penalty_state_apply_and_record(vocab, dtype):
    """The sampled step's penalty (mstar_kernels/penalty.py, `PenaltyState.apply` and `record` on CUDA) against
    the torch ops it replaces, bit for bit: positive and negative seen logits, factors above and below 1, -inf,
    a row with factor 1.0 whose slot has seen ids (left as it is), rows sharing the scratch slot; then the mask
    after recording, with a token outside the window skipped."""
    from mstar_common.engine.penalty import PenaltyState
    from mstar_kernels.penalty import penalised_logits, record_seen

    gen = torch.Generator().manual_seed(vocab + 1)
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(dtype)
    logits[2, :: 7] = float("-inf")
    state = PenaltyState(4, vocab, 0, torch.device("cpu"))  # slots 0-3, scratch 4
    state.seen[:4] = torch.rand(4, vocab, generator=gen) < 0.3
    slots = torch.tensor([0, 1, 2, 4, 4, 3], dtype=torch.int32)
    factors = torch.tensor([1.3, 0.7, 2.0, 1.0, 1.0, 1.0])  # slot 3 has seen ids but its row's factor is 1.0
    expected = state.apply(logits.float(), slots, factors)
    assert not torch.equal(expected, logits.float()), "the penalty changes some logits"
    assert torch.equal(expected[5], logits[5].float())
    seen = state.seen.to(DEVICE).view(torch.uint8)
    got = penalised_logits(logits.to(DEVICE), seen, slots.to(DEVICE), factors.to(DEVICE))
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), expected)

    tokens = torch.tensor([5, vocab - 1, 0, 17, 17, vocab], dtype=torch.int64)  # the last is outside: skipped
    state.record(slots[:5], tokens[:5])
    record_seen(seen, slots.to(DEVICE), tokens.to(DEVICE))
    assert torch.equal(seen.cpu().bool(), state.seen)
