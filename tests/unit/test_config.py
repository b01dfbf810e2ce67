"""Deployment schema: strict keys, typed values, family checks, pool sizing."""

import copy

import pytest
import yaml

from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import DeploymentError, deployment_from_dict

BASE = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())


def _with(**changes):
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return raw


_DELETE = object()


def _refused(raw, *fragments):
    with pytest.raises(DeploymentError) as info:
        deployment_from_dict(raw, source="test.yaml")
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_default_deployment_loads():
    dep = deployment_from_dict(copy.deepcopy(BASE))
    assert dep.family == "qwen3" and dep.components["llm"].placement.device == "cpu"


def test_unknown_top_level_key_is_named():
    _refused(_with(max_concurent_requests=4), "unknown key(s) ['max_concurent_requests']")


def test_unknown_nested_key_is_named_with_its_path():
    _refused(_with(resources__kv_cache__pages=4), "resources.kv_cache", "['pages']")


def test_wrong_type_names_the_key():
    _refused(_with(max_concurrent_requests="many"), "max_concurrent_requests", "integer")


def test_prefix_caching_is_auto_by_default_and_must_be_a_boolean():
    assert deployment_from_dict(copy.deepcopy(BASE)).resources.kv_cache.prefix_caching is None
    for value in (True, False):
        dep = deployment_from_dict(_with(resources__kv_cache__prefix_caching=value))
        assert dep.resources.kv_cache.prefix_caching is value
    _refused(_with(resources__kv_cache__prefix_caching="no"), "resources.kv_cache.prefix_caching")


def test_missing_required_key():
    _refused(_with(family=_DELETE), "family: required key is missing")


def test_unknown_family_lists_available():
    _refused(_with(family="nope"), "unknown family 'nope'", "qwen3")


def test_missing_and_extra_components():
    _refused(_with(components={}), "components: missing ['llm']")
    raw = _with(components__codec={"placement": {"device": "cpu"}})
    _refused(raw, "components: unknown ['codec']")


def test_placement_rules():
    _refused(_with(components__llm={"placement": {"device": "gpu"}}), "components.llm.placement.gpus")
    _refused(_with(components__llm={"placement": {"device": "tpu"}}), "must be one of ['cpu', 'gpu']")
    _refused(_with(components__llm={"placement": {"device": "gpu", "gpus": [0, 0]}}), "distinct")
    _refused(_with(components__llm={"placement": {"device": "cpu", "instances": 0}}),
             "instances: must be in [1, 64], got 0")


def test_pool_too_small_for_the_cap_is_refused():
    _refused(
        _with(resources__kv_cache={"num_pages": 100, "page_size": 16}),
        "resources.kv_cache.num_pages",
        "max_concurrent_requests=16",
        "need >= 512",
    )


def test_an_auto_pool_is_for_gpu_placements_and_its_fraction_goes_with_it():
    gpu = {"placement": {"device": "gpu", "gpus": [0, 1], "instances": 2}}
    dep = deployment_from_dict(_with(components__llm=gpu, resources__kv_cache={"num_pages": "auto"}))
    kv = dep.resources.kv_cache
    assert kv.is_auto and kv.instance_share(dep.components["llm"].placement) == pytest.approx(0.45)
    dep = deployment_from_dict(_with(components__llm=gpu,
                                     resources__kv_cache={"num_pages": "auto", "gpu_memory_fraction": 0.5}))
    assert dep.resources.kv_cache.instance_share(dep.components["llm"].placement) == pytest.approx(0.25)
    _refused(_with(resources__kv_cache={"num_pages": "auto"}),
             "resources.kv_cache.num_pages: auto sizes the pool from GPU memory, and components.llm holds it on the "
             "cpu; give a number of pages")
    _refused(_with(resources__kv_cache={"num_pages": 512, "gpu_memory_fraction": 0.5}),
             "resources.kv_cache.gpu_memory_fraction: sizes a pool of num_pages: auto only")
    for fraction in (0, 1.5):
        _refused(_with(components__llm=gpu, resources__kv_cache={"num_pages": "auto", "gpu_memory_fraction": fraction}),
                 "resources.kv_cache.gpu_memory_fraction: must be in (0, 1]")
    _refused(_with(resources__kv_cache={"num_pages": "lots"}),
             "resources.kv_cache.num_pages: expected an integer or 'auto', got 'lots'")
    _refused(_with(resources__kv_cache={"num_pages": 0}), "resources.kv_cache.num_pages: must be >= 1")


def test_model_kwargs_are_checked_by_the_family():
    _refused(_with(model_kwargs={"dtype": "float8"}), "model_kwargs.dtype")
    _refused(_with(model_kwargs={"temperatur": 1}), "model_kwargs: unknown key(s) ['temperatur']")


CAPTURED_LLM = {"placement": {"device": "gpu", "gpus": [0]}, "cuda_graphs": True}


def test_prefill_buckets_beyond_the_step_budget_are_refused():
    raw = _with(resources__max_batch_tokens=1024, components__llm={**CAPTURED_LLM,
                                                                   "prefill_token_buckets": [512, 1024, 4096]})
    _refused(raw, "components.llm.prefill_token_buckets: [4096] exceed resources.max_batch_tokens (1024)")
    ok = _with(resources__max_batch_tokens=1024, components__llm={**CAPTURED_LLM, "prefill_token_buckets": [512, 1024]})
    assert deployment_from_dict(ok).components["llm"].prefill_token_buckets == [512, 1024]


