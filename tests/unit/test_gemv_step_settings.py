"""The GEMV cache's step-timed settings (scripts/tune_step_gemv.py --write-cache): their keys (with the PDL switches
they were timed under), the switch that ignores them, how they are merged into the cache file beside `tune_gemv`'s
own decisions, and the kernel-source digest that names the cache file."""

import json

import pytest
import torch

from mstar_common.layers.linear import kernels_fingerprint, step_setting, step_setting_key, write_step_settings

DEFAULT_KINDS = "down_proj+gate_up_proj+o_proj+prologue"
DEFAULT_PDL = f"pdl=early/{DEFAULT_KINDS}"


@pytest.fixture(autouse=True)
def default_pdl(monkeypatch):
    for name in ("MSTAR_PDL", "MSTAR_PDL_TRIGGER", "MSTAR_PDL_AHEAD_OF", "MSTAR_PDL_MAX_ROWS", "MSTAR_MID_GEMM",
                 "MSTAR_PDL_SKIP", "MSTAR_MID_GEMM_MAX_ROWS", "MSTAR_MID_GEMM_FOLD"):
        monkeypatch.delenv(name, raising=False)


def test_the_key_names_shape_dtype_bias_rows_and_the_pdl_switches():
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    assert step_setting_key(weight, None, 1) == f"step:1024x2048:bfloat16:bias=False:rows=1:{DEFAULT_PDL}"
    assert step_setting_key(weight, torch.zeros(1024), 2) == f"step:1024x2048:bfloat16:bias=True:rows=2:{DEFAULT_PDL}"
    assert step_setting_key(weight, None, 4) == "step:1024x2048:bfloat16:bias=False:rows=4:pdl=off"  # no PDL at 4 rows


@pytest.mark.parametrize("env,pdl", [({"MSTAR_PDL_AHEAD_OF": "o_proj+prologue"}, "pdl=early/o_proj+prologue"),
                                     ({"MSTAR_PDL_AHEAD_OF": "none"}, "pdl=early/none"),
                                     ({"MSTAR_PDL_TRIGGER": "ahead"}, f"pdl=ahead/{DEFAULT_KINDS}"),
                                     ({"MSTAR_PDL_SKIP": "split+merge"}, f"pdl=early/{DEFAULT_KINDS}/skip=merge+split"),
                                     ({"MSTAR_PDL": "0", "MSTAR_PDL_TRIGGER": "fit"}, "pdl=off")])
def test_a_setting_timed_under_other_pdl_switches_is_not_taken(monkeypatch, env, pdl):
    """A step-timed setting is the best of a step whose kernels overlap as the PDL switches say; under other
    switches the step is another one (on 2026-12-04 the o setting stored before the early triggers cost ~2% after
    them), so its key differs and it is not read."""
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    known = {step_setting_key(weight, None, 1): [2, 1024]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert step_setting_key(weight, None, 1) == f"step:1024x2048:bfloat16:bias=False:rows=1:{pdl}"
    assert step_setting(known, weight, None, 1) is None


def test_the_cache_file_digest_follows_the_kernel_sources(tmp_path):
    """Any change to a kernel source (.py, .cu, .cuh), or a new one, gives another digest, so the GEMV cache file
    (named by it) starts over instead of keeping decisions timed against other kernels; other files do not count."""
    digest = kernels_fingerprint.__wrapped__
    (tmp_path / "gemv.py").write_text("BLOCK = 16\n")
    (tmp_path / "kernel.cu").write_text("// kernel\n")
    first = digest(tmp_path)
    assert len(first) == 12 and digest(tmp_path) == first
    (tmp_path / "notes.txt").write_text("not a source")
    assert digest(tmp_path) == first
    (tmp_path / "gemv.py").write_text("BLOCK = 32\n")
    changed = digest(tmp_path)
    assert changed != first
    (tmp_path / "helpers.cuh").write_text("// header\n")
    assert digest(tmp_path) not in (first, changed)
    (tmp_path / "helpers.cuh").unlink()
    (tmp_path / "gemv.py").write_text("BLOCK = 16\n")
    assert digest(tmp_path) == first
    assert kernels_fingerprint() == digest(None)  # the package's own sources


def test_a_stored_setting_is_read_back_unless_switched_off(monkeypatch):
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    known = {step_setting_key(weight, None, 1): [1, 1024], "1024x2048:bfloat16:bias=False:rows=1": [1, 2048],
             "step:1024x2048:bfloat16:bias=False:rows=1": [4, 2048]}  # a key from before the PDL switches
    monkeypatch.delenv("MSTAR_GEMV_STEP_PLANS", raising=False)
    assert step_setting(known, weight, None, 1) == (1, 1024)
    assert step_setting(known, weight, None, 2) is None  # another row count
    assert step_setting(known, weight.float(), None, 1) is None  # another dtype
    monkeypatch.setenv("MSTAR_GEMV_STEP_PLANS", "0")
    assert step_setting(known, weight, None, 1) is None
    monkeypatch.setenv("MSTAR_GEMV_STEP_PLANS", "yes")
    with pytest.raises(ValueError, match="MSTAR_GEMV_STEP_PLANS"):
        step_setting(known, weight, None, 1)


def test_writing_merges_into_the_cache_and_none_removes(tmp_path):
    cache = tmp_path / "gemv" / "v3-GPU.json"
    write_step_settings(cache, {"step:8x8:bfloat16:bias=False:rows=1": (4, 1024)})  # the folder is created
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "8x8:bfloat16:bias=False:rows=1": None}))
    write_step_settings(cache, {"step:16x8:bfloat16:bias=False:rows=1": [2, 512, 8, 1]})
    assert json.loads(cache.read_text()) == {"8x8:bfloat16:bias=False:rows=1": None,
                                             "step:8x8:bfloat16:bias=False:rows=1": [4, 1024],
                                             "step:16x8:bfloat16:bias=False:rows=1": [2, 512, 8, 1]}
    write_step_settings(cache, {"step:8x8:bfloat16:bias=False:rows=1": None})
    assert "step:8x8:bfloat16:bias=False:rows=1" not in json.loads(cache.read_text())
    with pytest.raises(ValueError, match="not step-setting keys"):  # tune_gemv's own decisions are not written so
        write_step_settings(cache, {"8x8:bfloat16:bias=False:rows=1": [1, 8]})


