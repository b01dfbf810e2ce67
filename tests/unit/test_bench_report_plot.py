"""The benchmark report's figure (mstar_common/bench/report.py `plot`, through `write_report`): one PNG per model,
three panels, each drawing the runs it is given and only those."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402

from mstar_common.bench.report import write_report  # noqa: E402

BLUE = (31, 119, 180)  # matplotlib's first colour: the first series of each panel


def _summary(tok_per_s: float, itl_ms: float, ttft_ms: float) -> dict:
    return {"num_requests": 4, "requests_per_s": 1.0, "output_tok_per_s": tok_per_s, "tokens_per_response": 1.0,
            "num_errors": 0, "ttft_ms": {"p50": ttft_ms, "p90": ttft_ms, "p99": 1.5 * ttft_ms},
            "itl_ms": {"p50": itl_ms, "p90": itl_ms, "p99": 2 * itl_ms}}


def _model(poisson: bool) -> dict:
    runs = [{"target": target, "concurrency": c, "summary": _summary(1300.0 * c ** 0.8, 0.7 * c ** 0.2, 5.0 * c)}
            for target in ("triton", "openai") for c in (1, 8, 64)]
    if poisson:
        runs += [{"target": "triton", "rate": rate, "summary": _summary(100.0 * rate, 1.0, 6.0 + rate)}
                 for rate in (2, 8, 32)]
    return {"runs": runs, "floor_ms": 0.28, "weight_bytes": 1.192e9,
            "bandwidth": {"read_tb_per_s": 4.25, "copy_rw_tb_per_s": 4.23},
            "hf_generate": [{"batch": 1, "output_tok_per_s": 34.0, "itl_ms": 28.7},
                            {"batch": 64, "output_tok_per_s": 2414.0, "itl_ms": 26.0}]}


def _blue_pixels(image: Image.Image, panel: int) -> int:
    """Pixels within a few levels of `BLUE` in the `panel`-th third of the figure."""
    width, height = image.size
    box = np.asarray(image.convert("RGB").crop((panel * width // 3, 0, (panel + 1) * width // 3, height)), dtype=int)
    return int((np.abs(box - np.array(BLUE)) <= 12).all(axis=-1).sum())


def test_the_report_writes_a_figure_whose_panels_draw_their_runs(tmp_path):
    results = {"meta": {}, "models": {"qwen3-0.6b": _model(poisson=True), "llama": _model(poisson=False)}}
    written = write_report(results, tmp_path)
    assert [p.name for p in written] == ["results.json", "results.md", "qwen3-0_6b.png", "llama.png"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    with_rates, without = (Image.open(tmp_path / name) for name in ("qwen3-0_6b.png", "llama.png"))
    assert with_rates.format == "PNG" and with_rates.size == (1650, 462)  # 15 x 4.2 inches at 110 dpi
    for panel in (0, 1):  # tok/s and ITL against concurrency: drawn in both
        assert _blue_pixels(with_rates, panel) > 50 and _blue_pixels(without, panel) > 50
    # TTFT against the Poisson rate: a line where the run had rates, "not measured" (gray) where it had none
    assert _blue_pixels(with_rates, 2) > 200
    assert _blue_pixels(without, 2) == 0


def test_without_matplotlib_the_report_keeps_its_tables_and_says_why(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    written = write_report({"meta": {}, "models": {"m": _model(poisson=False)}}, tmp_path)
    assert [p.name for p in written] == ["results.json", "results.md"]
    assert "matplotlib is not installed" in caplog.text


def test_an_image_deployments_pool_reads_as_none():
    """An image family's deployment has no paged pool (num_pages unset); the report's settings line raised."""
    from mstar_common.bench.report import _pages

    assert _pages(None) == "no paged pool" and _pages("auto").startswith("sized from GPU memory")
    assert _pages(2048) == "2,048 pages"


def test_a_model_named_org_slash_name_gets_one_figure_file(tmp_path):
    """`mstar bench url --name` must be the proxy's served id, which may be `Qwen/Qwen3-0.6B`: the figure's path
    took the slash as a folder, and savefig raised after the tables were written."""
    written = write_report({"meta": {}, "models": {"Qwen/Qwen3-0.6B": _model(poisson=False)}}, tmp_path)
    assert [p.name for p in written] == ["results.json", "results.md", "Qwen_Qwen3-0_6B.png"]
    assert written[2].parent == tmp_path and written[2].is_file()


def test_a_results_file_has_no_nan_or_infinity():
    """json.dumps writes NaN and Infinity as bare words, which JSON does not have; the results files carry null."""
    from mstar_common.bench.report import json_text

    text = json_text({"a": [float("nan"), float("inf"), 1.5, (2, "x")], "b": {"c": float("-inf"), "d": None}})
    assert json.loads(text) == {"a": [None, None, 1.5, [2, "x"]], "b": {"c": None, "d": None}}