def test_cuda_graphs_need_a_gpu():
    _refused(_with(components__llm={"cuda_graphs": True}), "cuda_graphs: needs a gpu placement")


def test_admission_limits_and_server_keys_load_and_resolve():
    dep = deployment_from_dict(_with(admission={"max_queue": 8, "queue_timeout_s": 5, "request_timeout_s": None},
                                     limits={"allow_remote_urls": True}, server={"drain_timeout_s": 3}))
    assert dep.admission.max_queue == 8 and dep.admission.queue_timeout_s == 5.0
    assert dep.admission.request_timeout_s is None and dep.limits.allow_remote_urls
    assert deployment_from_dict(copy.deepcopy(BASE)).admission.resolved_max_queue(16) == 64


@pytest.mark.parametrize("changes, fragments", [
    ({"admission__max_queue": -1}, ("admission.max_queue", ">= 0")),
    ({"admission__queue_timeout_s": 0}, ("admission.queue_timeout_s", "in (0, 604,800]", "got 0.0")),
    ({"admission__request_timeout_s": "soon"}, ("admission.request_timeout_s", "number")),
    ({"admission__retry_after_s": 0}, ("admission.retry_after_s", ">= 1")),
    ({"admission__queue": 3}, ("admission", "unknown key(s) ['queue']")),
    ({"limits__max_body_bytes": 0}, ("limits.max_body_bytes", ">= 1")),
    ({"limits__max_upload_s": -1}, ("limits.max_upload_s", "in (0, 604,800]", "got -1.0")),
    ({"server__shm_default_byte_size": 1000}, ("server.shm_default_byte_size", "1 MiB")),
    ({"server__stub_timeout_seconds": 0}, ("server.stub_timeout_seconds", ">= 1")),
    ({"server__max_restarts": -1}, ("server.max_restarts", "in [0, 1000]", "got -1")),
    ({"server__proxy_workers": 0}, ("server.proxy_workers", "[1, 64]")),
    ({"server__proxy_workers": 65}, ("server.proxy_workers", "[1, 64]")),
])
def test_admission_limits_and_server_refusals_name_the_key(changes, fragments):
    _refused(_with(**changes), *fragments)


# rules found by a black-box sweep of `mstar check` / `mstar serve` (2026-12-05): each was accepted, then failed
# inside tritonserver (or silently dropped a setting)


@pytest.mark.parametrize("changes, fragments", [
    ({"resources__max_batch_tokens": 8}, ["resources.max_batch_tokens: 8 tokens a step", "need >= 16"]),
    ({"server__grpc_port": -1}, ["server.grpc_port: must be a TCP port in [1, 65535], got -1"]),
    ({"server__metrics_port": 70000}, ["server.metrics_port", "got 70000"]),
    ({"server__http_port": 8001}, ["server.grpc_port: 8001 is also server.http_port"]),
    ({"components__llm__decode_buckets": [1, 2, 1000]}, ["components.llm.decode_buckets: [1000] exceed "
                                                         "max_concurrent_requests (16)"]),
])
def test_step_budget_ports_and_decode_buckets_are_checked(changes, fragments):
    _refused(_with(**changes), *fragments)


def test_a_key_given_twice_and_malformed_yaml_are_refused_naming_the_place(tmp_path):
    from mstar_common.config import load_deployment

    text = DEFAULT_DEPLOYMENT.read_text()
    twice = tmp_path / "twice.yaml"
    twice.write_text(text + "\nmax_concurrent_requests: 4\n")
    with pytest.raises(DeploymentError, match=r"(?s)twice.yaml: not valid YAML: .*'max_concurrent_requests' is given "
                                              r"twice.*line 19"):
        load_deployment(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text(text.replace("components:\n", "components:\n  llm: {placement: {device: cpu}}\n", 1))
    with pytest.raises(DeploymentError, match=r"'llm' is given twice"):
        load_deployment(nested)
    for body in ("name: [unclosed\n", "name: x\n\tfamily: qwen3\n", "name: !!python/object/apply:os.system [ls]\n"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(body)
        with pytest.raises(DeploymentError, match=r"^bad.yaml: not valid YAML"):
            load_deployment(bad)


def test_image_default_size_within_the_area_and_on_the_checkpoints_grid(tmp_path):
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    raw["model_kwargs"]["default_size"] = "4096x4096"
    _refused(copy.deepcopy(raw), "model_kwargs.default_size: 4096x4096 = 16777216 pixels exceeds max_image_area")
    family = get_family(raw["family"])
    checkpoint = resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints)
    raw["model_kwargs"]["default_size"] = "63x65"
    with pytest.raises(DeploymentError, match=r"model_kwargs.default_size: 63x65 is not on the latent grid"):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")
    raw["model_kwargs"]["default_size"] = "64x64"
    family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")


def test_max_model_len_is_checked_against_the_checkpoint_before_serving():
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    family = get_family("qwen3")
    checkpoint = resolve_checkpoint(BASE["checkpoint"], family.builtin_checkpoints)
    raw = _with(resources__max_model_len=100_000, resources__kv_cache__num_pages=100_000)
    with pytest.raises(DeploymentError, match=r"resources.max_model_len: 100000 exceeds the checkpoint's "
                                              r"max_position_embeddings=\d+"):
        family.check_checkpoint(deployment_from_dict(raw), checkpoint, "test.yaml")
    family.check_checkpoint(deployment_from_dict(copy.deepcopy(BASE)), checkpoint, "test.yaml")


def test_gpus_a_placement_names_must_be_visible(monkeypatch):
    import torch

    from mstar_common.cli import check_gpus_visible

    dep = deployment_from_dict(copy.deepcopy(BASE))
    check_gpus_visible(dep, "test.yaml")  # cpu placements: nothing to see
    dep.components["llm"].placement.device, dep.components["llm"].placement.gpus = "gpu", [0, 2]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeploymentError, match=r"components.llm.placement.gpus: \[2\] not visible .* 2 GPU\(s\)"):
        check_gpus_visible(dep, "test.yaml")
    dep.components["llm"].placement.gpus = [1]
    check_gpus_visible(dep, "test.yaml")


