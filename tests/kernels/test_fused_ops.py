"""Fused norm/activation/prologue kernels and the on-device sampler vs their torch references."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, rel_err, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_common.layers.rotary import RotaryEmbedding  # noqa: E402
from mstar_kernels.layernorm import layer_norm, layer_norm_ref  # noqa: E402
from mstar_kernels.qk_norm_rope_kv import qk_norm_rope_kv, qk_norm_rope_kv_ref, store_kv, store_kv_ref  # noqa: E402
from mstar_kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from mstar_kernels.sampling import sample_on_device  # noqa: E402
from mstar_kernels.silu_mul import silu_mul, silu_mul_ref  # noqa: E402
from mstar_kernels.snake import snake, snake_dwconv_snake, snake_dwconv_snake_ref, snake_ref  # noqa: E402

TOL = 3e-2 if IS_INTERPRETED else 1e-2  # the interpreter truncates to bf16, compounding over roundings
DTYPES = sweep([torch.bfloat16, torch.float32], [torch.bfloat16, torch.float32])


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def _assert_residual_updated(res_out: torch.Tensor, res_ref: torch.Tensor, residual: torch.Tensor) -> None:
    """The fused norm stored `residual + x` back in place, rounded exactly like torch's add. The interpreter
    truncates to bf16 instead of rounding to nearest, so there a bf16 residual is held to TOL (fp32 stays exact)."""
    assert not torch.equal(res_ref, residual), "the reference left the residual as it was"
    if IS_INTERPRETED and res_out.dtype == torch.bfloat16:
        assert rel_err(res_out, res_ref) < TOL
    else:
        assert torch.equal(res_out, res_ref)


@pytest.mark.parametrize("hidden", sweep([1024, 3072, 5000], [64, 96]))
@pytest.mark.parametrize("num_tokens", sweep([1, 300], [1, 5]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(hidden, num_tokens, dtype):
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x, weight = _randn(num_tokens, hidden, dtype=dtype, gen=gen), _randn(hidden, dtype=dtype, gen=gen)
    assert rel_err(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6)) < TOL
    residual = _randn(num_tokens, hidden, dtype=dtype, gen=gen)
    res_out, res_ref = residual.clone(), residual.clone()
    out, ref = rms_norm(x, weight, 1e-6, res_out), rms_norm_ref(x, weight, 1e-6, res_ref)
    _assert_residual_updated(res_out, res_ref, residual)
    assert rel_err(out, ref) < TOL
    # Same roundings as the reference: nearly every element bit-equal.
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("hidden", sweep([1280, 384, 5000], [64, 96]))
@pytest.mark.parametrize("num_tokens", sweep([1, 300], [1, 5]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_with_and_without_residual(hidden, num_tokens, dtype):
    """Whisper's residual add + LayerNorm (weight and bias) against torch's add and F.layer_norm."""
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x = _randn(num_tokens, hidden, dtype=dtype, gen=gen, scale=3.0) + 0.5  # a non-zero mean to remove
    weight, bias = _randn(hidden, dtype=dtype, gen=gen), _randn(hidden, dtype=dtype, gen=gen)
    assert rel_err(layer_norm(x, weight, bias, 1e-5), layer_norm_ref(x, weight, bias, 1e-5)) < TOL
    residual = _randn(num_tokens, hidden, dtype=dtype, gen=gen)
    res_out, res_ref = residual.clone(), residual.clone()
    out, ref = layer_norm(x, weight, bias, 1e-5, res_out), layer_norm_ref(x, weight, bias, 1e-5, res_ref)
    _assert_residual_updated(res_out, res_ref, residual)
    assert rel_err(out, ref) < TOL
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.02  # one rounding of the fp32 affine result, as torch's kernel


@pytest.mark.parametrize("inter", sweep([3072, 8192], [48, 128]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(inter, dtype):
    x = _randn(9, 2 * inter, dtype=dtype, gen=torch.Generator().manual_seed(inter))
    out, ref = silu_mul(x), silu_mul_ref(x)
    assert rel_err(out, ref) < TOL
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", sweep([(128, 16, 8), (128, 24, 8), (64, 8, 2)],
                                                                     [(64, 4, 2), (128, 2, 1)]))
@pytest.mark.parametrize("has_norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [sweep(37, 6), 300])  # one token per program; 16 (a prefill, masked tail)
def test_qk_norm_rope_kv_write(head_dim, num_heads, num_kv_heads, has_norm, dtype, num_tokens):
    gen = torch.Generator().manual_seed(head_dim * num_heads)
    page_size = 16
    num_pages = -(-num_tokens // page_size) + 2
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen, scale=3.0)
    positions = torch.randint(0, 40000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 1e6)(positions, dtype)
    qw = _randn(head_dim, dtype=dtype, gen=gen) if has_norm else None
    kw = _randn(head_dim, dtype=dtype, gen=gen) if has_norm else None
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(torch.int32).to(DEVICE)
    caches = [torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(4)]
    q = qk_norm_rope_kv(qkv, cos, sin, qw, kw, 1e-6, caches[0], caches[1], slots, num_heads, num_kv_heads, head_dim)
    q_ref = qk_norm_rope_kv_ref(qkv, cos, sin, qw, kw, 1e-6, caches[2], caches[3], slots, num_heads, num_kv_heads,
                                head_dim)
    assert rel_err(q, q_ref) < TOL and rel_err(caches[0], caches[2]) < TOL
    assert torch.equal(caches[1], caches[3])  # v is copied verbatim
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (q != q_ref).float().mean() < 0.01 and (caches[0] != caches[2]).float().mean() < 0.01
    # the angles taken in-kernel from the positions: on the GPU the same bits as the tables torch computes
    rotary = RotaryEmbedding(head_dim, 1e6)
    k_pos, v_pos = torch.zeros_like(caches[0]), torch.zeros_like(caches[1])
    q_pos = qk_norm_rope_kv(qkv, None, None, qw, kw, 1e-6, k_pos, v_pos, slots, num_heads, num_kv_heads, head_dim,
                            positions=positions, inv_freq=rotary.inv_freq(positions.device))
    assert torch.equal(v_pos, caches[1])
    if IS_INTERPRETED:  # numpy's cos/sin stand in for libdevice's
        assert rel_err(q_pos, q) < TOL and rel_err(k_pos, caches[0]) < TOL
    else:
        assert torch.equal(q_pos, q) and torch.equal(k_pos, caches[0])
    if num_tokens <= 256:  # decode-sized: the angles, norm weights and slots read ahead of the PDL wait
        k_ahead, v_ahead = torch.zeros_like(caches[0]), torch.zeros_like(caches[1])
        q_ahead = qk_norm_rope_kv(qkv, None, None, qw, kw, 1e-6, k_ahead, v_ahead, slots, num_heads, num_kv_heads,
                                  head_dim, positions=positions, inv_freq=rotary.inv_freq(positions.device),
                                  ahead=True)
        assert torch.equal(q_ahead, q_pos) and torch.equal(k_ahead, k_pos) and torch.equal(v_ahead, v_pos)


# (KV heads, head dim, page size): the GQA layouts and head dims of the attention tests, and their other page sizes
STORE_KV_CASES = sweep([(2, 64, 16), (8, 128, 16), (1, 128, 64), (8, 64, 1), (4, 256, 16)], [(2, 64, 16), (1, 128, 4)])


@pytest.mark.parametrize("num_kv_heads,head_dim,page_size", STORE_KV_CASES)
def test_store_kv_writes_exactly_the_mapped_slots(num_kv_heads, head_dim, page_size):
    gen = torch.Generator().manual_seed(3 + head_dim + page_size)
    shape = (10, num_kv_heads, head_dim)
    key, value = _randn(*shape, dtype=torch.bfloat16, gen=gen), _randn(*shape, dtype=torch.bfloat16, gen=gen)
    num_pages = -(-64 // page_size)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:10].to(torch.int32).to(DEVICE)
    caches = [torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
              for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_device_sampler_greedy_filters_and_seeds():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = sweep(151936, 1000), 6
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE)
    col = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    is_greedy = col([True, False, False, False, False, False], torch.bool)
    temperature = col([1.0, 1.0, 0.7, 1.0, 1.0, 1.0], torch.float32)
    top_k = col([vocab, 1, vocab, 5, vocab, vocab], torch.int32)
    top_p = col([1.0, 1.0, 1.0, 1.0, 1e-6, 1.0], torch.float32)
    min_p = col([0.0, 0.0, 0.0, 0.0, 0.0, 0.999], torch.float32)
    seeds = col([1, 2, 3, 4, 5, 6], torch.int64)
    args = (logits, is_greedy, temperature, top_k, top_p, min_p, seeds)
    tokens = sample_on_device(*args)
    argmax = logits.argmax(-1)
    assert tokens[0] == argmax[0] and tokens[1] == argmax[1] and tokens[4] == argmax[4] and tokens[5] == argmax[5]
    assert int(tokens[3]) in logits[3].topk(5).indices.tolist()
    assert torch.equal(tokens, sample_on_device(*args))  # same seeds, same tokens
    draws = torch.stack([sample_on_device(logits[2:3], is_greedy[2:3], temperature[2:3], top_k[2:3], top_p[2:3],
                                          min_p[2:3], col([s], torch.int64)) for s in range(200)])
    assert len(set(draws.flatten().tolist())) > 20  # different seeds, different draws


@pytest.mark.parametrize("vocab", sweep([28_672, 151_936], [1000]))
def test_device_sampler_draws_the_same_tokens_with_the_sort_free_filter(monkeypatch, vocab):
    """MSTAR_TOP_P_KERNEL: the same kept sets feed the same seeded race, so the same tokens come out (at an
    audio window in one program a row, and at an LM's whole vocabulary by the chunked search). Rejection for
    flat top-p rows (MSTAR_TOP_P_REJECT) is another exact draw, with other tokens: off here."""
    import mstar_kernels.sampling as sampling

    monkeypatch.setattr(sampling, "_REJECT", False)

    gen = torch.Generator().manual_seed(1)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEVICE)
    col = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    args = (logits, col([False] * rows, torch.bool), col([0.6, 1.0, 0.6, 1.0, 0.6, 1.0], torch.float32),
            col([vocab, 40, vocab, vocab, 3, vocab], torch.int32), col([0.8, 1.0, 0.9, 0.5, 1.0, 0.95], torch.float32),
            col([0.0] * rows, torch.float32))
    draws = []
    for sort_free in (False, True):
        monkeypatch.setattr(sampling, "_SORT_FREE_FILTER", sort_free)
        draws.append(torch.stack([sampling.sample_on_device(*args, col([s + 10 * r for r in range(rows)], torch.int64))
                                  for s in range(20)]))
    assert torch.equal(draws[0], draws[1])
    assert len(set(draws[1][:, 0].tolist())) > 5  # the draws do vary with the seed


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("vocab", sweep([151_936, 128_256], [33_000]))
def test_the_fused_wide_draw_equals_the_filters_composed(vocab, fast, monkeypatch):
    """Past the register row, `sample_on_device` searches the cuts and draws in one pass over the raw logits
    (a cut row reads only the 512 columns whose maximum reaches its cut); its tokens equal the composed form's
    (tempered copy, filtered copy, min-p, noised argmax, greedy argmax; temperature alone: the inverse CDF at the
    row's uniform), row by row: greedy, temperature alone, top-k, top-p, both, min-p, and all of them; with the
    search's fast path and without. (A flat top-p row drawn by rejection is tested below; off here.)"""
    import mstar_kernels.sampling as sampling
    import mstar_kernels.top_k_top_p as filters
    from mstar_common.engine.sampler import apply_min_p
    from mstar_kernels.argmax import gumbel_argmax, row_argmax
    from mstar_kernels.sampling import inverse_cdf_ref, row_uniforms, sample_wide
    from mstar_kernels.top_k_top_p import top_k_top_p_chunked

    gen = torch.Generator().manual_seed(5)
    rows = 8
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEVICE)
    logits[3, :100] = float("-inf")
    col = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    is_greedy = col([True, False, False, False, False, False, False, False], torch.bool)
    temperature = col([1.0, 0.7, 1.0, 0.6, 1.3, 0.7, 1.0, 0.5], torch.float32)
    top_k = col([vocab, vocab, 20, vocab, 50, vocab, vocab, 40], torch.int32)
    top_p = col([1.0, 1.0, 1.0, 0.8, 0.9, 1.0, 1.0, 0.7], torch.float32)
    min_p = col([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.1], torch.float32)

    monkeypatch.setattr(filters, "FAST_PATH", fast)
    monkeypatch.setattr(sampling, "_REJECT", False)

    def composed(seeds):
        filtered = top_k_top_p_chunked(logits / temperature[:, None], top_k, top_p)
        sampled = gumbel_argmax(apply_min_p(filtered, min_p[:, None]).contiguous(), seeds)
        plain = (top_k == vocab) & (top_p == 1.0) & (min_p == 0.0)
        sampled = torch.where(plain, inverse_cdf_ref(logits, temperature, row_uniforms(seeds)), sampled)
        return torch.where(is_greedy, row_argmax(logits), sampled)

    draws = []
    for step in range(6):
        seeds = col([step * 100 + r for r in range(rows)], torch.int64)
        tokens = sample_wide(logits, is_greedy, temperature, top_k, top_p, min_p, seeds)
        assert torch.equal(tokens, composed(seeds)), (step, tokens.tolist(), composed(seeds).tolist())
        draws.append(tokens)
    draws = torch.stack(draws)
    assert (draws[:, 0] == logits[0].argmax()).all()
    assert set(draws[:, 2].tolist()) <= set(logits[2].topk(20).indices.tolist())
    assert len(set(draws[:, 1].tolist())) > 3 and not (draws[:, 3] < 100).any()


@pytest.mark.parametrize("vocab", sweep([151_936, 128_256], [33_000]))
def test_rows_with_no_filter_draw_by_the_inverse_cdf(vocab):
    """A row with temperature alone draws the token at its uniform `u` of the softmax's CDF (the fp64 reference),
    whether the step has filtering rows (the search runs) or not (`filters=False`, no search), from fp32 or bf16
    logits, with masked columns and an all -inf row (token 0) among them; greedy rows keep their argmax."""
    from mstar_kernels.sampling import inverse_cdf_ref, row_uniforms, sample_wide

    gen = torch.Generator().manual_seed(11)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEVICE)
    logits[2, : vocab // 2] = float("-inf")  # the first chunks hold no mass
    logits[3] = float("-inf")
    logits[4, 5000:] = float("-inf")  # the last chunks hold none
    col = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    is_greedy = col([True, False, False, False, False, False], torch.bool)
    temperature = col([1.0, 0.7, 1.0, 1.0, 1.5, 1.0], torch.float32)
    off = (col([vocab] * rows, torch.int32), col([1.0] * rows, torch.float32), col([0.0] * rows, torch.float32))
    # two filtering rows in the same step: the plain rows' tokens must not change
    cut = (col([vocab] * rows + [20, vocab], torch.int32), col([1.0] * rows + [1.0, 0.8], torch.float32),
           col([0.0] * (rows + 2), torch.float32))
    mixed_logits = torch.cat([logits, logits[1:3]])
    mixed_greedy, mixed_temperature = torch.cat([is_greedy, is_greedy[1:3]]), torch.cat([temperature, temperature[1:3]])
    drawn = []
    for step in range(8):
        seeds = col([step * 1000 + 17 * r for r in range(rows)], torch.int64)
        expected = torch.where(is_greedy, logits.argmax(-1), inverse_cdf_ref(logits, temperature, row_uniforms(seeds)))
        tokens = sample_wide(logits, is_greedy, temperature, *off, seeds, filters=False)
        assert torch.equal(tokens, expected), (step, tokens.tolist(), expected.tolist())
        assert torch.equal(sample_wide(logits, is_greedy, temperature, *off, seeds), tokens)
        mixed = sample_wide(mixed_logits, mixed_greedy, mixed_temperature, *cut, torch.cat([seeds, seeds[:2]]))
        assert torch.equal(mixed[:rows], tokens)
        half = logits.to(torch.bfloat16)
        assert torch.equal(sample_wide(half, is_greedy, temperature, *off, seeds, filters=False),
                           torch.where(is_greedy, half.float().argmax(-1),
                                       inverse_cdf_ref(half.float(), temperature, row_uniforms(seeds))))
        drawn.append(tokens)
    drawn = torch.stack(drawn)
    assert (drawn[:, 3] == 0).all() and (drawn[:, 2] >= vocab // 2).all() and (drawn[:, 4] < 5000).all()
    assert len(set(drawn[:, 1].tolist())) == len(drawn)  # a flat row: every step draws another token


@pytest.mark.parametrize("vocab", sweep([151_936], [33_000]))
def test_flat_top_p_rows_drawn_by_rejection(vocab, monkeypatch):
    """`MSTAR_TOP_P_REJECT`: a top-p row (min-p allowed) that the fast path declines takes the first of its
    candidates (the inverse CDF of the whole softmax at its uniforms 0..7) that the composed filters keep; a row
    whose candidates all fall outside its nucleus, a row the fast path finishes, a top-k row and a greedy row keep
    the tokens they draw without rejection."""
    import mstar_kernels.sampling as sampling
    from mstar_common.engine.sampler import apply_min_p, apply_top_k_top_p
    from mstar_kernels.top_k_top_p import ChunkedSearch

    gen = torch.Generator().manual_seed(21)
    rows = 7
    logits = torch.randn(rows, vocab, generator=gen) / 0.6  # flat: top-p keeps thousands, the fast path declines
    logits[2, :5000] = float("-inf")
    logits[6] *= 8  # peaked: the fast path finishes it
    logits = logits.to(DEVICE)
    col = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    is_greedy = col([False, False, False, True, False, False, False], torch.bool)
    temperature = col([1.0, 0.7, 1.0, 1.0, 0.9, 1.0, 1.0], torch.float32)
    top_k = col([vocab] * 5 + [20, vocab], torch.int32)
    top_p = col([0.8, 0.9, 0.95, 0.8, 0.3, 0.8, 0.9], torch.float32)
    min_p = col([0.0, 0.0, 0.0, 0.0, 0.0005, 0.0, 0.0], torch.float32)
    kept = torch.isfinite(apply_min_p(apply_top_k_top_p(logits / temperature[:, None], top_k[:, None].long(),
                                                         top_p[:, None]), min_p[:, None]))
    search = ChunkedSearch(logits)
    search.run(temperature, top_k, top_p, min_p)
    declined = (~is_greedy) & (top_k == vocab) & (search.done == 0)
    assert declined.tolist() == [True, True, True, False, True, False, False]
    drawn = 0
    for step in range(4):
        seeds = col([step * 1000 + 31 * r + 7 for r in range(rows)], torch.int64)
        args = (logits, is_greedy, temperature, top_k, top_p, min_p, seeds)
        monkeypatch.setattr(sampling, "_REJECT", False)
        plain = sampling.sample_wide(*args)
        monkeypatch.setattr(sampling, "_REJECT", True)
        tokens = sampling.sample_wide(*args)
        candidates = torch.stack([sampling.inverse_cdf_ref(logits, temperature, sampling.row_uniforms(seeds, k))
                                  for k in range(sampling.REJECT_CANDIDATES)], dim=1)
        inside = kept.gather(1, candidates)
        first = candidates.gather(1, inside.int().argmax(dim=1, keepdim=True))[:, 0]
        expected = torch.where(declined & inside.any(dim=1), first, plain)
        assert torch.equal(tokens, expected), (step, tokens.tolist(), expected.tolist())
        assert kept.gather(1, tokens[:, None])[:, 0][~is_greedy].all()  # every sampled token is inside its nucleus
        drawn += int((declined & inside.any(dim=1)).sum())
    assert drawn >= 12  # most declined rows were drawn by rejection


def test_the_inverse_cdf_draws_follow_the_softmax():
    """The rows' uniforms are uniform on [0, 1) and uncorrelated across seeds, and a row whose mass sits in six
    columns spread over four chunks draws each at its softmax probability."""
    from mstar_kernels.argmax import BLOCK
    from mstar_kernels.sampling import row_uniforms, sample_wide

    n = sweep(20_000, 2_000)
    u = row_uniforms(torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + 5).cpu().sort().values
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert float((u - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max()) < 1.7 / n ** 0.5  # KS, p ~ 0.006
    raw = row_uniforms(torch.arange(n, dtype=torch.int64, device=DEVICE)).cpu()
    assert abs(float(torch.corrcoef(torch.stack([raw[:-1], raw[1:]]))[0, 1])) < 4 / n ** 0.5
    vocab = 4 * BLOCK + 100
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03], dtype=torch.float64)
    columns = [3, 5000, BLOCK - 1, 2 * BLOCK + 17, 3 * BLOCK, vocab - 1]
    logits = torch.full((n, vocab), float("-inf"))
    logits[:, columns] = probs.log().float()
    col = torch.zeros(n, dtype=torch.int32, device=DEVICE) + vocab
    tokens = sample_wide(logits.to(DEVICE), torch.zeros(n, dtype=torch.bool, device=DEVICE),
                         torch.ones(n, device=DEVICE), col, torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE),
                         torch.arange(n, dtype=torch.int64, device=DEVICE) * 104729 + 1, filters=False).cpu()
    assert set(tokens.tolist()) <= set(columns)
    freq = torch.tensor([(tokens == c).sum().item() for c in columns], dtype=torch.float64) / n
    assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / n).sqrt()).all(), freq


