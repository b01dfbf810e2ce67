"""The attention prologue in one launch: per-head q/k RMSNorm (optional) + RoPE + paged KV write.

Input is the packed projection `qkv` `[T, (Hq + 2 Hkv) * D]` (q heads, then k heads, then v heads). Output is
the rotated query `[T, Hq, D]`; the rotated key and the value are written to the paged caches at
`slot_mapping[t]`. The RoPE angles come either from `cos`/`sin` `[T, D]`, the step's tables in the activation
dtype (rotate-half layout, so each half repeats), or from `positions` `[T]` and `inv_freq` `[D/2]` (fp32): the
kernel then takes `cos(position * inv_freq)` itself, with the same fp32 product and the same libdevice cos/sin as
torch's ops on the GPU, so the model's step launches none of the table ops (a cast, a product, a concatenation,
cos, sin and two casts: seven launches ahead of every decode step). Roundings follow the unfused torch ops (norm,
weight multiply, `x*cos`, `rot*sin`, sum), so the fused path gives the same bits as the eager layers in nearly
every case.

`store_kv` is the plain KV write (no norm, no RoPE) used by the unfused path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mstar_common.config import env_switch
from mstar_kernels._pdl import gdc_enter, gdc_start, pdl_launch, trigger_mode
from mstar_kernels._rounding import round_to


@triton.jit
def cos_sin(angle, INTERPRETED: tl.constexpr):
    """libdevice's cos and sin (torch's CUDA kernels call the same); the interpreter has no libdevice, so numpy's
    stand in there."""
    if INTERPRETED:
        return tl.cos(angle), tl.sin(angle)
    return libdevice.cos(angle), libdevice.sin(angle)


@triton.jit
def _qk_norm_rope_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                            num_tokens, stride_tok, stride_cos, stride_qo_tok, stride_slot, stride_kv_head, eps,
                            NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            HAS_NORM: tl.constexpr, FROM_POSITIONS: tl.constexpr, INTERPRETED: tl.constexpr,
                            BLOCK_T: tl.constexpr, HEADS_PER_PROG: tl.constexpr, AHEAD: tl.constexpr,
                            USE_GDC: tl.constexpr):
    """Program (token block, head group): BLOCK_T tokens of HEADS_PER_PROG q/k heads, which share the token's
    angles. With FROM_POSITIONS, `cos_ptr` is the positions [T] and `sin_ptr` the inverse frequencies [D/2] (fp32).
    `AHEAD` (under PDL, the angles from positions, one head a program): the angles, the norm weights and the slots
    come before the wait, since they are step inputs and weights that no kernel of the step writes; only the
    projection's output is read after it."""
    if AHEAD:
        gdc_start(USE_GDC)
    else:
        gdc_enter(USE_GDC)
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < num_tokens
    rows = t_mask[:, None]
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)[None, :]
    dtype = qkv_ptr.dtype.element_ty
    if FROM_POSITIONS:  # torch: positions.float() * inv_freq, then cos/sin, then a cast to the model dtype
        angle = tl.load(cos_ptr + tok, mask=t_mask, other=0).to(tl.float32)[:, None] * tl.load(sin_ptr + d)
        c, s = cos_sin(angle, INTERPRETED)
        c = c.to(dtype).to(tl.float32)
        s = s.to(dtype).to(tl.float32)
    else:
        c = tl.load(cos_ptr + tok[:, None] * stride_cos + d, mask=rows, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None] * stride_cos + d, mask=rows, other=0.0).to(tl.float32)
    if AHEAD:
        head = tl.program_id(1)
        w1, w2 = _norm_weights(qw_ptr, kw_ptr, head, NUM_Q_HEADS, HEAD_DIM, HAS_NORM)
        slot = tl.load(slot_ptr + tok, mask=t_mask, other=0).to(tl.int64)[:, None]
        gdc_enter(USE_GDC, True)
        _rotate_head(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, tok, t_mask, head, c, s, w1, w2, slot, stride_tok,
                     stride_qo_tok, stride_slot, stride_kv_head, eps, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM)
    else:
        slot = tl.load(slot_ptr + tok, mask=t_mask, other=0).to(tl.int64)[:, None]
        for i in range(HEADS_PER_PROG):
            head = tl.program_id(1) * HEADS_PER_PROG + i
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                w1, w2 = _norm_weights(qw_ptr, kw_ptr, head, NUM_Q_HEADS, HEAD_DIM, HAS_NORM)
                _rotate_head(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, tok, t_mask, head, c, s, w1, w2, slot,
                             stride_tok, stride_qo_tok, stride_slot, stride_kv_head, eps, NUM_Q_HEADS, NUM_KV_HEADS,
                             HEAD_DIM, HAS_NORM)