@pytest.mark.parametrize("body, rule", [
    (b"name: caf\xe9\n", r"^bad.yaml: not UTF-8 text \(byte 0xe9 on line 1\)"),
    ("name: x\n1: foo\nbar: 2\n".encode(), r"(?s)not valid YAML: .*the key 1 is not a string.*line 2"),
    (b"? [a, b]\n: 1\n", r"(?s)not valid YAML: .*a key is a sequence; every key is a name"),
    (b"a: " + b"[" * 5000 + b"\n", r"^bad.yaml: nested too deeply to read"),
    (b"max_concurrent_requests: " + b"9" * 5000 + b"\n", r"^bad.yaml: a value cannot be read: a number of more "
                                                           r"than 4300 digits$"),
    (b"", r"^bad.yaml: empty: a deployment is a mapping"),
    # merged keys came in past the key check (a TypeError sorting them beside a string), and a lone surrogate in a
    # string failed where it was written or printed (UnicodeEncodeError)
    (b"name: x\n<<: {1: a}\nbogus: 1\n", r"(?s)not valid YAML: .*the key 1 \(merged in by '<<'\) is not a string"),
    (b'name: x\ncheckpoint: "\\ud800x"\n', r"(?s)not valid YAML: .*holds a lone UTF-16 surrogate.*line 2"),
    # keys that are falsy passed the merged-key check
    (b"name: x\n<<: {0: a}\nbogus: 1\n", r"(?s)not valid YAML: .*the key 0 \(merged in by '<<'\) is not a string"),
    (b"name: x\n<<: {false: a}\n", r"(?s)not valid YAML: .*the key False \(merged in by '<<'\) is not a string"),
    (b"name: x\n<<: {null: a}\n", r"(?s)not valid YAML: .*the key None \(merged in by '<<'\) is not a string"),
])
def test_files_the_loader_cannot_read_are_one_line_refusals(tmp_path, body, rule):
    """Each gave a Python traceback from `mstar check` (a QA sweep, 2026-12-05)."""
    from mstar_common.config import load_deployment

    bad = tmp_path / "bad.yaml"
    bad.write_bytes(body)
    with pytest.raises(DeploymentError, match=rule):
        load_deployment(bad)


def test_a_surrogate_pair_escaped_as_two_is_its_character(tmp_path):
    """json.dump writes an emoji as `"\\ud83d\\ude00"`; PyYAML keeps the two halves apart, which the lone-surrogate
    rule refused as one."""
    from mstar_common.config import load_deployment

    path = tmp_path / "pair.yaml"
    from mstar_common.cli import CONFIGS

    path.write_text((CONFIGS / "qwen3.yaml").read_text().replace("name: qwen3-tiny", 'name: "q\\ud83d\\ude00"'))
    with pytest.raises(DeploymentError, match="^pair.yaml: name: must be 1-128 letters.*, got 'q\U0001F600'$"):
        load_deployment(path)


def test_yaml_merge_keys_work_and_own_keys_override_them(tmp_path):
    from mstar_common.config import load_deployment

    text = DEFAULT_DEPLOYMENT.read_text()
    own = "    placement: {device: cpu, instances: 1}\n"
    assert own in text
    merged = tmp_path / "merged.yaml"
    merged.write_text(text.replace(own, "    placement: {<<: {device: gpu, instances: 3, gpus: []}, device: cpu}\n"))
    dep = load_deployment(merged)
    assert dep.components["llm"].placement.device == "cpu" and dep.components["llm"].placement.instances == 3


@pytest.mark.parametrize("name", ["x$(id>&2)", "my model", "a\nb", "a=b", "../../etc", "-x", "x" * 129, ""])
def test_a_name_outside_the_rule_is_refused(name):
    """A name reaches the run folder's path, which tritonserver's Python backend hands to a shell unquoted: `$(...)`
    ran, a space hung `mstar serve` until its timeout, `a/b`, `../..` and 300 characters failed as OS errors."""
    _refused(_with(name=name), "name: must be 1-128 letters, digits and . _ : / -" if name else "name: expected a "
             "non-empty string")


