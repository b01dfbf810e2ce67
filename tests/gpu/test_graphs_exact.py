"""On the GPU: captured graphs, overlap and fused kernels leave greedy tokens unchanged.

Graphs + overlap vs the eager step on the same backend must give the same tokens bit for bit when the
step shapes equal a bucket (a padded GEMM may pick another kernel). Fused vs unfused ops are compared on a
checkpoint with wider logits (init 0.2); a token that still flips must be a near-tie in transformers' logits.
`MSTAR_GPU_QWEN3` may point at a real-shape checkpoint (scripts/gpu_suite.sh builds one); otherwise a
4-layer checkpoint at Qwen3-0.6B widths is built here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mstar_common.engine.ar_engine import AREngine
from mstar_common.engine.attention import select_attention_backend
from mstar_common.engine.cuda_graph import GraphConfig
from mstar_common.engine.types import EngineConfig, SamplingParams
from mstar_common.families.qwen3.loader import load_qwen3
from mstar_common.layers.linear import default_gemv_cache, known_mid_choices, mid_gemm_rows, use_gemv

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _checkpoint(path: Path, init: float, layers: int) -> Path:
    if (path / "config.json").exists():
        return path
    from mstar_common.families.qwen3.tiny import build_tokenizer

    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, num_hidden_layers=layers,
                                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                      intermediate_size=3072, tie_word_embeddings=True, initializer_range=init,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def real_shape(tmp_path_factory) -> Path:
    given = os.environ.get("MSTAR_GPU_QWEN3")
    return Path(given) if given else _checkpoint(tmp_path_factory.mktemp("q") / "qwen3", 0.02, 4)


@pytest.fixture(scope="module")
def separated(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("s") / "qwen3_sep", 0.2, 4)


def generate(checkpoint: Path, prompts, *, graphs: bool, overlap: bool, backend: str = "triton",
             fused_ops: bool = True, max_tokens: int = 48, penalty: float = 1.0,
             device_penalty: bool | None = None, gemv_rows: int = 0, kv_dtype: str = "auto",
             stagger: int = 0) -> list[list[int]]:
    """`stagger`: the second half of the prompts arrives after that many steps (mixed decode + prefill steps)."""
    model, config = load_qwen3(checkpoint, dtype="bfloat16", device="cuda")
    model.attn_backend = select_attention_backend("cuda", backend)
    model.enable_fused_ops(fused_ops)
    if gemv_rows:
        use_gemv(model, gemv_rows)
        known_mid_choices(model, default_gemv_cache())  # MSTAR_MID_GEMM=auto's stored choices, as the server does
    graph_config = GraphConfig([1, 2, 4, 8], [64, 256, 512], capture_sampling=True) if graphs else None
    engine = AREngine(model, EngineConfig(num_kv_pages=256, page_size=16, max_num_seqs=8, max_batch_tokens=512,
                                          max_model_len=1024, dtype="bfloat16", device="cuda", kv_dtype=kv_dtype),
                      eos_token_ids=[], vocab_size=config["vocab_size"], graphs=graph_config, overlap=overlap,
                      device_penalty=device_penalty)
    got: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
    late = len(prompts) // 2 if stagger else len(prompts)
    for i, ids in enumerate(prompts):
        if i == late:
            for _ in range(stagger):
                engine.step()
        engine.add_request(str(i), ids, params,
                           lambda rid, toks, fin, err: got.setdefault(rid, []).extend(toks))
    while engine.step():
        pass
    if graphs:
        assert engine.runner.graphs.num_replays > 0
    del engine, model
    torch.cuda.empty_cache()
    return [got[str(i)] for i in range(len(prompts))]


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (length,), generator=gen).tolist() for _ in range(count)]


@pytest.mark.parametrize("count,length", [(1, 512), (1, 64), (8, 64)])
def test_graphs_and_overlap_equal_the_eager_step(real_shape, count, length):
    prompts = _prompts(count, length, seed=count + length)  # 8 x 64 = one 512-token bucket, then decode bucket 8
    eager = generate(real_shape, prompts, graphs=False, overlap=False)
    assert generate(real_shape, prompts, graphs=True, overlap=True) == eager


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
def test_mixed_steps_replayed_equal_eager_and_the_reference_backend(separated, kv_dtype):
    """Four prompts arrive while four others decode: the mixed steps send the decode rows to the decode kernel
    and the prompts to the prefill kernel (captured and eager alike)."""
    prompts = _prompts(8, 48, seed=11)
    eager = generate(separated, prompts, graphs=False, overlap=False, stagger=5, kv_dtype=kv_dtype)
    assert generate(separated, prompts, graphs=True, overlap=True, stagger=5, kv_dtype=kv_dtype) == eager
    if kv_dtype == "auto":  # the torch reference reads the same bf16 pool: the first tokens agree
        ref = generate(separated, prompts, graphs=False, overlap=False, stagger=5, backend="torch")
        first_diff = [_first_difference(x, y) for x, y in zip(eager, ref, strict=True)]
        assert sum(n >= 8 for n in first_diff) >= 6, first_diff


@pytest.mark.parametrize("form", ["grouped", "auto"])
@pytest.mark.parametrize("stagger", [0, 5], ids=["prompts_together", "mixed_steps"])
def test_grouped_prefill_attention_replays_as_it_runs_eager_and_ties_the_plain_form(separated, monkeypatch, caplog,
                                                                                     stagger, form):
    """MSTAR_PREFILL_ATTENTION=grouped: the prompts' attention runs in the grouped kernel (counted), replayed ==
    eager bit for bit, and the tokens equal or tie the plain form's (the two sum the keys in other orders). `auto`:
    the forms are timed once, in the first capture's warm-up (the replayed engine runs first), and the engines run
    the form it kept."""
    import logging

    import mstar_kernels.paged_prefill_attention as prefill_module

    monkeypatch.setattr(prefill_module, "_AUTO_CHOICES", {})
    prompts = _prompts(8, 100, seed=14)
    monkeypatch.setenv("MSTAR_PREFILL_ATTENTION", "plain")
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, stagger=stagger)
    monkeypatch.setenv("MSTAR_PREFILL_ATTENTION", form)
    launches, timing = [], []
    real_kernel, real_choose = prefill_module._prefill_grouped_kernel, prefill_module.choose_form

    class Counted:  # the kernel's `[grid](...)` launch, counted
        def __getitem__(self, grid):
            launches.append(grid)
            return real_kernel[grid]

    def counted_choose(*args, **kwargs):  # the timing's own launches are not the engines'
        before = len(launches)
        chosen = real_choose(*args, **kwargs)
        timing.append(len(launches) - before)
        return chosen

    monkeypatch.setattr(prefill_module, "_prefill_grouped_kernel", Counted())
    monkeypatch.setattr(prefill_module, "choose_form", counted_choose)
    with caplog.at_level(logging.INFO):
        replayed, eager = (generate(separated, prompts, graphs=graphs, overlap=graphs, max_tokens=8, stagger=stagger)
                           for graphs in (True, False))
    served = len(launches) - sum(timing)
    if form == "auto":
        (chosen,) = prefill_module._AUTO_CHOICES.values()
        assert len(timing) == 1 and "no form timed before this capture" not in caplog.text
        assert (served > 0) == (chosen == "grouped"), (chosen, served)
    else:
        assert served > 0 and not timing, "the grouped prefill kernel ran"
    assert replayed == eager
    _assert_near_ties(separated, prompts, reference, [eager])


def test_fp8_pool_graphs_equal_the_eager_step(separated):
    """An fp8 (e4m3) KV pool, decoded by the fp8 q.k kernel (MSTAR_DECODE_FORM auto): captured graphs give the
    eager step's greedy tokens. Against the bf16 pool the tokens drift apart after a few steps (H200, 12-01:
    first difference after 3-13 tokens on this 4-layer checkpoint), but the first ones agree."""
    prompts = _prompts(8, 64, seed=5)
    eager = generate(separated, prompts, graphs=False, overlap=False, kv_dtype="fp8_e4m3")
    assert generate(separated, prompts, graphs=True, overlap=True, kv_dtype="fp8_e4m3") == eager
    bf16 = generate(separated, prompts, graphs=False, overlap=False)
    first_diff = [_first_difference(x, y) for x, y in zip(eager, bf16, strict=True)]
    assert sum(n >= 2 for n in first_diff) >= 5, first_diff  # a broken fp8 read would differ from the start


def test_device_penalty_history_in_graphs_equals_the_host_history(real_shape):
    """Repetition penalty 1.3: the device masks (replayed, overlapped) give the host rule's greedy tokens."""
    prompts = _prompts(8, 64, seed=3)
    host = generate(real_shape, prompts, graphs=False, overlap=False, penalty=1.3, device_penalty=False)
    assert host != generate(real_shape, prompts, graphs=False, overlap=False)  # the penalty changes the output
    assert generate(real_shape, prompts, graphs=True, overlap=True, penalty=1.3) == host