def test_the_kernel_must_beat_cublas_by_five_percent_or_two_microseconds():
    from mstar_common.layers.linear import gemv_bar

    assert gemv_bar(4.0) == pytest.approx(3.8)  # short shapes: 5% (0.2 us)
    assert gemv_bar(40.0) == pytest.approx(38.0)  # where 5% is 2 us
    assert gemv_bar(76.69) == pytest.approx(74.69)  # a vocabulary head: 2 us (2.6%)


def test_the_mid_gemm_switch_names_projection_kinds(monkeypatch):
    from mstar_common.layers.linear import MID_GEMM_SETTINGS, GemvLinear, mid_gemm_auto, mid_gemm_kinds, mid_gemm_rows

    monkeypatch.delenv("MSTAR_MID_GEMM", raising=False)
    assert mid_gemm_kinds() == frozenset() and mid_gemm_auto()  # by default each model chooses
    monkeypatch.setenv("MSTAR_MID_GEMM", "0")
    assert mid_gemm_kinds() == frozenset() and not mid_gemm_auto()
    assert mid_gemm_rows() == (5, 64)
    monkeypatch.setenv("MSTAR_MID_GEMM_MAX_ROWS", "32")
    assert mid_gemm_rows() == (5, 32)
    monkeypatch.setenv("MSTAR_MID_GEMM_MAX_ROWS", "many")
    with pytest.raises(ValueError, match="MSTAR_MID_GEMM_MAX_ROWS='many'"):
        mid_gemm_rows()
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    assert mid_gemm_kinds() == frozenset(MID_GEMM_SETTINGS)
    monkeypatch.setenv("MSTAR_MID_GEMM", "o_proj,down_proj")
    assert mid_gemm_kinds() == {"o_proj", "down_proj"}
    monkeypatch.setenv("MSTAR_MID_GEMM", "qkv_proj+o_proj")  # + for scripts/ab_decode_step.py's comma-split variants
    assert mid_gemm_kinds() == {"qkv_proj", "o_proj"}
    linear = GemvLinear(16, 8)
    linear.pdl_kind = "o_proj"
    assert linear.mid_gemm_setting_for(torch.zeros(16, 16)) is None  # a CPU tensor stays on torch
    monkeypatch.setenv("MSTAR_MID_GEMM", "o_proj,lm_head")
    with pytest.raises(ValueError, match="MSTAR_MID_GEMM=.o_proj,lm_head.*qkv_proj, o_proj, gate_up_proj, down_proj"):
        mid_gemm_kinds()


