"""`mstar check` prints what a deployment will hold: each paged KV pool's pages, tokens and bytes per instance (from
the checkpoint's config alone) and the weights on disk; nothing is built or fetched for it."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from mstar_common import cli
from mstar_common.checkpoints import find_checkpoint
from mstar_common.config import deployment_from_dict
from mstar_common.families.registry import get_family
from mstar_common.memory_plan import plan_lines

QWEN3_06B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 1024,
             "intermediate_size": 3072, "num_hidden_layers": 28, "max_position_embeddings": 40960,
             "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": True}
GPU_DEPLOYMENT = {
    "name": "q", "family": "qwen3", "checkpoint": "/to/be/set",
    "components": {"llm": {"placement": {"device": "gpu", "gpus": [0], "instances": 2}}},
    "resources": {"kv_cache": {"num_pages": 8192, "page_size": 16}, "max_model_len": 4096, "max_batch_tokens": 2048},
    "max_concurrent_requests": 32, "model_kwargs": {"dtype": "bfloat16"},
}


@pytest.fixture()
def qwen3_config_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3 * 2**18)}, tmp_path / "model.safetensors")  # 3 MiB
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def _deployment(checkpoint, **kv):
    raw = copy.deepcopy(GPU_DEPLOYMENT)
    raw["checkpoint"] = str(checkpoint)
    raw["resources"]["kv_cache"].update(kv)
    return deployment_from_dict(raw, source="test")


def test_a_counted_pool_is_given_in_pages_tokens_and_bytes_from_the_checkpoints_shape(qwen3_config_dir):
    lines = plan_lines(_deployment(qwen3_config_dir), get_family("qwen3"), qwen3_config_dir)
    assert lines[0] == "llm: gpu [0] x2"
    assert lines[1] == ("kv pool (llm, per instance): 8192 pages x 16 tokens = 131072 tokens = 14.00 GiB (1.75 MiB a "
                        "page: 28 layers x K and V x 8 heads x 128 x bfloat16); max_concurrent_requests=32 at "
                        "max_model_len=4096 needs 8192 pages")
    assert lines[2] == f"weights: 3.00 MiB of safetensors in {qwen3_config_dir}"
    fp8 = plan_lines(_deployment(qwen3_config_dir, dtype="fp8_e4m3"), get_family("qwen3"), qwen3_config_dir)[1]
    assert "= 7.00 GiB (896.0 KiB a page" in fp8 and "x fp8_e4m3" in fp8


def test_several_step_loop_instances_on_one_gpu_get_a_note_and_one_instance_none(qwen3_config_dir):
    """Two engines on one GPU take turns on it (measured below one instance's tok/s): check says so, not refuses."""
    lines = plan_lines(_deployment(qwen3_config_dir), get_family("qwen3"), qwen3_config_dir)
    assert lines[-1].startswith("note: llm: 2 instances on each of gpu [0] take turns on it")
    assert "62% of one instance's tok/s at 64 streams" in lines[-1]
    raw = copy.deepcopy(GPU_DEPLOYMENT)
    raw["checkpoint"] = str(qwen3_config_dir)
    raw["components"]["llm"]["placement"]["instances"] = 1
    one = plan_lines(deployment_from_dict(raw, source="test"), get_family("qwen3"), qwen3_config_dir)
    assert not any(line.startswith("note:") for line in one)
    raw["components"]["llm"]["placement"] = {"device": "cpu", "instances": 2}
    cpu = plan_lines(deployment_from_dict(raw, source="test"), get_family("qwen3"), qwen3_config_dir)
    assert not any(line.startswith("note:") for line in cpu)


def test_an_auto_pool_is_given_with_its_fraction_and_what_the_cap_needs(qwen3_config_dir):
    dep = _deployment(qwen3_config_dir, num_pages="auto", gpu_memory_fraction=0.8)
    line = plan_lines(dep, get_family("qwen3"), qwen3_config_dir)[1]
    assert line == ("kv pool (llm, per instance): auto, sized at start-up from 0.8 of each GPU shared by its 2 "
                    "instance(s) there (1.75 MiB a page: 28 layers x K and V x 8 heads x 128 x bfloat16); "
                    "max_concurrent_requests=32 at max_model_len=4096 needs 8192 pages = 14.00 GiB")


def test_without_a_local_checkpoint_the_pool_is_given_without_bytes(qwen3_config_dir):
    lines = plan_lines(_deployment(qwen3_config_dir), get_family("qwen3"), None)
    assert lines[1].endswith("= 131072 tokens; max_concurrent_requests=32 at max_model_len=4096 needs 8192 pages")
    assert lines[2] == f"checkpoint {qwen3_config_dir}: not on this machine yet, so no byte counts"


def test_whisper_gives_its_decoders_self_attention_pool(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"decoder_layers": 32, "decoder_attention_heads": 20,
                                                      "d_model": 1280, "max_target_positions": 448}))
    assert get_family("whisper").kv_shape(tmp_path) == (32, 20, 64)
    assert get_family("flux2_klein").kv_shape(tmp_path) is None