@pytest.mark.parametrize("batch,channels,length", sweep([(1, 64, 8192), (7, 512, 128), (3, 1024, 16)],
                                                        [(2, 8, 40), (1, 3, 300)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_snake(batch, channels, length, dtype):
    gen = torch.Generator().manual_seed(channels + length)
    x = _randn(batch, channels, length, dtype=dtype, gen=gen, scale=2.0)
    alpha = (torch.rand(1, channels, 1, generator=gen) * 2 + 0.05).to(dtype).to(DEVICE)
    out, ref = snake(x, alpha), snake_ref(x, alpha)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < (TOL if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("batch,channels,length,dilation", sweep([(4, 64, 2200, 9), (7, 256, 400, 3), (2, 512, 128, 1)],
                                                                 [(2, 4, 50, 3), (1, 3, 20, 9)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_snake_dwconv_snake(batch, channels, length, dilation, dtype):
    """SNAC's residual-unit head; dilation 9 on 20 samples puts most taps in the zero padding."""
    gen = torch.Generator().manual_seed(channels * dilation + length)
    x = _randn(batch, channels, length, dtype=dtype, gen=gen, scale=2.0)
    alpha1, alpha2 = ((torch.rand(1, channels, 1, generator=gen) * 2 + 0.05).to(dtype).to(DEVICE) for _ in range(2))
    weight = _randn(channels, 1, 7, dtype=dtype, gen=gen, scale=0.3)
    bias = _randn(channels, dtype=dtype, gen=gen, scale=0.1)
    out = snake_dwconv_snake(x, alpha1, weight, bias, dilation, alpha2)
    ref = snake_dwconv_snake_ref(x, alpha1, weight, bias, dilation, alpha2)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < (TOL if dtype == torch.bfloat16 else 1e-5)


def test_kv_writes_into_an_fp8_pool():
    """`resources.kv_cache.dtype: fp8_e4m3`: both KV writers round into the e4m3 pool like torch does.

    Triton's interpreter rounds to e4m3 wrongly when rounding carries into the exponent (1.96 -> 1.0), so on
    the CPU the inputs are e4m3 values already (the write path and layout are checked, not the rounding)."""
    gen = torch.Generator().manual_seed(5)
    fp8 = torch.float8_e4m3fn
    dtype = torch.float32 if IS_INTERPRETED else torch.bfloat16  # the interpreter mis-casts bf16 bits too

    def values(*shape, scale=1.0):
        x = _randn(*shape, dtype=dtype, gen=gen, scale=scale)
        return x.to(fp8).to(dtype) if IS_INTERPRETED else x

    key, value = values(10, 2, 64), values(10, 2, 64)
    slots = torch.randperm(64, generator=gen)[:10].to(torch.int32).to(DEVICE)
    caches = [torch.zeros(4, 16, 2, 64, dtype=fp8, device=DEVICE) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert all(torch.equal(a.float(), b.float()) for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))
    assert caches[0].float().abs().sum() > 0
    head_dim, num_heads, num_kv_heads, num_tokens = 64, 4, 2, 6
    qkv = values(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, scale=3.0)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 1e6)(positions, dtype)
    caches = [torch.zeros(4, 16, num_kv_heads, head_dim, dtype=fp8, device=DEVICE) for _ in range(4)]
    slots = slots[:num_tokens]
    q = qk_norm_rope_kv(qkv, cos, sin, None, None, 1e-6, caches[0], caches[1], slots, num_heads, num_kv_heads, head_dim)
    q_ref = qk_norm_rope_kv_ref(qkv, cos, sin, None, None, 1e-6, caches[2], caches[3], slots, num_heads, num_kv_heads,
                                head_dim)
    assert rel_err(q, q_ref) < TOL
    assert torch.equal(caches[1].float(), caches[3].float())  # v: one rounding on both sides
    k_out, k_ref = caches[0].float(), caches[2].float()
    if IS_INTERPRETED:  # rotated k is not an e4m3 value: the interpreter's carry bug hits a few percent
        assert ((k_out - k_ref).abs() > 1e-6).float().mean() < 0.1
    else:
        assert rel_err(k_out, k_ref) < 0.07  # e4m3: 3 mantissa bits; rope in fp32 (kernel) vs bf16 (reference)
