"""The device probes run on the CPU with tiny checkpoints (so a GPU session never finds them broken)."""

import faulthandler
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CONFIGS = SCRIPTS.parent / "configs"


@pytest.fixture(autouse=True)
def _no_watchdog_left():
    yield
    faulthandler.cancel_dump_traceback_later()  # the probes arm an exit-on-timeout watchdog


def _load(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_whisper_decoder_probe(capsys):
    probe = _load("probe_whisper_decoder")
    assert probe.main(["--config", str(CONFIGS / "whisper.yaml"), "--checkpoint", "builtin:whisper-tiny-random",
                       "--device", "cpu", "--tokens", "6", "--concurrency", "1,3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("c=")]
    assert len(lines) == 2 and lines[1].startswith("c=  3")
    assert all("tokens=6" in line and "step p50=" in line for line in lines)


def test_orpheus_engine_probe_with_the_walk(capsys, monkeypatch):
    probe = _load("probe_orpheus_engine")
    monkeypatch.setattr(sys, "argv", ["probe", "--config", str(CONFIGS / "orpheus.yaml"), "--checkpoint",
                                      "builtin:orpheus-tiny", "--device", "cpu", "--concurrency", "2",
                                      "--tokens", "28", "--walk", "2", "--kv-dtype", "fp8_e4m3",
                                      "--walk-timeline", "0.3", "--walk-first-chunk", "auto"])
    assert probe.main() == 0
    out = capsys.readouterr().out
    timeline = [line for line in out.splitlines() if line.startswith("[timeline]")]
    assert len(timeline) >= 2 and all("ms/step" in line and "running=" in line for line in timeline)
    assert "reference c=   2" in out and "codec float32  batch= 128" in out
    assert "walk codec=float32  c=   2" in out and "errors=0" in out


def test_orpheus_bench_playback_stalls():
    """Playback from the first chunk: a late chunk stalls the player by its lateness, once; the report keeps
    when the first gap began and counts a stream real-time only below 10 ms of stall in total."""
    bench = _load("bench_orpheus")
    frame_s = bench.SAMPLES_PER_FRAME / bench.SAMPLE_RATE  # 85.3 ms of audio per chunk
    steady = bench.StreamLog(0.0, [(0.1 + i * 0.05, bench.SAMPLES_PER_FRAME) for i in range(10)])
    assert steady.stalls() == (0.0, None)
    late = bench.StreamLog(0.0, [(0.1, bench.SAMPLES_PER_FRAME), (0.1 + frame_s + 0.08, bench.SAMPLES_PER_FRAME),
                                 (0.1 + frame_s + 0.09, bench.SAMPLES_PER_FRAME)])
    total, first = late.stalls()
    assert total == pytest.approx(0.08) and first == pytest.approx(0.1 + frame_s)
    result = bench.summarize("x", [steady, late], wall=1.0)
    assert result.streams_real_time == 1 and result.first_stall_p50_s == pytest.approx(0.1 + frame_s, abs=1e-3)
    assert result.stall_p90_ms == pytest.approx(72.0, abs=0.1)  # 90th percentile of (0, 80) ms
    assert result.streams[1][:3] == [0.1, 80.0, pytest.approx(0.1 + frame_s, abs=1e-4)] and result.streams[0][1] == 0
    for shift, rank in ((-0.05, 0.0), (0.3, 1.0)):  # the same stall in a stream that starts first / last
        moved = bench.StreamLog(0.0, [(a + shift, n) for a, n in late.arrivals])
        assert bench.summarize("x", [steady, moved], wall=1.0).stalled_start_rank_p50 == rank
    failed = bench.StreamLog(0.0, error="boom")
    assert bench.summarize("x", [steady, failed], wall=1.0).streams[1] is None


def test_a_level_whose_streams_all_failed_is_written_as_json(tmp_path):
    """A level with no stream that finished has no first-audio or stall figures: they are NaN, which json.dumps
    wrote as the bare word NaN (not JSON: jq, JavaScript and strict parsers refuse the results file); now null."""
    bench = _load("bench_orpheus")
    result = bench.summarize("x", [bench.StreamLog(0.0, error="boom")], wall=1.0)
    line = json.loads(bench._brief(result), parse_constant=lambda word: pytest.fail(f"{word} in the JSON"))
    assert line["errors"] == 1 and line["stall_p50_ms"] is None and line["first_audio_p50_ms"] is None


def test_orpheus_streams_places_the_stalled_streams(tmp_path, capsys):
    """scripts/orpheus_streams.py on bench_orpheus.py's per-stream records: stalled streams counted per tenth of
    the streams ordered by first audio, their first gaps, the worst first; failed streams skipped."""
    tool = _load("orpheus_streams")
    streams = [[0.1 * i, 0.0, None, 14.0, 170] for i in range(20)]
    streams[1] = [0.1, 55.0, 1.7, 14.1, 168]  # an early starter stalls
    streams[19] = [1.9, 12.0, 2.0, 14.2, 169]  # and the last one, less
    streams.append(None)
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"results": [{"system": "mstar-triton", "concurrency": 21, "streams": streams},
                                               {"system": "hf", "concurrency": 1}]}))
    assert tool.main([str(results), "--worst", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("2/20 streams stalled; by first-audio tenth (earliest first): 1 0 0 0 0 0 0 0 0 1")
    assert out[1] == "  first gap began 1.70-2.00 s into the request (median 2.00)"
    assert out[2].startswith("  stream    1: first audio  0.100 s, stall    55.0 ms from 1.7 s")
    assert len(out) == 4 and out[3] == "hf c=1: no per-stream records"


def test_png_probe(tmp_path, monkeypatch):
    probe = _load("probe_png")
    out = tmp_path / "png.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--size", "128", "--repeats", "1", "--json", str(out)])
    probe.main()
    report = json.loads(out.read_text())
    assert {"noise", "smooth", "two_thread_speedup"} <= set(report)
    assert report["noise"]["zlib_6_bytes"] > 0 and report["smooth"]["encode_png_bytes"] > 0