@pytest.mark.parametrize("name", ["qwen3-tiny", "Qwen/Qwen3-0.6B", "org/model:v1.2_b", "x" * 128])
def test_names_clients_use_are_accepted(name):
    assert deployment_from_dict(_with(name=name)).name == name


def test_a_repository_path_a_shell_would_split_is_refused(tmp_path, monkeypatch, capsys):
    from mstar_common.cli import main
    from mstar_common.repository import shell_unsafe

    assert shell_unsafe(tmp_path / "repo") is None
    assert "' '" in shell_unsafe(tmp_path / "my repo") and "'$'" in shell_unsafe("/tmp/$(id)")
    assert main(["gen-repo", str(DEFAULT_DEPLOYMENT), "--out", str(tmp_path / "my repo")]) == 2
    assert "mstar: error: --out: " in capsys.readouterr().err and not (tmp_path / "my repo").exists()
    spaced = tmp_path / "tmp dir"
    spaced.mkdir()
    monkeypatch.setenv("TMPDIR", str(spaced))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    from mstar_common.launcher import free_ports

    names = ("--http-port", "--grpc-port", "--metrics-port")
    ports = [flag for name, port in zip(names, free_ports(3), strict=True) for flag in (name, str(port))]
    assert main(["serve", str(DEFAULT_DEPLOYMENT), "--no-proxy", "--timeout", "5", *ports]) == 2
    err = capsys.readouterr().err
    assert "the run folder's parent ($TMPDIR): " in err and "set TMPDIR to such a folder" in err
    assert list(spaced.iterdir()) == []


@pytest.mark.parametrize("changes, fragment", [
    ({"admission__request_timeout_s": 1e300}, "admission.request_timeout_s: must be a number of seconds in (0, "
                                              "604,800]"),  # served: every request a 500 (int64 overflow)
    ({"admission__queue_timeout_s": 1e7}, "admission.queue_timeout_s: must be a number of seconds"),
    ({"server__drain_timeout_s": 10**12}, "server.drain_timeout_s: must be at most 604,800"),  # tritonserver exit 1
    ({"server__shm_default_byte_size": 2**70}, "server.shm_default_byte_size: must be at most"),  # abort in stol
    ({"resources__kv_cache__num_pages": 10**30}, "resources.kv_cache.num_pages: must be at most 2,147,483,647"),
    ({"resources__kv_cache__page_size": 10**9}, "resources.kv_cache.page_size: must be at most 4,096"),
    ({"components__llm__placement__instances": 10**6}, "instances: must be in [1, 64]"),
    ({"limits__max_upload_s": 1e9}, "limits.max_upload_s: must be a number of seconds"),
    ({"server__max_restarts": 10**9}, "server.max_restarts: must be in [0, 1000]"),
    ({"server__keep_run_folders": -1}, "server.keep_run_folders: must be in [0, 10000], got -1"),
])
def test_numbers_past_any_real_setting_are_refused_before_they_overflow(changes, fragment):
    _refused(_with(**changes), fragment)


def test_a_shared_memory_region_larger_than_dev_shm_is_refused_by_serve(monkeypatch):
    """Served, tritonserver failed to load the model with an error that named no key."""
    import os
    from types import SimpleNamespace

    from mstar_common.cli import check_shm_size

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_frsize=4096, f_bavail=2**18))  # 1 GiB free
    with pytest.raises(DeploymentError, match=r"^t.yaml: server.shm_default_byte_size: 1 stub\(s\) \(one per "
                                              r"component instance\) x 2,147,483,648 bytes = 2,147,483,648 bytes is "
                                              r"more than /dev/shm has free \(1,073,741,824 bytes\)"):
        check_shm_size(deployment_from_dict(_with(server__shm_default_byte_size=2**31)), "t.yaml")
    check_shm_size(deployment_from_dict(copy.deepcopy(BASE)), "t.yaml")
    # every stub takes its whole region: Docker's 64 MiB /dev/shm holds two 32 MiB regions, not three (the check
    # counted one region, and served, the third stub's model failed to load naming no key)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_frsize=4096, f_bavail=2**14))  # 64 MiB free
    two = _with(server__shm_default_byte_size=2**25, components__llm__placement__instances=2)
    check_shm_size(deployment_from_dict(two), "t.yaml")
    with pytest.raises(DeploymentError, match=r"3 stub\(s\) .* = 100,663,296 bytes is more than /dev/shm has free"):
        check_shm_size(deployment_from_dict(_with(server__shm_default_byte_size=2**25,
                                                  components__llm__placement__instances=3)), "t.yaml")


@pytest.mark.parametrize("family, component, setting, fragment", [
    ("qwen3", "llm", {"attention_backend": "triton"}, "attention_backend: 'triton' runs on a GPU"),
    ("qwen3", "llm", {"attention_backend": "flashinfer"}, "attention_backend: 'flashinfer' runs on a GPU"),
    ("qwen3", "llm", {**CAPTURED_LLM, "attention_backend": "torch"}, "'torch' cannot be captured in a CUDA graph"),
    ("qwen3", "llm", {"decode_buckets": [1, 2]}, "decode_buckets: buckets are the captured CUDA graphs' sizes, and "
                                                 "cuda_graphs is off"),
    ("orpheus", "snac", {"attention_backend": "flashinfer"}, "components.snac.attention_backend: snac is not an "
                                                             "autoregressive component (those of orpheus are ['lm'])"),
    ("whisper", "encoder", {"decode_buckets": [1]}, "components.encoder.decode_buckets: encoder is not an "
                                                   "autoregressive"),
])
def test_settings_a_component_would_fail_on_or_ignore_are_refused(family, component, setting, fragment):
    """Each was accepted by `mstar check`, then failed as the model loaded or did nothing (a QA sweep, 2026-12-05)."""
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / f"{family}.yaml").read_text())
    raw["components"][component] = {**raw["components"][component], **setting}
    _refused(raw, f"components.{component}.", fragment)


