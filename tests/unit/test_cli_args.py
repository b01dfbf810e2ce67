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


def test_gpus_places_each_gpu_component_and_keeps_the_cpu_ones():
    """`mstar serve KEY --gpus 0,1,2,3` (ENGINE.md 13) was an unrecognized argument."""
    from mstar_common.config import load_deployment

    dep = load_deployment(cli.CONFIGS / "flux2_klein_4b_gpu.yaml")
    placed = cli.place_on_gpus(dep, [1, 2], "flux2_klein_4b_gpu.yaml")
    for name, comp in placed.components.items():
        before = dep.components[name].placement
        assert comp.placement.gpus == ([1, 2] if before.device == "gpu" else before.gpus), name
        assert comp.placement.instances == before.instances and comp.placement.device == before.device
    assert dep.components["denoise"].placement.gpus == [0]  # the loaded deployment is not changed in place


def test_gpus_on_a_cpu_demo_is_refused_naming_the_familys_gpu_deployments():
    from mstar_common.config import DeploymentError, load_deployment

    with pytest.raises(DeploymentError, match=r"^--gpus: flux2_klein.yaml places no component on a GPU \(a cpu "
                                              r"demo\); its family's GPU deployments: "
                                              r"configs/flux2_klein_4b_gpu.yaml$"):
        cli.place_on_gpus(load_deployment(cli.CONFIGS / "flux2_klein.yaml"), [0], "flux2_klein.yaml")


@pytest.mark.parametrize("value", ["x", "0,0", "-1", "0,,1"])
def test_a_bad_gpus_list_is_refused_before_anything_starts(capsys, value):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "qwen3", "--gpus", value])
    assert info.value.code == 2 and "--gpus" in capsys.readouterr().err


def test_config_serves_its_file_and_a_key_of_another_family_is_refused():
    from mstar_common.config import DeploymentError

    gpu = str(cli.CONFIGS / "qwen3_0_6b_gpu.yaml")
    assert cli.serve_target("qwen3", gpu) == cli.CONFIGS / "qwen3_0_6b_gpu.yaml"
    assert cli.serve_target(None, gpu) == cli.CONFIGS / "qwen3_0_6b_gpu.yaml"
    assert cli.serve_target(None, None) == cli.DEFAULT_DEPLOYMENT
    with pytest.raises(DeploymentError, match="--config: .*qwen3_0_6b_gpu.yaml deploys family 'qwen3', and 'whisper' "
                                              "is a 'whisper' deployment"):
        cli.serve_target("whisper", gpu)
    with pytest.raises(DeploymentError, match="--config: nope.yaml is not a file"):
        cli.serve_target(None, "nope.yaml")


@pytest.mark.parametrize("flag, value, rule", [
    ("--host", "0.0.0.0 ", "must be an IP address or a host name"),
    ("--host", "a" * 64 + ".example", "must be an IP address or a host name"),
    ("--timeout", "-5", "must be a number of seconds > 0"),
    ("--timeout", "0", "must be a number of seconds > 0"),
    ("--timeout", "nan", "must be a number of seconds > 0"),
])
def test_a_bad_host_or_timeout_is_refused_before_anything_starts(capsys, flag, value, rule):
    """A bad --host failed with a traceback at the first readiness check, after tritonserver had loaded; a --timeout
    of 0, below 0 or nan started tritonserver and gave up on it at once."""
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "qwen3", flag, value])
    assert info.value.code == 2 and f"argument {flag}: {rule}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["127.0.0.1", "::", "::1", "fe80::1", "", "*", "localhost", "gpu-7.lab.example"])
def test_good_hosts_pass(value):
    assert cli.bind_host_arg(value) == value


def test_no_proxy_lets_the_unused_proxy_port_equal_a_triton_port(tmp_path, monkeypatch):
    """`mstar serve --no-proxy --http-port 8000` (Triton on its usual 8000/8001/8002) was refused: the unused proxy
    port, 8000 too, had to differ."""
    from mstar_common.launcher import free_ports

    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path / "cache"))
    served = []
    monkeypatch.setattr(cli, "_serve_on", lambda args, path, dep, ports: served.append(ports) or 0)
    http, grpc, metrics = free_ports(3)
    assert cli.main(["serve", "qwen3", "--no-proxy", f"--port={http}", f"--http-port={http}", f"--grpc-port={grpc}",
                     f"--metrics-port={metrics}"]) == 0
    assert served and served[0].http == http
    assert cli.main(["serve", "qwen3", f"--port={http}", f"--http-port={http}", f"--grpc-port={grpc}",
                     f"--metrics-port={metrics}"]) == 2  # with the proxy it must still differ


def test_names_alike_once_cleaned_get_run_folders_of_their_own():
    """`org/model` and `org_model` (or two names alike in their first 48 characters) shared one prefix, so one's
    start pruned the other's stopped run folders and their logs."""
    long = "meta-llama/Llama-3.2-3B-Instruct-finetune-experiment-"
    prefixes = {cli.run_folder_prefix(name) for name in ("org/model", "org_model", long + "A", long + "B")}
    assert len(prefixes) == 4 and all(p.startswith("mstar-") and p.endswith("-") for p in prefixes)
    assert cli.run_folder_prefix("qwen3") == "mstar-qwen3-64e43226-"  # the same in every process (no hash())
    assert not any(a != b and b.startswith(a) for a in prefixes for b in prefixes)


@pytest.mark.parametrize("host, shown", [("::", "http://localhost:"), ("::1", "http://localhost:"),
                                         ("0.0.0.0", "http://localhost:"), ("fe80::1", "http://[fe80::1]:"),
                                         ("10.0.0.2", "http://10.0.0.2:")])
def test_printed_urls_bracket_an_ipv6_host(capsys, tmp_path, host, shown):
    import argparse

    from mstar_common.config import load_deployment
    from mstar_common.launcher import Ports

    dep = load_deployment(cli.DEFAULT_DEPLOYMENT)
    cli._print_urls(dep, Ports(8000, 8001, 8002, 8080), argparse.Namespace(host=host, no_proxy=False), tmp_path)
    assert f"OpenAI API   {shown}8080/v1" in capsys.readouterr().out


def test_a_port_this_user_may_not_bind_is_not_called_in_use(monkeypatch):
    from mstar_common import launcher
    from mstar_common.config import DeploymentError

    class Refusing:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def setsockopt(self, *args):
            pass

        def bind(self, address):
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(launcher.socket, "socket", Refusing)
    with pytest.raises(DeploymentError, match=r"^port 80: this user may not bind it \(ports below 1024"):
        launcher.port_in_use(80)


def test_a_missing_optional_package_names_the_extra_that_installs_it(monkeypatch, capsys):
    """After a bare `pip install -e .`, `mstar serve flux2_klein` built its builtin checkpoint with diffusers and
    died on a ModuleNotFoundError traceback; any other missing module still raises."""
    from mstar_common import cli

    def needs(module):
        def command(args):
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        return command

    monkeypatch.setattr(cli, "cmd_check", needs("diffusers"))
    assert cli.main(["check", "flux2_klein"]) == 2
    err = capsys.readouterr().err
    assert "mstar: error: diffusers is not installed" in err and "pip install 'mstar-triton[images]'" in err
    monkeypatch.setattr(cli, "cmd_check", needs("snac.layers"))
    assert cli.main(["check", "orpheus"]) == 2 and "'mstar-triton[orpheus]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "cmd_check", needs("not_an_extra"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["check", "qwen3"])