def test_a_builtin_checkpoint_not_yet_built_is_not_built_for_a_check(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_CACHE_DIR", str(tmp_path))
    assert find_checkpoint("builtin:qwen3-tiny", get_family("qwen3").builtin_checkpoints) is None
    assert find_checkpoint("not/cached-anywhere", {}) is None
    assert not any(tmp_path.iterdir())


def test_mstar_check_prints_the_plan(qwen3_config_dir, tmp_path, capsys):
    raw = copy.deepcopy(GPU_DEPLOYMENT)
    raw["checkpoint"] = str(qwen3_config_dir)
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "ok: q (family qwen3, components ['llm'])"
    assert out[2].startswith("  kv pool (llm, per instance): 8192 pages x 16 tokens = 131072 tokens = 14.00 GiB")


def test_mstar_check_applies_the_checkpoint_rules_serve_applies(qwen3_config_dir, tmp_path, capsys):
    raw = copy.deepcopy(GPU_DEPLOYMENT)
    raw["checkpoint"] = str(qwen3_config_dir)
    raw["resources"].update(max_model_len=50_000)
    raw["resources"]["kv_cache"]["num_pages"] = 200_000
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["check", str(path)]) == 2
    assert "resources.max_model_len: 50000 exceeds the checkpoint's max_position_embeddings=40960" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("config", ['{"architectures": ["Qwen3', '{"decoder_layers": 2}', '[]', '"x"'])
def test_mstar_check_refuses_an_unreadable_checkpoint_config_in_one_line(tmp_path, capsys, config):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(config)
    raw = yaml.safe_load((cli.CONFIGS / "whisper.yaml").read_text())
    raw["checkpoint"] = str(ckpt)
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mstar: error: checkpoint {ckpt}: cannot read its config") and "Traceback" not in err


@pytest.mark.parametrize("spec, family, rule", [
    ("builtin:nope", "qwen3", "checkpoint: unknown builtin 'nope'; available: ['qwen3-tiny']"),
    ("builtin:orpheus-tiny", "qwen3", "checkpoint: unknown builtin 'orpheus-tiny'"),
    ("/etc/hostname", "qwen3", "checkpoint: /etc/hostname is not a directory"),
    ("EMPTY", "qwen3", "has no config.json (transformers layout) or model_index.json"),
])
def test_check_refuses_the_checkpoints_serve_refuses(tmp_path, capsys, spec, family, rule):
    """`mstar check` said ok (\"not on this machine yet\") for each, and `mstar serve` refused it."""
    if spec == "EMPTY":
        spec = str(tmp_path / "empty")
        (tmp_path / "empty").mkdir()
        rule = f"checkpoint: {spec} {rule}"
    raw = yaml.safe_load((cli.CONFIGS / f"{family}.yaml").read_text())
    raw["checkpoint"] = spec
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mstar: error: {rule}") and "Traceback" not in err


def test_check_and_serve_refuse_a_checkpoint_without_weights(tmp_path, capsys):
    ckpt = tmp_path / "cfgonly"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN3_06B))
    raw = yaml.safe_load((cli.CONFIGS / "qwen3.yaml").read_text())
    raw["checkpoint"] = str(ckpt)
    path = tmp_path / "dep.yaml"
    path.write_text(yaml.safe_dump(raw))
    for command in (["check", str(path)], ["serve", str(path), "--no-proxy", "--timeout", "5"]):
        assert cli.main(command) == 2
        assert f"mstar: error: checkpoint {ckpt}: no *.safetensors weights in it" in capsys.readouterr().err


def test_cpu_pools_larger_than_the_machines_memory_are_refused(qwen3_config_dir):
    from mstar_common.config import DeploymentError
    from mstar_common.memory_plan import check_cpu_pools_fit

    raw = copy.deepcopy(GPU_DEPLOYMENT)
    raw["checkpoint"] = str(qwen3_config_dir)
    raw["components"]["llm"]["placement"] = {"device": "cpu", "instances": 2}
    raw["model_kwargs"] = {"dtype": "float32"}
    dep = deployment_from_dict(raw, source="test")  # 2 pools of 8193 pages of 3.5 MiB (fp32): 56.01 GiB
    with pytest.raises(DeploymentError, match=r"^t.yaml: resources.kv_cache.num_pages: 2 cpu pool\(s\) of 8192 pages "
                                              r"need 56.01 GiB, more than this machine's 32.00 GiB of memory"):
        check_cpu_pools_fit(dep, get_family("qwen3"), qwen3_config_dir, "t.yaml", memory=32 * 2**30)
    check_cpu_pools_fit(dep, get_family("qwen3"), qwen3_config_dir, "t.yaml", memory=64 * 2**30)