def test_orpheus_codec_checkpoint_is_a_name_that_must_resolve(tmp_path):
    """A number failed as the model loaded with an AttributeError, a missing folder with an error naming no key."""
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "orpheus.yaml").read_text())
    raw.setdefault("model_kwargs", {})["codec_checkpoint"] = 5
    _refused(raw, "model_kwargs.codec_checkpoint: must be a checkpoint folder, a cached HF repo id or builtin:<name>, "
                  "got 5")
    raw["model_kwargs"]["codec_checkpoint"] = str(tmp_path / "no-snac")
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    missing = tmp_path / "no-snac"
    with pytest.raises(DeploymentError, match=rf"^t.yaml: model_kwargs.codec_checkpoint: checkpoint: {missing} is not "
                                              rf"a directory"):
        get_family("orpheus").check_checkpoint(deployment_from_dict(raw), tmp_path, "t.yaml")


@pytest.mark.parametrize("family, component, setting, fragment", [
    ("orpheus", "snac", {"fused_ops": False}, "components.snac.fused_ops: snac is not an autoregressive component"),
    ("flux2_klein", "denoise", {"capture_sampling": False}, "components.denoise.capture_sampling: denoise is not an "
                                                            "autoregressive component"),
    ("whisper", "walk", {"fused_ops": False}, "components.walk.fused_ops: walk is not an autoregressive"),
])
def test_decoder_knobs_on_a_component_without_a_decoder_are_refused(family, component, setting, fragment):
    """fused_ops and capture_sampling are read by the autoregressive engine alone; elsewhere they did nothing."""
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / f"{family}.yaml").read_text())
    raw["components"][component] = {**(raw["components"].get(component) or {}), **setting}
    _refused(raw, fragment)


def test_an_image_walk_refuses_a_queue_timeout_it_has_no_queue_for():
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "flux2_klein.yaml").read_text())
    raw["admission"] = {"queue_timeout_s": 5}
    _refused(raw, "admission.queue_timeout_s: an image walk does not wait for admission")
    raw["admission"] = {"max_queue": 2, "request_timeout_s": 30}  # what its walk does read
    deployment_from_dict(raw, source="test.yaml")


@pytest.mark.parametrize("changes, fragment", [
    ({"components__llm__cuda_graphs": True, "components__llm__placement": {"device": "gpu", "gpus": [0]},
      "components__llm__decode_buckets": [1, 2, 2, 4]}, "components.llm.decode_buckets: [2] given more than once"),
    ({"components__llm__cuda_graphs": True, "components__llm__placement": {"device": "gpu", "gpus": [0]},
      "components__llm__prefill_token_buckets": [64, 64]}, "prefill_token_buckets: [64] given more than once"),
    ({"admission__queue_timeout_s": 10**400}, "admission.queue_timeout_s: expected a number, got an integer too large"),
    ({"limits__max_upload_s": -10**400}, "limits.max_upload_s: expected a number, got an integer too large"),
])
def test_repeated_buckets_and_integers_past_a_float_are_refused(changes, fragment):
    """A repeated ladder was deduplicated without a word (ENGINE.md 16.3 refuses it); an integer past ~1.8e308 where
    a number is wanted ended `mstar check` in an OverflowError traceback."""
    _refused(_with(**changes), fragment)


def test_image_capture_lists_and_lora_scales_are_checked_without_tracebacks(tmp_path):
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "flux2_klein.yaml").read_text())
    kwargs = raw.setdefault("model_kwargs", {})
    _refused({**raw, "model_kwargs": {**kwargs, "capture_batch_sizes": [1, 1]}},
             "model_kwargs.capture_batch_sizes: [1] given more than once")
    _refused({**raw, "model_kwargs": {**kwargs, "capture_sizes": ["64x64", "64X64"]}},
             "model_kwargs.capture_sizes: ['64x64'] given more than once")
    adapter = tmp_path / "a.safetensors"
    adapter.write_bytes(b"")
    _refused({**raw, "model_kwargs": {**kwargs, "lora": [{"path": str(adapter), "scale": 10**400}]}},
             "lora[0].scale: must be a finite number")
    _refused({**raw, "model_kwargs": {**kwargs, "lora": [{"path": "~no_such_user_mstar/a.safetensors"}]}},
             "lora[0].path: ~no_such_user_mstar/a.safetensors: no home folder is known for '~no_such_user_mstar'")


