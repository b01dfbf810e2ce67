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