@triton.jit
def _norm_weights(qw_ptr, kw_ptr, head, NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """The two halves of the q or k norm weight for `head` (fp32; ones without the norm, unused then)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)[None, :]
    if HAS_NORM:
        is_q = head < NUM_Q_HEADS
        w1 = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d), tl.load(kw_ptr + HALF + d)).to(tl.float32)
    else:
        w1 = tl.full([1, HALF], 1.0, tl.float32)
        w2 = w1
    return w1, w2


@triton.jit
def _rotate_head(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, tok, t_mask, head, c, s, w1, w2, slot, stride_tok,
                 stride_qo_tok, stride_slot, stride_kv_head, eps, NUM_Q_HEADS: tl.constexpr,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head of BLOCK_T tokens: q/k norm with the weight halves `w1`/`w2`, RoPE, and the store of q, or of k and
    v at the tokens' `slot`s [BLOCK_T, 1]."""
    rows = t_mask[:, None]
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)[None, :]
    base = qkv_ptr + tok[:, None] * stride_tok + head * HEAD_DIM + d
    x1 = tl.load(base, mask=rows, other=0.0)
    x2 = tl.load(base + HALF, mask=rows, other=0.0)
    is_kv = head >= NUM_Q_HEADS
    kv_head = head - NUM_Q_HEADS
    dd = tl.arange(0, HEAD_DIM)[None, :]
    # a k head's value row, in the same trip to L2 as its key (behind the key's stores it would take a second);
    # the head test broadcast over the rows, since the interpreter takes no scalar in a mask
    kv_rows = rows & (tok[:, None] * 0 + head >= NUM_Q_HEADS)
    v = tl.load(qkv_ptr + tok[:, None] * stride_tok + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dd,
                mask=kv_rows, other=0.0)
    dtype = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / HEAD_DIM
        rstd = tl.rsqrt(var + eps)[:, None]
        a1 = round_to(round_to(a1 * rstd, dtype) * w1, dtype)
        a2 = round_to(round_to(a2 * rstd, dtype) * w2, dtype)
    out1 = (round_to(a1 * c, dtype) - round_to(a2 * s, dtype)).to(dtype)
    out2 = (round_to(a2 * c, dtype) + round_to(a1 * s, dtype)).to(dtype)
    if not is_kv:
        q_base = q_out_ptr + tok[:, None] * stride_qo_tok + head * HEAD_DIM + d
        tl.store(q_base, out1, mask=rows)
        tl.store(q_base + HALF, out2, mask=rows)
    else:
        k_base = k_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + d
        cache_type = k_cache_ptr.dtype.element_ty  # explicit casts: the pool may be fp8 (e4m3)
        tl.store(k_base, out1.to(cache_type), mask=rows)
        tl.store(k_base + HALF, out2.to(cache_type), mask=rows)
        tl.store(v_cache_ptr + slot * stride_slot + kv_head * stride_kv_head + dd, v.to(cache_type), mask=rows)


def decode_prefetch() -> bool:
    """`MSTAR_DECODE_PREFETCH` (default 1): under PDL (decode steps of up to `MSTAR_PDL_MAX_ROWS` rows) each decode
    launch reads ahead of its wait what no kernel of the step writes. The prologue here takes its angles and loads
    its norm weights and slots before it waits for the qkv projection (not under `MSTAR_PDL_TRIGGER=ahead`, where
    a kernel before the projection may still run); the split attention kernel (mstar_kernels/paged_decode_attention.py)
    loads its first block of context before it waits for the prologue (where its grid still fits one wave at
    that form's occupancy: `paged_decode_attention.prefetch_fits`), and the merge reads the step's lengths
    before it waits for the split kernel. That is safe for decode steps: positions, slots and lengths are step
    inputs, and the prologue writes only each row's newest token (position `ctx - 1`), which the split reads after
    the wait. `MSTAR_PROLOGUE_AHEAD=0` turns off the prologue's part alone, for A/Bs. Read at each launch, so at
    capture for a graph."""
    return env_switch("MSTAR_DECODE_PREFETCH", True)


_ONE_TOKEN_MAX = 256  # tokens up to which the prologue runs one token per program
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it once, at import, too