def test_a_checkpoint_under_an_unknown_users_home_is_a_one_line_refusal(tmp_path, capsys):
    """pathlib's RuntimeError ('Could not determine home directory') ended `mstar check` in a traceback."""
    from mstar_common.cli import main

    raw = copy.deepcopy(BASE)
    raw["checkpoint"] = "~no_such_user_mstar/qwen3"
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint: ~no_such_user_mstar/qwen3: no home folder is known for '~no_such_user_mstar'" in err, err
    assert "Traceback" not in err


def test_whisper_thresholds_past_a_float_are_refused():
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    raw.setdefault("model_kwargs", {})["no_speech_threshold"] = 10**400
    _refused(raw, "model_kwargs.no_speech_threshold: must be null (the rule off) or a number in [0.0, 1.0]")


def test_an_unset_pool_is_auto_on_a_gpu_and_holds_the_cap_on_the_cpu():
    """The 512-page default could not hold the default cap (16 requests of 2048 tokens need 2048 pages of 16), so a
    deployment that set no pool was refused at its defaults."""
    raw = {"name": "m", "family": "qwen3", "checkpoint": "builtin:qwen3-tiny",
           "components": {"llm": {"placement": {"device": "cpu"}}}}
    cpu = deployment_from_dict(copy.deepcopy(raw), source="t.yaml")
    assert cpu.resources.kv_cache.num_pages == 2048
    raw["max_concurrent_requests"], raw["resources"] = 3, {"max_model_len": 100, "kv_cache": {"page_size": 32}}
    assert deployment_from_dict(copy.deepcopy(raw), source="t.yaml").resources.kv_cache.num_pages == 3 * 4
    raw["components"]["llm"]["placement"] = {"device": "gpu", "gpus": [0]}
    assert deployment_from_dict(copy.deepcopy(raw), source="t.yaml").resources.kv_cache.num_pages == "auto"
    raw["components"]["llm"]["placement"] = {"device": "cpu"}
    raw["resources"]["kv_cache"]["gpu_memory_fraction"] = 0.5  # read by auto alone, which a cpu pool cannot be
    _refused(raw, "resources.kv_cache.gpu_memory_fraction: sizes a pool of num_pages: auto, which components.llm on "
                  "the cpu cannot hold; give num_pages instead")
    raw["resources"] = {"max_model_len": 2**24, "kv_cache": {"page_size": 1}}
    raw["max_concurrent_requests"] = 2**20
    _refused(raw, "resources.kv_cache.num_pages: unset, so sized for max_concurrent_requests=1048576 requests of "
                  "max_model_len=16777216 tokens")
    raw["max_concurrent_requests"], raw["resources"] = 3, {"kv_cache": {"num_pages": 7}}
    _refused(raw, "resources.kv_cache.num_pages: 7 pages cannot hold")  # a number given is the user's, checked


def test_an_image_family_keeps_its_pool_unset():
    from mstar_common.cli import CONFIGS

    dep = deployment_from_dict(yaml.safe_load((CONFIGS / "flux2_klein.yaml").read_text()), source="t.yaml")
    assert dep.resources.kv_cache.num_pages is None


def test_z_image_caption_lengths_listed_twice_are_refused():
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    raw.setdefault("model_kwargs", {})["capture_caption_tokens"] = [64, 64]
    _refused(raw, "model_kwargs.capture_caption_tokens: [64] given more than once; each length is one captured graph")


def test_gpu_ids_past_what_config_pbtxt_holds_are_refused():
    """`gpus: [4294967296]` passed check and gen-repo, and tritonserver's int32 field refused the repository."""
    _refused(_with(components__llm={"placement": {"device": "gpu", "gpus": [0, 4294967296]}}),
             "components.llm.placement.gpus: GPU ids are at most 1023, got 4294967296")
    assert deployment_from_dict(_with(components__llm={"placement": {"device": "gpu", "gpus": [1023]}})) \
        .components["llm"].placement.gpus == [1023]


def test_a_head_dim_the_attention_kernels_do_not_take_is_refused_before_serving(tmp_path):
    """A checkpoint of head dim 100 (3,200 hidden over 32 heads) on a GPU passed `mstar check`, then its first
    capture or step failed on a bare AssertionError inside a kernel launch."""
    import json
    import shutil

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    family = get_family("qwen3")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint(BASE["checkpoint"], family.builtin_checkpoints), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "head_dim": 24}))
    on_gpu = {"placement": {"device": "gpu", "gpus": [0]}}
    with pytest.raises(DeploymentError, match=r"components.llm.attention_backend: 'auto' runs the Triton attention "
                                              r"kernels \(flashinfer: their KV write\), which take head dims "
                                              r"\[16, 32, 64, 128, 256\]; the checkpoint's head_dim is 24: set "
                                              r"attention_backend: torch_static"):
        family.check_checkpoint(deployment_from_dict(_with(components__llm=on_gpu)), checkpoint, "test.yaml")
    # flashinfer too: its KV write is the Triton prologue, which failed on a bare AssertionError
    with pytest.raises(DeploymentError, match=r"attention_backend: 'flashinfer' runs the Triton attention kernels"):
        family.check_checkpoint(deployment_from_dict(_with(components__llm={**on_gpu, "attention_backend":
                                                                           "flashinfer"})), checkpoint, "test.yaml")
    for llm in ({**on_gpu, "attention_backend": "torch_static"}, {}):  # the torch backends, or the CPU: any
        family.check_checkpoint(deployment_from_dict(_with(components__llm=llm)), checkpoint, "test.yaml")