def test_fused_kernels_match_the_eager_torch_ops(separated):
    """The Triton kernels are not bit-equal to torch's (flash-attention accumulation order), so over a 151,936
    token vocabulary a near-tie can flip a token (measured on the H200: 6 of the 8 sequences below differ from
    the torch backend's within 8 tokens, every one at such a tie). Where a sequence first differs, both
    candidates must be ties within bf16's own error (`_assert_near_ties`); a wrong kernel picks a token far
    from the top."""
    prompts = _prompts(4, 100, seed=1)
    reference = generate(separated, prompts, graphs=False, overlap=False, backend="torch", fused_ops=False,
                         max_tokens=8)
    outputs = [generate(separated, prompts, graphs=graphs, overlap=graphs, max_tokens=8) for graphs in (False, True)]
    _assert_near_ties(separated, prompts, reference, outputs)


def test_skinny_gemv_projections_match_cublas(separated):
    """Decode steps of <= 4 rows through mstar_kernels/gemv.py (MSTAR_GEMV_MAX_ROWS) against the same engine on
    cuBLAS: equal tokens or ties within bf16's error."""
    prompts = _prompts(4, 100, seed=2)
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8)
    outputs = [generate(separated, prompts, graphs=graphs, overlap=graphs, max_tokens=8, gemv_rows=4)
               for graphs in (False, True)]
    _assert_near_ties(separated, prompts, reference, outputs)


