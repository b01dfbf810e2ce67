"""scripts/plot_orpheus.py: labelled result files merge per concurrency; the figure renders where matplotlib is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import plot_orpheus  # noqa: E402


def _result(path: Path, rows: list[tuple[int, float]]) -> Path:
    path.write_text(json.dumps({"meta": {}, "results": [
        {"concurrency": c, "audio_s_per_s": rate, "rtf_p50": c / rate, "first_audio_p50_ms": 50.0 * c,
         "streams_real_time": c if rate > c else 0} for c, rate in rows]}))
    return path


def test_series_merge_per_label_and_the_later_file_wins(tmp_path):
    first = _result(tmp_path / "a.json", [(1, 5.0), (64, 150.0)])
    second = _result(tmp_path / "b.json", [(64, 160.0), (256, 240.0)])
    base = _result(tmp_path / "c.json", [(1, 0.5)])
    lines = plot_orpheus.load([f"ours={first}", f"ours={second}", f"HF=generate={base}"])
    assert list(lines) == ["ours", "HF=generate"]  # the path follows the last '='
    assert sorted(lines["ours"]) == [1, 64, 256] and lines["ours"][64]["audio_s_per_s"] == 160.0
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        plot_orpheus.load([str(first)])


def test_the_figure_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig" / "orpheus.png"
    plot_orpheus.main([f"ours={_result(tmp_path / 'a.json', [(1, 5.0), (16, 50.0)])}", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