def test_an_fp8_pool_under_the_kernels_needs_a_head_dim_of_32_or_more():
    """The builtin tiny checkpoints (head_dim 16) with kv_cache.dtype fp8_e4m3 passed `mstar check`, then the decode
    kernel's 8-bit q.k dot failed to compile (Triton's K >= 32) at the first capture or step."""
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family

    family = get_family("qwen3")
    checkpoint = resolve_checkpoint(BASE["checkpoint"], family.builtin_checkpoints)
    on_gpu = {"placement": {"device": "gpu", "gpus": [0]}}
    with pytest.raises(DeploymentError, match=r"resources.kv_cache.dtype: fp8_e4m3 reads the pool with 8-bit dots "
                                              r"over the head dim, which Triton takes from 32; the checkpoint's "
                                              r"head_dim is 16"):
        family.check_checkpoint(deployment_from_dict(_with(components__llm=on_gpu,
                                                           resources__kv_cache__dtype="fp8_e4m3")), checkpoint,
                                "test.yaml")
    for llm in ({**on_gpu, "attention_backend": "torch_static"}, {}):  # the torch backends read it in torch
        family.check_checkpoint(deployment_from_dict(_with(components__llm=llm,
                                                           resources__kv_cache__dtype="fp8_e4m3")), checkpoint,
                                "test.yaml")


@pytest.mark.parametrize("spoil, rule", [
    # accepted, then every request failed in the encoder's position add
    ("max_source_positions", r"max_source_positions=30 is not supported: the front end makes 3000 mel frames"),
    # refused only as the components loaded, after the decoder's weights
    ("generation_config", r"checkpoint ckpt: generation_config.json is required"),
    ("preprocessor", r"checkpoint ckpt: .*sampling_rate"),
])
def test_a_whisper_checkpoint_the_components_would_refuse_is_refused_by_check(tmp_path, spoil, rule):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    family = get_family("whisper")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints), checkpoint)
    family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")
    if spoil == "max_source_positions":
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "max_source_positions": 30}))
        for file in checkpoint.glob("*.safetensors"):
            tensors = load_file(file)
            tensors = {k: v[:30].clone() if k.endswith("encoder.embed_positions.weight") else v
                       for k, v in tensors.items()}
            save_file(tensors, file, metadata={"format": "pt"})
    elif spoil == "generation_config":
        (checkpoint / "generation_config.json").unlink()
    else:
        (checkpoint / "preprocessor_config.json").write_text(json.dumps({"sampling_rate": 8000}))
    with pytest.raises((DeploymentError, ValueError), match=rule):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")


def test_a_z_image_caption_encoder_its_component_would_refuse_is_refused_by_check(tmp_path):
    """Its config was read only as the text encoder loaded: a scaled RoPE passed `mstar check`."""
    import json
    import shutil

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    family = get_family("z_image_turbo")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints), checkpoint)
    family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")
    path = checkpoint / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "yarn", "factor": 4.0}
    path.write_text(json.dumps(config))
    with pytest.raises(DeploymentError, match=r"^test.yaml: rope_parameters.rope_type='yarn' is not supported"):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")


def test_whisper_refuses_flashinfer_on_its_decoder():
    """FlashInfer's `attend` runs the wrapper planned from the decoder's self-attention step: the cross-attention
    over the audio read the cross pool at the self-attention's pages and lengths (wrong transcripts, no error)."""
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "whisper_large_v3_gpu.yaml").read_text())
    deployment_from_dict(copy.deepcopy(raw))
    raw["components"]["decoder"]["attention_backend"] = "flashinfer"
    with pytest.raises(DeploymentError, match=r"components.decoder.attention_backend: 'flashinfer' plans each step "
                                              r"for the decoder's self-attention"):
        deployment_from_dict(raw)


@pytest.mark.parametrize("family_name", ["flux2_klein", "z_image_turbo"])
@pytest.mark.parametrize("spoil, rule", [
    # parsed only as the denoise component loaded, after the DiT's weights
    ("use_karras_sigmas", r"use_karras_sigmas"),
    # diffusers builds the scheduler model_index.json names, whatever scheduler_config.json says: Euler ran
    ("model_index", r"model_index.json scheduler=\['diffusers', 'FlowMatchHeunDiscreteScheduler'\]"),
])
def test_an_image_checkpoints_scheduler_it_does_not_serve_is_refused_by_check(tmp_path, family_name, spoil, rule):
    import json
    import shutil

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / f"{family_name}.yaml").read_text())
    family = get_family(family_name)
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints), checkpoint)
    family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")
    path = checkpoint / ("scheduler/scheduler_config.json" if spoil == "use_karras_sigmas" else "model_index.json")
    config = json.loads(path.read_text())
    if spoil == "use_karras_sigmas":
        config["use_karras_sigmas"] = True
    else:
        config["scheduler"] = ["diffusers", "FlowMatchHeunDiscreteScheduler"]
    path.write_text(json.dumps(config))
    with pytest.raises(DeploymentError, match=rf"^test.yaml: .*{rule}"):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")