def _check_cache(cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    assert cache.dim() == 4 and cache.shape[2:] == (num_kv_heads, head_dim), "cache must be [P, page, Hkv, D]"
    assert cache.stride(3) == 1 and cache.stride(2) == head_dim and cache.stride(0) == cache.shape[1] * cache.stride(1)


def qk_norm_rope_kv(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                    head_dim: int, positions: torch.Tensor | None = None,
                    inv_freq: torch.Tensor | None = None, ahead: bool | None = None) -> torch.Tensor:
    """Returns the rotated query `[T, Hq, D]`; writes rotated k and v into the caches. RoPE from the `cos`/`sin`
    tables, or (both None) from `positions` and `inv_freq`. `ahead`: the angles, norm weights and slots before the
    PDL wait (the kernel's `AHEAD`); by default under PDL with `decode_prefetch()`, for decode-sized steps with the
    angles from positions; True forces it there (tests: the same bits)."""
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    from_positions = cos is None
    if from_positions:
        assert sin is None and positions is not None and positions.shape == (num_tokens,)
        assert inv_freq is not None and inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32
        cos, sin = positions, inv_freq.contiguous()
        stride_cos = 0
    else:
        assert cos.shape == sin.shape == (num_tokens, head_dim) and cos.stride(1) == 1 and cos.stride() == sin.stride()
        stride_cos = cos.stride(0)
    assert slot_mapping.shape == (num_tokens,) and head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0
    _check_cache(k_cache, num_kv_heads, head_dim)
    assert v_cache.stride() == k_cache.stride() and v_cache.dtype == k_cache.dtype
    assert k_cache.dtype in (qkv.dtype, torch.float8_e4m3fn), "the pool holds the model dtype or fp8 (e4m3)"
    has_norm = q_weight is not None
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    qw = q_weight if has_norm else qkv
    kw = k_weight if has_norm else qkv
    # One (token, head) per program while the grid is small (decode steps); a prefill's thousands of tokens go 16
    # to a program (4 warps) and 8 heads, which share the angles: one (token, head) per program made a 4,096-token
    # Qwen3-0.6B step's prologue 61 us per layer.
    block_t, heads_per_prog = (1, 1) if num_tokens <= _ONE_TOKEN_MAX else (16, 8)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_heads + num_kv_heads, heads_per_prog))
    pdl = pdl_launch(qkv, num_tokens, grid[0] * grid[1], kind="prologue")
    if ahead is None:
        ahead = (bool(pdl["USE_GDC"]) and trigger_mode() != "ahead" and from_positions and heads_per_prog == 1
                 and decode_prefetch() and env_switch("MSTAR_PROLOGUE_AHEAD", True))
    assert not ahead or (from_positions and heads_per_prog == 1), "ahead: angles from positions, <= 256 tokens"
    _qk_norm_rope_kv_kernel[grid](
        qkv, cos, sin, qw, kw, slot_mapping, query, k_cache, v_cache,
        num_tokens, qkv.stride(0), stride_cos, query.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_NORM=has_norm,
        FROM_POSITIONS=from_positions, INTERPRETED=INTERPRETED, BLOCK_T=block_t,
        HEADS_PER_PROG=heads_per_prog, AHEAD=ahead, num_warps=1 if block_t == 1 else 4, **pdl,
    )
    return query


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qk_norm_rope_kv_ref(qkv, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, num_heads,
                        num_kv_heads, head_dim) -> torch.Tensor:
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = _rms(q, q_weight, eps), _rms(k, k_weight, eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k_tok, stride_k_head, stride_v_tok,
                     stride_v_head, stride_slot, stride_kv_head, HEAD_DIM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    dst = slot * stride_slot + head * stride_kv_head + d
    cache_type = k_cache_ptr.dtype.element_ty  # explicit casts: the pool may be fp8 (e4m3)
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + tok * stride_k_tok + head * stride_k_head + d).to(cache_type))
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + tok * stride_v_tok + head * stride_v_head + d).to(cache_type))


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`key`/`value` `[T, Hkv, D]` (unit stride on D) -> the caches at `slot_mapping` `[T]`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and key.stride(2) == 1 and value.stride(2) == 1
    assert slot_mapping.shape == (num_tokens,) and (head_dim & (head_dim - 1)) == 0
    _check_cache(k_cache, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2), HEAD_DIM=head_dim, num_warps=1,
    )


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    from mstar_common.engine.attention import write_slots

    slots = slot_mapping.long()
    for cache, src in ((k_cache, key), (v_cache, value)):
        write_slots(cache, slots, src)