def test_mstar_serve_prints_the_shared_gpu_note_before_it_looks_for_the_gpus(tmp_path, capsys, monkeypatch):
    """`mstar serve` says it too (before the load, where users look), then goes on to its GPU check (stopped there
    here, so no server starts on a machine with a GPU either)."""
    from mstar_common.config import DeploymentError

    def stop(dep, source):
        raise DeploymentError("stopped at the GPU check")

    monkeypatch.setattr(cli, "check_gpus_visible", stop)
    raw = yaml.safe_load((cli.PROJECT_ROOT / "configs" / "qwen3.yaml").read_text())
    raw["components"]["llm"]["placement"] = {"device": "gpu", "gpus": [0], "instances": 2}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["serve", str(path), "--no-proxy", "--timeout", "5"]) == 2
    out = capsys.readouterr()
    assert "[mstar] note: llm: 2 instances on each of gpu [0] take turns on it" in out.out
    assert "stopped at the GPU check" in out.err


WHISPER_LARGE_V3 = {"decoder_layers": 32, "decoder_attention_heads": 20, "d_model": 1280, "max_target_positions": 448,
                    "max_source_positions": 1500}


def test_whisper_counts_its_decoders_cross_attention_slots(tmp_path):
    """The decoder's cross-attention K/V (one slot of 1500 positions per admitted request: 14.69 GiB for large-v3's
    64 slots in bf16, three times its self-attention pool) was in no printed line and no memory check: a cpu
    deployment passed the check and failed in the allocator as it loaded."""
    from mstar_common.config import DeploymentError
    from mstar_common.memory_plan import check_cpu_pools_fit

    (tmp_path / "config.json").write_text(json.dumps(WHISPER_LARGE_V3))
    raw = yaml.safe_load((cli.CONFIGS / "whisper_large_v3_gpu.yaml").read_text())
    raw["checkpoint"] = str(tmp_path)
    gpu = deployment_from_dict(raw, source="test")
    assert gpu.max_concurrent_requests == 64 and gpu.resources.kv_cache.page_size == 16
    lines = plan_lines(gpu, get_family("whisper"), tmp_path)
    assert "cross-attention KV (64 slots, bfloat16) (decoder, per instance): 14.69 GiB, sized by " \
           "max_concurrent_requests" in lines, lines
    for name in ("walk", "encoder", "decoder"):
        raw["components"][name]["placement"] = {"device": "cpu", "instances": 1}
        raw["components"][name].pop("cuda_graphs", None)
        raw["components"][name].pop("fused_ops", None)
        raw["components"][name].pop("decode_buckets", None)
    raw["resources"]["kv_cache"] = {"num_pages": 1792, "page_size": 16}
    raw["model_kwargs"]["dtype"] = "float32"
    cpu = deployment_from_dict(raw, source="test")  # 64 fp32 slots: 29.38 GiB, the pool 8.76 GiB
    with pytest.raises(DeploymentError, match=r"max_concurrent_requests: the cross-attention KV \(64 slots, float32\) "
                                              r"need 29.38 GiB, more than this machine's 32.00 GiB"):
        check_cpu_pools_fit(cpu, get_family("whisper"), tmp_path, "t.yaml", memory=32 * 2**30)
    check_cpu_pools_fit(cpu, get_family("whisper"), tmp_path, "t.yaml", memory=48 * 2**30)


@pytest.mark.parametrize("damage", ["lfs pointer", "cut short", "index not json", "index without weight_map"])
def test_check_refuses_weights_a_load_could_not_read_naming_the_file(tmp_path, damage):
    """A Git LFS pointer in place of the weights, a download cut short, or an index that is no index passed every
    check; the load then failed inside tritonserver with safetensors' 'header too large' (no file named) or a
    KeyError 'weight_map'."""
    import shutil

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.config import DeploymentError

    family = get_family("qwen3")
    checkpoint = shutil.copytree(resolve_checkpoint("builtin:qwen3-tiny", family.builtin_checkpoints),
                                 tmp_path / "ck")
    weights = checkpoint / "model.safetensors"
    if damage == "lfs pointer":
        weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456\n")
    elif damage == "cut short":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (checkpoint / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"x' if
                                                                 damage == "index not json" else '{"metadata": {}}')
    raw = yaml.safe_load(cli.DEFAULT_DEPLOYMENT.read_text())
    raw["checkpoint"] = str(checkpoint)
    dep = deployment_from_dict(raw, source="d.yaml")
    name = "model.safetensors.index.json" if damage.startswith("index") else "model.safetensors"
    with pytest.raises(DeploymentError, match=re.escape(name)) as info:
        cli.check_against_checkpoint(family, dep, checkpoint, "d.yaml")
    assert ("LFS pointer or an unfinished download" in str(info.value)) != damage.startswith("index")