def test_a_z_image_vae_without_its_scaling_factor_is_refused():
    """A missing scaling_factor was read as the FLUX.1 VAE's 0.3611, where diffusers' AutoencoderKL takes 0.18215:
    every image decoded from latents divided by the wrong factor."""
    from mstar_common.families.z_image_turbo.vae import Flux1VaeConfig

    with pytest.raises(ValueError, match=r"vae scaling_factor is missing: the FLUX.1 VAE config has one \(0.3611\)"):
        Flux1VaeConfig.from_diffusers({"shift_factor": 0.1159})


@pytest.mark.parametrize("kwargs, key", [({"default_size": "1024x1024"}, "default_size"),
                                         ({"capture_sizes": ["1024x512"]}, "capture_sizes")])
def test_z_image_sizes_past_the_checkpoints_rope_range_are_refused_by_check(kwargs, key):
    """The denoise component holds every request to the DiT's RoPE tables (the tiny one's 512 px sides), but the
    deployment's own sizes were held to the grid and max_image_area only: past the range, every request without
    a size was a 400 naming `size`, which the client never sent, and a captured size never replayed."""
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "z_image_turbo.yaml").read_text())
    family = get_family("z_image_turbo")
    checkpoint = resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints)
    raw["model_kwargs"].update(kwargs, max_image_area=2048 * 2048)
    if key == "capture_sizes":
        raw["components"]["denoise"] = {**raw["components"].get("denoise", {}), "cuda_graphs": True,
                                        "placement": {"device": "gpu", "gpus": [0]}}
    with pytest.raises(DeploymentError, match=rf"^test.yaml: model_kwargs.{key}: 1024x\d+ exceeds this checkpoint's "
                                              r"RoPE range of 512x512"):
        family.check_checkpoint(deployment_from_dict(raw), checkpoint, "test.yaml")


@pytest.mark.parametrize("config", ["qwen3.yaml", "orpheus.yaml", "z_image_turbo.yaml", "flux2_klein.yaml"])
def test_an_upload_limit_on_a_family_that_takes_no_uploads_is_refused(config):
    """`limits.max_upload_s` is read by whisper's walk alone: elsewhere it was accepted and nothing enforced it."""
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / config).read_text())
    raw.setdefault("limits", {})["max_upload_s"] = 5
    with pytest.raises(DeploymentError, match=r"limits.max_upload_s: the \w+ family takes no audio or video uploads"):
        deployment_from_dict(raw)
    whisper = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    whisper.setdefault("limits", {})["max_upload_s"] = 5
    assert deployment_from_dict(whisper).limits.max_upload_s == 5


def test_whisper_refuses_capture_sampling_false_which_nothing_reads():
    """Whisper's decoder graphs stop at the logits for every step; `capture_sampling: false` was accepted and
    ignored, where docs/deployment.md says sampling steps then run eagerly."""
    from mstar_common.cli import CONFIGS

    raw = yaml.safe_load((CONFIGS / "whisper_large_v3_gpu.yaml").read_text())
    raw["components"]["decoder"]["capture_sampling"] = False
    with pytest.raises(DeploymentError, match=r"components.decoder.capture_sampling: the decoder's graphs stop at the "
                                              r"logits"):
        deployment_from_dict(raw)



def test_whisper_refuses_an_fp8_pool_its_decoders_head_dim_cannot_take(tmp_path):
    """The fp8 head-dim rule lived in the text families' check alone: whisper's builtin tiny checkpoint (head dim
    16) with an fp8 pool on the GPU passed `mstar check`, then its decoder's first step failed to compile."""
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.families.registry import get_family

    raw = yaml.safe_load((CONFIGS / "whisper.yaml").read_text())
    family = get_family("whisper")
    checkpoint = resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints)
    for name in ("encoder", "decoder"):
        raw["components"][name]["placement"] = {"device": "gpu", "gpus": [0]}
    raw["resources"]["kv_cache"]["dtype"] = "fp8_e4m3"
    with pytest.raises(DeploymentError, match=r"resources.kv_cache.dtype: fp8_e4m3 .* head_dim is 16"):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "test.yaml")
    raw["resources"]["kv_cache"]["dtype"] = "auto"
    family.check_checkpoint(deployment_from_dict(raw), checkpoint, "test.yaml")


def test_a_python_backend_folder_a_shell_would_split_is_refused_before_serving(tmp_path, monkeypatch):
    """Each stub is started as `bash -c "exec <backend folder>/triton_python_backend_stub ..."`: a venv or
    TRITONSERVER_HOME at a path with a space passed every check of `mstar serve`, and no stub ever started."""
    from mstar_common import cli
    from mstar_common.config import DeploymentError
    from mstar_common.triton_env import STUB

    for home, refused in ((tmp_path / "tri ton", True), (tmp_path / "triton", False), (tmp_path / "tést", False)):
        (home / "bin").mkdir(parents=True)
        (home / "bin" / "tritonserver").write_text("")
        (home / "backends" / "python").mkdir(parents=True)
        (home / "backends" / "python" / STUB).write_text("")
        monkeypatch.setenv("TRITONSERVER_HOME", str(home))
        if refused:
            with pytest.raises(DeploymentError, match=r"Python backend folder: .*tri ton.* holds ' '"):
                cli._check_stub_folder()
        else:
            cli._check_stub_folder()