def test_norms_inside_the_gemv_match_the_norm_kernels(separated, monkeypatch):
    """MSTAR_NORM_GEMV: in steps of <= 4 rows each layer's add + RMSNorm runs inside its qkv and gate_up GEMVs
    (mstar_kernels/gemv.py norm_gemv). Against the same engine with the separate norm kernels: equal tokens or ties."""
    import mstar_kernels.gemv as gemv_module

    _assert_switch_keeps_tokens(separated, monkeypatch, "MSTAR_NORM_GEMV", "1", gemv_module, "norm_gemv",
                                max_rows=4, seed=4)


def test_the_persistent_mlp_kernel_matches_the_separate_launches(separated, monkeypatch):
    """MSTAR_FUSED_MLP_ROWS=2: in steps of <= 2 rows each layer's MLP half is one persistent launch with a grid
    barrier (mstar_kernels/fused_mlp.py), eager and replayed. Against the same engine without it: equal tokens or
    ties."""
    import mstar_kernels.fused_mlp as fused_module

    _assert_switch_keeps_tokens(separated, monkeypatch, "MSTAR_FUSED_MLP_ROWS", "2", fused_module, "fused_mlp",
                                max_rows=2, seed=6)


def test_the_prologue_inside_the_decode_kernel_matches_the_two_launches(separated, monkeypatch):
    """MSTAR_DECODE_ROPE_IN_ATTENTION=1 (by default only steps of 3-16 rows): decode steps run q/k norm + RoPE + KV
    write inside the decode attention kernel (mstar_kernels/paged_decode_attention.py paged_decode_attention_rope),
    eager and replayed. Against the same engine with the prologue kernel: equal tokens or ties."""
    import mstar_kernels.paged_decode_attention as attention_module

    _assert_switch_keeps_tokens(separated, monkeypatch, "MSTAR_DECODE_ROPE_IN_ATTENTION", "1", attention_module,
                                "paged_decode_attention_rope", max_rows=8, seed=8)


def test_mid_gemm_projections_replay_as_they_run_eager_and_match_cublas(separated, monkeypatch):
    """MSTAR_MID_GEMM=all: the projections of steps of 5-64 rows (`mid_gemm_rows`) run on mstar_kernels/mid_gemm.py,
    under PDL. Eight prompts decode in the 8-row bucket: replayed == eager bit for bit (the kernel is chosen by the
    row count, not by the capture), and against cuBLAS equal tokens or ties."""
    import mstar_kernels.mid_gemm as mid_module

    prompts = _prompts(8, 60, seed=10)
    monkeypatch.setenv("MSTAR_MID_GEMM", "0")  # cuBLAS
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    calls = []
    real = mid_module.mid_gemm
    monkeypatch.setattr(mid_module, "mid_gemm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    eager, replayed = (generate(separated, prompts, graphs=graphs, overlap=graphs, max_tokens=8, gemv_rows=4)
                       for graphs in (False, True))
    low, high = mid_gemm_rows()
    assert calls and set(calls) <= set(range(low, high + 1)), "mid_gemm ran, and only in steps of the switch's rows"
    assert replayed == eager
    _assert_near_ties(separated, prompts, reference, [eager])