def test_the_mid_gemm_folds_are_named_and_stay_off_the_cpu(monkeypatch):
    """`MSTAR_MID_GEMM_FOLD`: none by default; `norm` and `swiglu`, joined by `,` or `+`; anything else is refused
    with the switch's name and the choices. A CPU step never folds (its projections stay on torch)."""
    from mstar_common.layers.linear import GemvLinear, mid_fold_auto, mid_gemm_folds

    monkeypatch.delenv("MSTAR_MID_GEMM_FOLD", raising=False)
    assert mid_gemm_folds() == frozenset()
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm+swiglu")
    assert mid_gemm_folds() == {"norm", "swiglu"}
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "swiglu,")
    assert mid_gemm_folds() == {"swiglu"}
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm")
    linear = GemvLinear(16, 8)
    linear.pdl_kind = "qkv_proj"
    assert linear.mid_gemm_normed(torch.zeros(8, 16), torch.ones(16), 1e-6, None) is None
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "auto")  # the runner times them; none forced
    assert mid_gemm_folds() == frozenset() and mid_fold_auto()
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm,rope")
    with pytest.raises(ValueError, match="MSTAR_MID_GEMM_FOLD='norm,rope': expected auto, or a list .*norm, swiglu"):
        mid_fold_auto()


def test_the_mid_gemm_switch_widens_pdl_to_64_rows_unless_told(monkeypatch):
    from mstar_common.pdl_switches import max_rows

    monkeypatch.delenv("MSTAR_PDL_MAX_ROWS", raising=False)
    monkeypatch.delenv("MSTAR_MID_GEMM", raising=False)
    assert max_rows() == 2  # auto, the default, adds only the row counts it chose
    monkeypatch.setenv("MSTAR_MID_GEMM", "0")
    assert max_rows() == 2
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    assert max_rows() == 64
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    assert step_setting_key(weight, None, 4) == f"step:1024x2048:bfloat16:bias=False:rows=4:{DEFAULT_PDL}"
    monkeypatch.setenv("MSTAR_PDL_MAX_ROWS", "8")
    assert max_rows() == 8


def _decoder_like(hidden: int = 16) -> torch.nn.Module:
    """Linears named as the decoder names them, turned into `GemvLinear`s with their kinds (as `use_gemv` does)."""
    from mstar_common.layers.linear import GemvLinear

    layer = torch.nn.Module()
    for name, (n, k) in {"qkv_proj": (3 * hidden, hidden), "o_proj": (hidden, hidden),
                         "gate_up_proj": (4 * hidden, hidden), "down_proj": (hidden, 2 * hidden),
                         "lm_head": (100, hidden)}.items():
        linear = torch.nn.Linear(k, n, bias=False)
        linear.__class__, linear.pdl_kind = GemvLinear, name
        setattr(layer, name, linear)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer])
    return model


@pytest.fixture
def pdl_rows(monkeypatch):
    from mstar_common import pdl_switches

    monkeypatch.setattr(pdl_switches, "_EXTRA_ROWS", {})
    return pdl_switches


def test_pdl_takes_added_row_counts_until_each_model_removes_them(pdl_rows):
    assert pdl_rows.applies(2) and not pdl_rows.applies(8)
    pdl_rows.add_rows(8)
    pdl_rows.add_rows(8)  # two models chose it
    assert pdl_rows.applies(8) and not pdl_rows.applies(16)
    assert pdl_rows.signature(8) == pdl_rows.signature() != "off" and pdl_rows.signature(16) == "off"
    pdl_rows.remove_rows(8)
    assert pdl_rows.applies(8)
    pdl_rows.remove_rows(8)
    assert not pdl_rows.applies(8)


def test_mid_gemm_choices_are_taken_by_the_gain_stored_and_read_back(tmp_path, monkeypatch, pdl_rows):
    """MSTAR_MID_GEMM=auto: a row count takes mid_gemm (and PDL) where its step was 2% shorter; the choice lands in
    the GEMV cache under the model's projection shapes, and another process's model of those shapes reads it."""
    from mstar_common.layers.linear import choose_mid_form, known_mid_choices, mid_choice_key, mid_projections

    monkeypatch.setenv("MSTAR_MID_GEMM", "auto")
    cache = tmp_path / "gemv.json"
    model = _decoder_like()
    assert [m.pdl_kind for m in mid_projections(model)] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    key = mid_choice_key(model, 8)
    assert key.startswith("mid:down_proj=16x32:float32:bias=False*1+gate_up_proj=64x16") and ":rows=8:pdl=" in key
    assert choose_mid_form(model, 8, cublas_ms=1.345, mid_ms=1.199, cache=cache) == "mid_gemm"
    assert choose_mid_form(model, 16, cublas_ms=2.811, mid_ms=2.783, cache=cache) == "cuBLAS"  # 1%: under the bar
    assert all(m.mid_rows == {8} for m in mid_projections(model)) and model.layers[0].lm_head.mid_rows == set()
    assert pdl_rows.applies(8) and not pdl_rows.applies(16)
    stored = json.loads(cache.read_text())
    assert stored[key] == {"on": True, "cublas_ms": 1.345, "mid_ms": 1.199}
    assert stored[mid_choice_key(model, 16)]["on"] is False

    again = _decoder_like()
    assert known_mid_choices(again, cache) == {8: True, 16: False}
    assert all(m.mid_rows == {8} for m in mid_projections(again))
    assert known_mid_choices(_decoder_like(hidden=32), cache) == {}  # other shapes: nothing stored
    monkeypatch.setenv("MSTAR_MID_GEMM", "all")
    assert known_mid_choices(_decoder_like(), cache) == {}  # only auto reads the choices
    monkeypatch.setenv("MSTAR_MID_GEMM", "auto")
    assert choose_mid_form(model, 8, cublas_ms=1.2, mid_ms=1.3, cache=cache) == "cuBLAS"  # timed again: back
    assert all(m.mid_rows == set() for m in mid_projections(model)) and pdl_rows.applies(8)  # `again` holds 8


