"""Programmatic Dependent Launch (mstar_kernels/_pdl.py): the decode kernels give the same bits with and without it,
eager and inside a captured CUDA graph, where the launches overlap."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import IS_INTERPRETED

pytest.importorskip("triton")

from mstar_kernels import _pdl  # noqa: E402


def test_switch_and_launch_keywords(monkeypatch):
    monkeypatch.setenv("MSTAR_PDL", "0")
    assert not _pdl.enabled() and _pdl.pdl_launch(torch.zeros(1), 1) == {"USE_GDC": False}
    monkeypatch.setenv("MSTAR_PDL", "1")
    assert _pdl.enabled() and _pdl.max_rows() == 2
    assert _pdl.pdl_launch(torch.zeros(1), 1) == {"USE_GDC": False}  # a CPU tensor never launches with PDL
    monkeypatch.setenv("MSTAR_PDL", "yes")
    with pytest.raises(ValueError, match="MSTAR_PDL='yes': expected 0 or 1"):
        _pdl.enabled()
    monkeypatch.setenv("MSTAR_PDL_MAX_ROWS", "-1")
    with pytest.raises(ValueError, match="MSTAR_PDL_MAX_ROWS='-1'"):
        _pdl.max_rows()


def test_trigger_modes(monkeypatch):
    monkeypatch.setattr(_pdl, "use_pdl", lambda tensor, rows: True)
    monkeypatch.setattr(_pdl, "_num_sms", lambda device: 132)
    x = torch.zeros(1)
    monkeypatch.delenv("MSTAR_PDL_TRIGGER", raising=False)
    assert _pdl.pdl_launch(x, 64, 512) == {"USE_GDC": 1, "launch_pdl": True}  # early: every grid triggers
    monkeypatch.setenv("MSTAR_PDL_TRIGGER", "fit")
    assert _pdl.pdl_launch(x, 1, 132) == {"USE_GDC": 1, "launch_pdl": True}  # one wave: triggers
    assert _pdl.pdl_launch(x, 64, 133) == {"USE_GDC": 2, "launch_pdl": True}  # deeper: waits only
    assert _pdl.pdl_launch(x, 64) == {"USE_GDC": 1, "launch_pdl": True}  # grid not given
    monkeypatch.setenv("MSTAR_PDL_TRIGGER", "ahead")
    assert _pdl.pdl_launch(x, 64, 512) == {"USE_GDC": 3, "launch_pdl": True}  # triggers before its wait
    monkeypatch.setenv("MSTAR_PDL_TRIGGER", "early")  # per kind: the prologue, o, gate_up, down by default
    monkeypatch.delenv("MSTAR_PDL_AHEAD_OF", raising=False)
    assert _pdl.pdl_launch(x, 1, 24, kind="prologue") == {"USE_GDC": 3, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 512, kind="o_proj") == {"USE_GDC": 3, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 80, kind="split") == {"USE_GDC": 1, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 384, kind="down_proj") == {"USE_GDC": 3, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 256, kind="qkv_proj") == {"USE_GDC": 1, "launch_pdl": True}
    monkeypatch.setenv("MSTAR_PDL_AHEAD_OF", "none")
    assert _pdl.pdl_launch(x, 1, 24, kind="prologue") == {"USE_GDC": 1, "launch_pdl": True}
    monkeypatch.setenv("MSTAR_PDL_AHEAD_OF", "merge+ gemv:1024x2048")
    assert _pdl.pdl_launch(x, 1, 16, kind="merge") == {"USE_GDC": 3, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 512, kind="gemv:1024x2048") == {"USE_GDC": 3, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 1, 256, kind="gemv:4096x1024") == {"USE_GDC": 1, "launch_pdl": True}
    monkeypatch.setenv("MSTAR_PDL_TRIGGER", "fit")
    assert _pdl.pdl_launch(x, 1, 16, kind="merge") == {"USE_GDC": 1, "launch_pdl": True}  # early only
    monkeypatch.setenv("MSTAR_PDL_SKIP", "split + mid:o_proj")  # A/Bs: these kinds launch as without PDL
    assert _pdl.pdl_launch(x, 1, 80, kind="split") == {"USE_GDC": 0}
    assert _pdl.pdl_launch(x, 8, 64, kind="mid:o_proj") == {"USE_GDC": 0}
    assert _pdl.pdl_launch(x, 8, 64, kind="mid:down_proj") == {"USE_GDC": 1, "launch_pdl": True}
    assert _pdl.pdl_launch(x, 8, 64) == {"USE_GDC": 1, "launch_pdl": True}
    monkeypatch.delenv("MSTAR_PDL_SKIP")
    monkeypatch.setenv("MSTAR_PDL_TRIGGER", "late")
    with pytest.raises(ValueError, match="MSTAR_PDL_TRIGGER='late': expected one of early, fit, ahead"):
        _pdl.pdl_launch(x, 64, 512)


def _decode_layer_chain(rows: int, rope_in_attention: bool = False):
    """A one-layer decode chain through every kernel that launches with PDL: RMSNorm (with the residual add) ->
    qkv GEMV -> q/k norm + RoPE + KV write -> split-K decode attention + merge -> o GEMV -> RMSNorm -> gate_up
    GEMV -> down GEMV (SwiGLU on load) -> argmax of a logits GEMV. `rope_in_attention`: the prologue inside the
    decode kernel, which reads the pool's older tokens before its wait. At one row the prologue takes its angles
    from the positions (as served; its step inputs then load ahead of its wait) and gate_up takes its RMSNorm
    inside (`norm_gemv`, the whole of K in one chunk: its input read once after the wait)."""
    from mstar_kernels.argmax import row_argmax
    from mstar_kernels.gemv import gemv, norm_gemv
    from mstar_kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_rope
    from mstar_kernels.qk_norm_rope_kv import qk_norm_rope_kv
    from mstar_kernels.rmsnorm import rms_norm

    hidden, heads, kv_heads, head_dim, inter, vocab, page, ctx = 1024, 16, 8, 128, 3072, 4096, 64, 200
    gen = torch.Generator(device="cuda").manual_seed(rows)
    rand = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=gen) * scale).bfloat16()  # noqa: E731
    w = {"n1": 1 + rand(hidden, scale=0.1), "n2": 1 + rand(hidden, scale=0.1), "qn": 1 + rand(head_dim, scale=0.1),
         "kn": 1 + rand(head_dim, scale=0.1), "qkv": rand((heads + 2 * kv_heads) * head_dim, hidden, scale=0.03),
         "o": rand(hidden, heads * head_dim, scale=0.03), "gu": rand(2 * inter, hidden, scale=0.03),
         "down": rand(hidden, inter, scale=0.02), "lm": rand(vocab, hidden, scale=0.03)}
    pages = rows * 4
    k_cache = rand(pages, page, kv_heads, head_dim)
    v_cache = rand(pages, page, kv_heads, head_dim)
    tables = torch.arange(pages, device="cuda", dtype=torch.int32).reshape(rows, 4)
    lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
    slots = (tables[:, 0].long() * page + ctx - 1).to(torch.int32)
    angles = torch.rand(rows, head_dim // 2, device="cuda", generator=gen) * 6.28
    cos, sin = torch.cat([angles.cos()] * 2, -1).bfloat16(), torch.cat([angles.sin()] * 2, -1).bfloat16()
    positions, inv_freq = lens.long() - 1, torch.rand(head_dim // 2, device="cuda", generator=gen) * 0.01
    x0, res0 = rand(rows, hidden), rand(rows, hidden)
    static = {"x": x0.clone(), "res": res0.clone()}

    def step():
        static["res"].copy_(res0)
        h = rms_norm(static["x"], w["n1"], 1e-6, static["res"])
        if rope_in_attention:
            attn = paged_decode_attention_rope(gemv(h, w["qkv"]), w["qn"], w["kn"], 1e-6, positions, inv_freq,
                                               k_cache, v_cache, slots.long(), tables, lens, heads, kv_heads,
                                               head_dim, head_dim**-0.5, num_splits=4)
        else:
            rope, angles = ((None, None), {"positions": positions, "inv_freq": inv_freq}) if rows == 1 else \
                ((cos, sin), {})
            q = qk_norm_rope_kv(gemv(h, w["qkv"]), *rope, w["qn"], w["kn"], 1e-6, k_cache, v_cache, slots, heads,
                                kv_heads, head_dim, **angles)
            attn = paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5, num_splits=4)
        o = gemv(attn.reshape(rows, -1), w["o"])
        if rows == 1:
            gate_up, _ = norm_gemv(o, w["n2"], 1e-6, w["gu"], None, static["res"], block_n=16, block_k=hidden)
        else:
            gate_up = gemv(rms_norm(o, w["n2"], 1e-6, static["res"]), w["gu"])
        out = gemv(gate_up, w["down"], swiglu=True)
        return out, row_argmax(gemv(out, w["lm"]).float())

    return step


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("rope_in_attention", [False, True])
def test_decode_kernels_give_the_same_bits_with_pdl(monkeypatch, rows, rope_in_attention):
    if IS_INTERPRETED or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability >= 9.0")
    monkeypatch.setenv("MSTAR_PDL_MAX_ROWS", "8")  # PDL at 4 rows too (by default only 1-2 row launches take it)
    results = {}
    every_kind = "prologue,split,merge,gemv:4096x1024,gemv:1024x2048,gemv:6144x1024,gemv:1024x3072"
    for flag, trigger, ahead_of in (("0", "early", ""), ("1", "early", ""), ("1", "fit", ""), ("1", "ahead", ""),
                                    ("1", "early", every_kind)):
        monkeypatch.setenv("MSTAR_PDL", flag)
        monkeypatch.setenv("MSTAR_PDL_TRIGGER", trigger)
        if ahead_of:
            monkeypatch.setenv("MSTAR_PDL_AHEAD_OF", ahead_of)
            trigger = "each"
        step = _decode_layer_chain(rows, rope_in_attention)
        eager = step()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        results[flag + trigger] = (eager, captured)
    for mode in ("1early", "1fit", "1ahead", "1each"):
        for plain, pdl in zip(results["0early"], results[mode], strict=True):
            for a, b in zip(plain, pdl, strict=True):
                assert torch.equal(a, b)
        assert torch.equal(results[mode][0][0], results[mode][1][0])  # the replayed graph == eager, with PDL