@pytest.mark.server
def test_hop_probe(capsys, monkeypatch):
    from tests.unit.local_http import behind_unreachable_proxy

    probe = _load("probe_hops")
    behind_unreachable_proxy(monkeypatch)  # its gRPC client to its own server went through http_proxy
    monkeypatch.setattr(sys, "argv", ["probe", "--requests", "1"])
    probe.main()
    printed = capsys.readouterr().out
    assert all(f"{mode}: embedding hop p50" in printed for mode in probe.MODES)


def test_ab_decode_step_variants_are_parsed_and_checked():
    """The A/B script's `--variant NAME:MSTAR_KEY=VALUE,...`: environment switches only, a name required."""
    import argparse

    ab = _load("ab_decode_step")
    assert ab.parse_variant("both:MSTAR_NORM_GEMV=1,MSTAR_PDL=0") == ("both", {"MSTAR_NORM_GEMV": "1",
                                                                            "MSTAR_PDL": "0"})
    assert ab.parse_variant("base:") == ("base", {})
    assert ab.parse_variant("forced:MSTAR_GEMV_FORCE=1:8/0/8/1") == ("forced", {"MSTAR_GEMV_FORCE": "1:8/0/8/1"})
    for bad in ("x:PATH=/tmp", ":MSTAR_PDL=0"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME:MSTAR_KEY=VALUE"):
            ab.parse_variant(bad)
    # a value the switch's parser refuses is refused here, before the GPU runs anything; the environment is left
    before = dict(os.environ)
    with pytest.raises(argparse.ArgumentTypeError, match="--variant typo: .*MSTAR_MID_GEMM_FOLD='norms'"):
        ab.parse_variant("typo:MSTAR_MID_GEMM=all,MSTAR_MID_GEMM_FOLD=norms")
    assert dict(os.environ) == before


def test_kernel_resources_probe_counts_programs_per_sm_as_hopper_allocates():
    """scripts/probe_kernel_resources.py's occupancy: registers go per warp in units of 256, shared memory per
    program with 1 KB reserved; the split kernel's two forms (96 and 175 registers, 38,912 B) hold 5 and 2."""
    probe = _load("probe_kernel_resources")
    assert probe.ctas_per_sm(96, 4, 38912) == {"registers": 5, "shared": 5, "warps": 16, "ctas": 5}
    assert probe.ctas_per_sm(175, 4, 38912)["ctas"] == 2  # 176 a thread: 5,632 a warp, 11 warps
    assert probe.ctas_per_sm(80, 4, 38912) == {"registers": 6, "shared": 5, "warps": 16, "ctas": 5}
    assert probe.ctas_per_sm(32, 1, 0)["ctas"] == 32  # the hardware's cap on programs per SM


def test_engine_ipc_probe_measures_each_row_count():
    """scripts/probe_engine_ipc.py: one line per row count, every step's message received and dispatched."""
    probe = _load("probe_engine_ipc")
    results = [probe.measure(rows, 50) for rows in (1, 64)]
    assert [r["rows"] for r in results] == [1, 64] and all(r["steps"] == 50 for r in results)
    assert all(r["send_us"] > 0 and r["dispatch_us"] > 0 for r in results)


def test_step_host_probe_runs_the_engine_without_a_model():
    """scripts/probe_step_host.py: the engine's decode steps at each row count, timed, with every row decoding."""
    probe = _load("probe_step_host")
    results = [probe.measure(rows, 20, 64) for rows in (1, 4)]
    assert [r["rows"] for r in results] == [1, 4] and all(r["host_us_per_step"] > 0 for r in results)


def test_the_fuzz_and_soak_scripts_read_a_local_servers_metrics_whatever_http_proxy_says(monkeypatch):
    """cancel_fuzz's (and soak's) metrics read used urllib's urlopen, which sends even a loopback request through the
    environment's http_proxy: on a host with one set, the fuzz and the soak could not read their own server."""
    from tests.unit.local_http import answering, behind_unreachable_proxy

    fuzz = _load("cancel_fuzz")
    behind_unreachable_proxy(monkeypatch)
    with answering(b'mstar_kv_pages_used{model="m"} 3\nmstar_kv_pages_used{model="n"} 4\n') as url:
        assert fuzz.read_metrics(f"{url}/metrics", ("mstar_kv_pages_used",)) == {"mstar_kv_pages_used": 7.0}
