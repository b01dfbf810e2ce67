"""`mstar serve`'s port options are refused by the parser when out of range, as the YAML's ports are (they crashed
with a bind() traceback), and a 0 is refused rather than read as 'the default'."""

from __future__ import annotations

import pytest

from mstar_common import cli


@pytest.mark.parametrize("flag, value", [("--port", "70000"), ("--grpc-port", "-1"), ("--http-port", "0"),
                                         ("--metrics-port", "x")])
def test_a_port_option_out_of_range_is_refused_before_anything_starts(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "qwen3", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be a TCP port in [1, 65535], got '{value}'" in capsys.readouterr().err