def test_mid_gemm_folds_replay_as_they_run_eager_and_tie_the_launches_they_replace(separated, monkeypatch):
    """MSTAR_MID_GEMM_FOLD=norm+swiglu over MSTAR_MID_GEMM=all: in the 8-row bucket the pre-norms run inside qkv and
    gate_up (`mid_gemm_norm`) and the activation inside down (the SwiGLU load). Replayed == eager bit for bit, and
    against the unfolded mid_gemm engine equal tokens or ties."""
    import mstar_kernels.mid_gemm as mid_module

    prompts = _prompts(8, 60, seed=12)
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "")
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm+swiglu")
    normed, swiglu = [], []
    real_norm, real_mid = mid_module.mid_gemm_norm, mid_module.mid_gemm
    monkeypatch.setattr(mid_module, "mid_gemm_norm", lambda *a, **k: normed.append(a[0].shape[0]) or real_norm(*a, **k))
    monkeypatch.setattr(mid_module, "mid_gemm",
                        lambda *a, **k: k.get("swiglu") and swiglu.append(a[0].shape[0]) or real_mid(*a, **k))
    eager, replayed = (generate(separated, prompts, graphs=graphs, overlap=graphs, max_tokens=8, gemv_rows=4)
                       for graphs in (False, True))
    low, high = mid_gemm_rows()
    rows = set(range(low, high + 1))
    assert normed and set(normed) <= rows, "the pre-norms ran inside mid_gemm, in steps of the switch's rows"
    assert swiglu and set(swiglu) <= rows, "the activation ran inside down's mid_gemm"
    assert replayed == eager
    _assert_near_ties(separated, prompts, reference, [eager])


def test_mid_gemm_auto_times_the_buckets_and_an_engine_without_graphs_follows(separated, monkeypatch, tmp_path):
    """MSTAR_MID_GEMM=auto (the default): the runner captures the 8-row bucket on cuBLAS and on mid_gemm under PDL,
    times both, stores its choice in the GEMV cache; an engine without graphs then reads it, so its tokens equal the
    replayed ones bit for bit, and both tie the cuBLAS engine's (`0`)."""
    import json

    from mstar_common import pdl_switches

    monkeypatch.setattr(pdl_switches, "_EXTRA_ROWS", {})  # the PDL row counts the choices add, dropped after
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    prompts = _prompts(8, 60, seed=12)
    monkeypatch.setenv("MSTAR_MID_GEMM", "0")  # cuBLAS
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    monkeypatch.delenv("MSTAR_MID_GEMM")
    replayed = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    stored = {key: value for key, value in json.loads(default_gemv_cache().read_text()).items()
              if key.startswith("mid:")}
    assert sorted(int(key.split(":rows=")[1].split(":")[0]) for key in stored) == [8]  # buckets 1, 2, 4, 8
    assert all(set(value) == {"on", "cublas_ms", "mid_ms"} and value["cublas_ms"] > 0 for value in stored.values())
    eager = generate(separated, prompts, graphs=False, overlap=False, max_tokens=8, gemv_rows=4)
    assert eager == replayed
    _assert_near_ties(separated, prompts, reference, [replayed])


def test_mid_gemm_fold_auto_times_three_forms_and_an_engine_without_graphs_follows(separated, monkeypatch, tmp_path):
    """MSTAR_MID_GEMM_FOLD=auto: the runner also captures the 8-row bucket on mid_gemm with the folds, times the
    three replays and stores the choice with the folds' time; an engine without graphs reads it (folds included),
    so its tokens equal the replayed ones bit for bit, and both tie the cuBLAS engine's."""
    import json

    from mstar_common import pdl_switches

    monkeypatch.setattr(pdl_switches, "_EXTRA_ROWS", {})
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    prompts = _prompts(8, 60, seed=13)
    monkeypatch.setenv("MSTAR_MID_GEMM", "0")
    reference = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    monkeypatch.delenv("MSTAR_MID_GEMM")
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "auto")
    replayed = generate(separated, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    stored = {key: value for key, value in json.loads(default_gemv_cache().read_text()).items()
              if key.startswith("mid:")}
    assert list(stored) and all(key.endswith(":folds=auto") for key in stored)
    assert all({"on", "fold", "fold_ms", "mid_ms", "cublas_ms"} <= set(value) and value["fold_ms"] > 0
               for value in stored.values())
    eager = generate(separated, prompts, graphs=False, overlap=False, max_tokens=8, gemv_rows=4)
    assert eager == replayed
    _assert_near_ties(separated, prompts, reference, [replayed])


def _assert_switch_keeps_tokens(checkpoint: Path, monkeypatch, switch: str, on: str, module, launch: str,
                                max_rows: int, seed: int) -> None:
    """With the environment `switch` at `on`, `module.launch` runs (counted), only in steps of <= `max_rows` rows,
    and the tokens, eager and replayed, equal or tie those of the engine with the switch at 0."""
    prompts = _prompts(4, 100, seed=seed)
    monkeypatch.setenv(switch, "0")
    reference = generate(checkpoint, prompts, graphs=True, overlap=True, max_tokens=8, gemv_rows=4)
    monkeypatch.setenv(switch, on)
    calls = []
    real = getattr(module, launch)
    monkeypatch.setattr(module, launch, lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    outputs = [generate(checkpoint, prompts, graphs=graphs, overlap=graphs, max_tokens=8, gemv_rows=4)
               for graphs in (False, True)]
    assert calls and set(calls) <= set(range(1, max_rows + 1)), f"{launch} ran, and only in steps of <= {max_rows} rows"
    _assert_near_ties(checkpoint, prompts, reference, outputs)


def _first_difference(x: list[int], y: list[int]) -> int:
    """The index of the first token where two sequences differ (`len(x)` where none does)."""
    return next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x))


