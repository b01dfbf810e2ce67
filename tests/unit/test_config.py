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
    _refused(_with(components__llm={"placement": {"device": "cpu", "instances": 0}}), "instances: must be >= 1")


def test_pool_too_small_for_the_cap_is_refused():
    _refused(
        _with(resources__kv_cache={"num_pages": 100, "page_size": 16}),
        "resources.kv_cache.num_pages",
        "max_concurrent_requests=16",
        "need >= 512",
    )


def test_model_kwargs_are_checked_by_the_family():
    _refused(_with(model_kwargs={"dtype": "float8"}), "model_kwargs.dtype")
    _refused(_with(model_kwargs={"temperatur": 1}), "model_kwargs: unknown key(s) ['temperatur']")


def test_prefill_buckets_beyond_the_step_budget_are_refused():
    raw = _with(resources__max_batch_tokens=1024, components__llm={"prefill_token_buckets": [512, 1024, 4096]})
    _refused(raw, "components.llm.prefill_token_buckets: [4096] exceed resources.max_batch_tokens (1024)")
    ok = _with(resources__max_batch_tokens=1024, components__llm={"prefill_token_buckets": [512, 1024]})
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
    ({"admission__queue_timeout_s": 0}, ("admission.queue_timeout_s", "> 0")),
    ({"admission__request_timeout_s": "soon"}, ("admission.request_timeout_s", "number")),
    ({"admission__retry_after_s": 0}, ("admission.retry_after_s", ">= 1")),
    ({"admission__queue": 3}, ("admission", "unknown key(s) ['queue']")),
    ({"limits__max_body_bytes": 0}, ("limits.max_body_bytes", ">= 1")),
    ({"limits__max_upload_s": -1}, ("limits.max_upload_s", "> 0")),
    ({"server__shm_default_byte_size": 1000}, ("server.shm_default_byte_size", "1 MiB")),
    ({"server__stub_timeout_seconds": 0}, ("server.stub_timeout_seconds", ">= 1")),
    ({"server__max_restarts": -1}, ("server.max_restarts", ">= 0")),
    ({"server__proxy_workers": 0}, ("server.proxy_workers", "[1, 64]")),
    ({"server__proxy_workers": 65}, ("server.proxy_workers", "[1, 64]")),
])
def test_admission_limits_and_server_refusals_name_the_key(changes, fragments):
    _refused(_with(**changes), *fragments)
