"""The GEMV cache's step-timed settings (scripts/tune_step_gemv.py --write-cache): their keys, the switch that
ignores them, and how they are merged into the cache file beside `tune_gemv`'s own decisions."""

import json

import pytest
import torch

from mstar_common.layers.linear import step_setting, step_setting_key, write_step_settings


def test_the_key_names_shape_dtype_bias_and_rows():
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    assert step_setting_key(weight, None, 1) == "step:1024x2048:bfloat16:bias=False:rows=1"
    assert step_setting_key(weight, torch.zeros(1024), 2) == "step:1024x2048:bfloat16:bias=True:rows=2"


def test_a_stored_setting_is_read_back_unless_switched_off(monkeypatch):
    weight = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    known = {step_setting_key(weight, None, 1): [1, 1024], "1024x2048:bfloat16:bias=False:rows=1": [1, 2048]}
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
