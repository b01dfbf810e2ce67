"""mstar_kernels/staged_gemv.py's settings in the GEMV plans: which fit, which `tune_gemv` tries, and when it tries
them (a bf16 weight on a Hopper-or-newer GPU where the kernel builds, at PDL row counts, `MSTAR_GEMV_STAGED` on)."""

import pytest
import torch

from mstar_common.layers.linear import gemv_candidates, staged_candidates_for
from mstar_kernels import staged_gemv as staged


def test_fits_bounds_rows_k_columns_and_shared_memory():
    assert staged.fits(1, 4096, 1024, 16)
    assert staged.smem_bytes(1, 1024, 16) == 17 * 1024 * 2
    assert not staged.fits(5, 4096, 1024, 16)  # at most 4 rows
    assert not staged.fits(1, 4096, 1020, 16)  # K a multiple of 8 (16-byte rows)
    assert not staged.fits(1, 4096, 1024, 65)  # 8 warps x 8 barrier groups
    assert staged.fits(1, 3072, 8192, 8) and not staged.fits(1, 3072, 8192, 16)  # 17 x 16 KB > 227 KB


def test_candidates_cover_the_sms_without_idle_ones():
    # Qwen3-0.6B qkv (4096 x 1024): 64 columns leave 64 CTAs, under half of 132 SMs; 2 leave 2,048, over 8 per SM
    assert staged.candidates(1, 4096, 1024) == [(staged.STAGED, c) for c in (4, 8, 16, 24, 32, 48)]
    # Llama-3.2-3B down (3072 x 8192): 16 columns take 272 KB of shared memory
    assert staged.candidates(1, 3072, 8192) == [(staged.STAGED, 4), (staged.STAGED, 8)]
    assert staged.candidates(1, 64, 1024) == []  # 8 CTAs at most: too few for any


def test_gemv_candidates_add_them_only_when_asked():
    pytest.importorskip("triton")
    plain = gemv_candidates(1, 4096, 1024)
    assert not [s for s in plain if s[0] == staged.STAGED]
    with_staged = gemv_candidates(1, 4096, 1024, staged=True)
    assert with_staged[:len(plain)] == plain
    assert with_staged[len(plain):] == staged.candidates(1, 4096, 1024)


def test_not_tried_off_a_hopper_gpu_or_when_switched_off(monkeypatch):
    weight = torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.delenv("MSTAR_GEMV_STAGED", raising=False)
    assert not staged.enabled()  # off by default
    monkeypatch.setenv("MSTAR_GEMV_STAGED", "1")
    assert staged.enabled()
    assert not staged.available(weight) and not staged_candidates_for(weight, 1)  # a CPU tensor
    monkeypatch.setattr(staged, "available", lambda w: True)  # as on a Hopper GPU with nvcc
    assert not staged_candidates_for(weight, staged.MAX_ROWS + 1)
    monkeypatch.setenv("MSTAR_GEMV_STAGED", "0")
    assert not staged_candidates_for(weight, 1)


def test_readable_needs_aligned_bf16_rows():
    x = torch.zeros(2, 1032, dtype=torch.bfloat16)
    weight = torch.zeros(16, 1024, dtype=torch.bfloat16)
    assert staged.readable(x[:, :1024], weight, None)
    assert not staged.readable(x[:, 1:1025], weight, None)  # a 2-byte offset
    assert not staged.readable(x[:, :1024].float(), weight.float(), None)
    assert not staged.readable(torch.zeros(2, 1028, dtype=torch.bfloat16)[:, :1024], weight, None)  # row stride 1028


@pytest.mark.parametrize("bad", ["x", "0x1"])
def test_the_switch_is_checked(monkeypatch, bad):
    monkeypatch.setenv("MSTAR_GEMV_STAGED", bad)
    with pytest.raises(ValueError, match="MSTAR_GEMV_STAGED"):
        staged.enabled()


def test_auto_columns_leave_at_most_two_ctas_per_sm():
    assert staged.auto_cols(1, 4096, 1024) == 16  # 256 CTAs
    assert staged.auto_cols(1, 1024, 3072) == 4  # 256
    assert staged.auto_cols(1, 16384, 3072) == 32  # 48 and 64 do not fit: the most that fit
    assert staged.auto_cols(1, 3072, 70000) is None


def test_forcing_the_staged_kernel_is_parsed_and_checked(monkeypatch):
    from mstar_common.layers.linear import forced_gemv_settings

    monkeypatch.setenv("MSTAR_GEMV_FORCE", "1:staged/0;2:staged/16")
    assert forced_gemv_settings() == {1: (staged.STAGED, 0), 2: (staged.STAGED, 16)}
    for bad in ("8:staged/16", "1:staged/65", "1:staged/x"):
        monkeypatch.setenv("MSTAR_GEMV_FORCE", bad)
        with pytest.raises(ValueError, match="ROWS:staged/COLS"):
            forced_gemv_settings()