def _assert_near_ties(checkpoint: Path, prompts, reference, runs) -> None:
    """Where a run's sequence first differs from the reference's, both tokens lie within twice the largest
    |bf16 - fp32| logit difference of the top of transformers' fp32 logits for the reference prefix."""
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=dtype).cuda().eval()
          for dtype in (torch.float32, torch.bfloat16)}
    for outputs in runs:
        for prompt, ref, ours in zip(prompts, reference, outputs, strict=True):
            if ours == ref:
                continue
            k = next(i for i, (a, b) in enumerate(zip(ref, ours, strict=False)) if a != b)
            ids = torch.tensor([prompt + ref[:k]], device="cuda")
            with torch.no_grad():
                exact, rounded = (hf[dtype](ids).logits[0, -1].float() for dtype in (torch.float32, torch.bfloat16))
            top, noise = exact.max(), (rounded - exact).abs().max()
            assert noise < 0.1 * top.abs(), f"bf16 error {noise:.3f} is not small against the top logit {top:.3f}"
            assert exact[ref[k]] >= top - 2 * noise and exact[ours[k]] >= top - 2 * noise, (
                f"token {k}: {ours[k]} (logit {exact[ours[k]]:.4f}) vs the reference's {ref[k]} "
                f"({exact[ref[k]]:.4f}); top {top:.4f}, bf16 error {noise:.4f}: not a tie within rounding")
    del hf
    torch.cuda.empty_cache()


@pytest.mark.parametrize("filters", [{"top_p": 0.9, "top_k": 50}, {}, {"top_p": 0.8, "repetition_penalty": 1.3}],
                         ids=["top_k_top_p", "temperature_alone", "top_p_penalty"])
def test_seeded_sampling_is_the_same_replayed_or_eager(real_shape, filters):
    """Seeded tokens are the same from the captured sampling variant (the full sampler, or temperature alone: the
    inverse CDF without the search's launches) and from the eager step; under the repetition penalty also from the
    eager step with the history on the host (the device masks and mstar_kernels/penalty.py against the host rule;
    a random-weight model's flat rows take top-p by rejection)."""
    prompts = _prompts(2, 64, seed=5)
    params = SamplingParams(max_tokens=32, temperature=0.9, seed=7, ignore_eos=True, **filters)
    outs = []
    runs = [(False, None), (True, None)] + ([(False, False)] if "repetition_penalty" in filters else [])
    for graphs, device_penalty in runs:
        model, config = load_qwen3(real_shape, dtype="bfloat16", device="cuda")
        model.attn_backend = select_attention_backend("cuda", "triton")
        model.enable_fused_ops(True)
        engine = AREngine(model, EngineConfig(num_kv_pages=64, page_size=16, max_num_seqs=2, max_batch_tokens=128,
                                              max_model_len=256, dtype="bfloat16", device="cuda"),
                          eos_token_ids=[], vocab_size=config["vocab_size"],
                          graphs=GraphConfig([2], [128]) if graphs else None, overlap=graphs,
                          device_penalty=device_penalty)
        got: dict[str, list[int]] = {}
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, params,
                               lambda rid, toks, fin, err, got=got: got.setdefault(rid, []).extend(toks))
        while engine.step():
            pass
        outs.append(got)
    assert all(out == outs[0] for out in outs[1:])