def test_mid_gemm_fold_choices_take_the_folds_by_the_gain_and_keep_them_apart(tmp_path, monkeypatch, pdl_rows):
    """MSTAR_MID_GEMM_FOLD=auto: a third form timed per bucket. The folds are taken where their step was 2% shorter
    than mid_gemm's without them (and mid_gemm then 2% shorter than cuBLAS), applied to the folded kinds (qkv,
    gate_up, down) and stored with the times; the key says they were timed, so a choice made without them is not
    read as one made with them; another model of the shapes reads them back; unset, nothing folds."""
    from mstar_common.layers.linear import choose_mid_form, known_mid_choices, mid_choice_key, mid_projections

    monkeypatch.setenv("MSTAR_MID_GEMM", "auto")
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "")
    plain_key = mid_choice_key(_decoder_like(), 8)
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "auto")
    cache = tmp_path / "gemv.json"
    model = _decoder_like()
    key = mid_choice_key(model, 8)
    assert key == plain_key + ":folds=auto"
    x8, x16 = torch.zeros(8, 16), torch.zeros(16, 16)
    assert choose_mid_form(model, 8, 1.311, 1.157, cache, fold_ms=1.090) == "mid_gemm with the folds"
    assert choose_mid_form(model, 16, 1.467, 1.291, cache, fold_ms=1.280) == "mid_gemm"  # 0.9%: under the bar
    assert choose_mid_form(model, 32, 1.709, 1.700, cache, fold_ms=1.600) == "mid_gemm with the folds"  # 6% off
    assert choose_mid_form(model, 24, 1.000, 1.010, cache, fold_ms=0.995) == "cuBLAS"  # neither form 2% off
    folded = {m.pdl_kind: m.mid_folds(x8) for m in mid_projections(model)}
    assert folded == {"qkv_proj": True, "o_proj": False, "gate_up_proj": True, "down_proj": True}
    assert not any(m.mid_folds(x16) for m in mid_projections(model))
    assert all(m.mid_rows == {8, 16, 32} for m in mid_projections(model))
    stored = json.loads(cache.read_text())
    assert stored[key] == {"on": True, "cublas_ms": 1.311, "mid_ms": 1.157, "fold": True, "fold_ms": 1.09}
    assert stored[mid_choice_key(model, 24)]["on"] is False and stored[mid_choice_key(model, 24)]["fold"] is False

    again = _decoder_like()
    assert known_mid_choices(again, cache) == {8: True, 16: True, 24: False, 32: True}
    assert [m.pdl_kind for m in mid_projections(again) if m.mid_fold_rows == {8, 32}] == \
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # o holds the rows too; it has no fold to take
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "")
    assert known_mid_choices(_decoder_like(), cache) == {}  # chosen with the folds timed: not this key's
    monkeypatch.setenv("MSTAR_MID_GEMM_FOLD", "norm")  # forced: every step on mid_gemm folds, the table aside
    assert _decoder_like().layers[0].qkv_proj.mid_folds(x16) and not _decoder_like().layers[0].down_proj.mid_folds(x16)


def _merge_many(cache, worker: int, count: int) -> None:
    from mstar_common.layers.linear import update_cache

    for i in range(count):
        update_cache(cache, {f"step:worker{worker}:{i}": [worker, i]})


def test_processes_merging_decisions_at_once_keep_each_others(tmp_path):
    """Instances of a deployment start, tune and store at the same time: every process's decisions must land in
    the GEMV cache file (each merge re-reads it under a lock), not only the last writer's snapshot."""
    import multiprocessing

    cache = tmp_path / "gemv.json"
    cache.write_text(json.dumps({"step:kept": [1, 2]}))
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_merge_many, args=(cache, w, 40)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert all(worker.exitcode == 0 for worker in workers)
    known = json.loads(cache.read_text())
    assert len(known) == 1 + 4 * 40 and known["step:kept"] == [1, 2] and known["step:worker3:39"] == [3, 39]
