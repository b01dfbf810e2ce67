"""The generator: deterministic, in sync with the committed repository, pbtxt that Triton reads."""

import json
import os
import re
from pathlib import Path

import pytest

from mstar_common.cli import DEFAULT_DEPLOYMENT, PROJECT_ROOT
from mstar_common.config import DeploymentError, load_deployment
from mstar_common.graph import Component, FamilyGraph, Loop, Sequential, Step, TensorSpec, Walk
from mstar_common.repository import _ensemble_pbtxt, entry_model, generate_repository, render_repository

COMMITTED = PROJECT_ROOT / "model_repository"


def _tree(root: Path) -> dict[str, bytes]:
    """The files under `root`, but the `__pycache__` a stub writes beside model.py (git ignores it: a repository
    that README's `tritonserver --model-repository=model_repository` served is not stale)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_committed_repository_matches_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    out = tmp_path / "model_repository"
    generate_repository(Path("configs") / DEFAULT_DEPLOYMENT.name, out)
    committed = {k: v for k, v in _tree(COMMITTED).items() if k != "README.md"}
    assert committed == _tree(out), "model_repository/ is stale: run `mstar gen-repo configs/qwen3.yaml`"


def test_generation_is_deterministic():
    """The same in another process too: a set's or dict's order that hash randomization changes would pass a
    comparison within one process (PYTHONHASHSEED differs below), for every shipped deployment."""
    import subprocess
    import sys

    code = ("import hashlib, json; from mstar_common.cli import CONFIGS; from mstar_common.config import "
            "load_deployment; from mstar_common.repository import render_repository; "
            "print(hashlib.sha256(json.dumps({p.name: render_repository(load_deployment(p), p.name) "
            "for p in sorted(CONFIGS.glob('*.yaml'))}, sort_keys=True).encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                              cwd=PROJECT_ROOT, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2", "3")}
    assert len(digests) == 1 and len(next(iter(digests)).strip()) == 64


def test_component_config_carries_placement_and_deployment():
    dep = load_deployment(DEFAULT_DEPLOYMENT)
    dep.components["llm"].placement.device = "gpu"
    dep.components["llm"].placement.gpus = [0, 1]
    dep.components["llm"].placement.instances = 2
    text = render_repository(dep, "x.yaml")["qwen3_llm/config.pbtxt"]
    assert "model_transaction_policy { decoupled: true }" in text
    assert text.count("kind: KIND_GPU count: 2") == 2 and "gpus: [ 1 ]" in text
    raw = re.search(r'key: "deployment" value \{ string_value: "(.*)" \}', text).group(1)
    restored = json.loads(raw.replace('\\"', '"').replace("\\\\", "\\"))
    assert restored["family"] == "qwen3" and restored["components"]["llm"]["placement"]["gpus"] == [0, 1]


def test_entry_model_of_a_loop_walk_is_its_component():
    assert entry_model(load_deployment(DEFAULT_DEPLOYMENT)) == "qwen3_llm"


def test_static_dag_walks_render_as_ensembles():
    enc = Component("enc", "stateless", (TensorSpec("image", "FP32", (-1,)),), (TensorSpec("latent", "FP32", (-1,)),))
    dec = Component("dec", "stateless", (TensorSpec("latent", "FP32", (-1,)),), (TensorSpec("pixels", "FP32", (-1,)),))
    walk = Walk("roundtrip", Sequential((Step("enc"), Step("dec"))), entry="enc")
    graph = FamilyGraph({"enc": enc, "dec": dec}, {"roundtrip": walk})
    text = _ensemble_pbtxt("fam_roundtrip", "fam", walk, graph, "FP32")
    assert 'platform: "ensemble"' in text
    assert 'name: "image"' in text and 'name: "pixels"' in text and 'input [\n  { name: "latent"' not in text
    assert text.index('model_name: "fam_enc"') < text.index('model_name: "fam_dec"')


def test_graph_refuses_inconsistent_declarations():
    llm = Component("llm", "autoregressive")
    with pytest.raises(ValueError, match="undeclared components"):
        FamilyGraph({"llm": llm}, {"w": Walk("w", Loop(Step("other"), "eos"), entry="other")})
    with pytest.raises(ValueError, match="on no walk"):
        FamilyGraph({"llm": llm, "x": Component("x", "stateless")}, {"w": Walk("w", Step("llm"), entry="llm")})


def test_gen_repo_replaces_only_a_generated_repository(tmp_path, monkeypatch):
    """The output folder is replaced whole: a folder holding anything gen-repo did not write is refused, untouched."""
    monkeypatch.chdir(PROJECT_ROOT)
    deployment = Path("configs") / DEFAULT_DEPLOYMENT.name
    out = tmp_path / "repo"
    generate_repository(deployment, out)
    (out / "README.md").write_text("kept\n")
    generate_repository(deployment, out)  # a generated repository (and its README) is replaced as before
    assert (out / "README.md").read_text() == "kept\n" and (out / "qwen3_llm" / "config.pbtxt").is_file()

    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(DeploymentError, match=r"--out: .*holds 'notes.txt', which gen-repo did not write"):
        generate_repository(deployment, out)
    assert (out / "notes.txt").read_text() == "mine\n"

    # inside a model folder too (a checkpoint put in Triton's version folder was deleted without a word), but the
    # __pycache__ a stub writes beside model.py when the repository is served
    cache = out / "qwen3_llm" / "1" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\0")
    (out / "notes.txt").unlink()
    generate_repository(deployment, out)
    (out / "qwen3_llm" / "1" / "weights").mkdir()
    (out / "qwen3_llm" / "1" / "weights" / "model.safetensors").write_bytes(b"w")
    with pytest.raises(DeploymentError, match=r"holds qwen3_llm/1/weights, which gen-repo did not write"):
        generate_repository(deployment, out)
    assert (out / "qwen3_llm" / "1" / "weights" / "model.safetensors").read_bytes() == b"w"

    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "a.py").write_text("x = 1\n")
    monkeypatch.chdir(work)
    for target in (".", str(work / "src" / "..")):
        with pytest.raises(DeploymentError, match="the working folder, one above it or the home folder"):
            generate_repository(PROJECT_ROOT / deployment, target)
    assert (work / "src" / "a.py").is_file() and not list(work.glob(".repo-*"))

    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(DeploymentError, match="exists and is not a folder"):
        generate_repository(PROJECT_ROOT / deployment, a_file)
    (tmp_path / "empty").mkdir()
    generate_repository(PROJECT_ROOT / deployment, tmp_path / "empty")


def test_gen_repo_refuses_a_link_leaves_no_staging_folder_and_writes_a_readable_one(tmp_path, monkeypatch):
    """`--out` naming a symbolic link to a generated repository ended in a traceback (rmtree of a link) and left a
    .repo-* folder beside it each time; the folder written was private to its owner (mkdtemp's 0700), so a
    tritonserver run as another user could not read it."""
    import os
    import stat

    monkeypatch.chdir(PROJECT_ROOT)
    deployment = Path("configs") / DEFAULT_DEPLOYMENT.name
    real, link = tmp_path / "real", tmp_path / "link"
    generate_repository(deployment, real)
    mask = os.umask(0o022)
    try:
        generate_repository(deployment, real)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(real.stat().st_mode) == 0o755
    link.symlink_to(real)
    with pytest.raises(DeploymentError, match=r"--out: .*link is a symbolic link; name the folder it points to"):
        generate_repository(deployment, link)
    assert link.is_symlink() and (real / "qwen3_llm" / "config.pbtxt").is_file()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("mstar_common.repository.write_repository", fail)
    with pytest.raises(OSError, match="disk full"):
        generate_repository(deployment, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_gen_repo_into_a_folder_it_cannot_make_is_a_deployment_error(tmp_path, monkeypatch):
    """A file where the parent folder must be (or a folder this user may not write) raised FileExistsError or
    PermissionError as a traceback."""
    monkeypatch.chdir(PROJECT_ROOT)
    deployment = Path("configs") / DEFAULT_DEPLOYMENT.name
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DeploymentError, match=r"^--out: .*afile/x: cannot write a repository there"):
        generate_repository(deployment, tmp_path / "afile" / "x")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o500)
    try:
        if not os.access(readonly, os.W_OK):  # root writes anywhere: then only the first case applies
            with pytest.raises(DeploymentError, match=r"^--out: .*ro/repo: cannot write a repository there"):
                generate_repository(deployment, readonly / "repo")
    finally:
        readonly.chmod(0o700)
