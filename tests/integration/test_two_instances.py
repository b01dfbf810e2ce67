"""The default deployment (tiny Qwen3) with its LLM served by two Triton instances, each with its own engine, KV pool
and prefix cache: greedy tokens, sent 8 at once through Triton and through the proxy, equal transformers `generate`
(what one instance serves, tests/integration/test_triton_qwen3.py), and both instances took requests (the
component series carry an `instance` label, docs/metrics.md)."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request

import openai
import pytest
import yaml

from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from tests.integration.conftest import serve_deployment
from tests.integration.test_triton_qwen3 import MAX_TOKENS, PROMPTS, transformers_greedy
from tests.integration.triton_stream import run_stream

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw["components"]["llm"]["placement"]["instances"] = 2
    dep = deployment_from_dict(raw, source="two-instances")
    with serve_deployment(dep, tmp_path_factory.mktemp("two-instances"), "two-instances") as served:
        yield served


def _steps_by_instance(served) -> dict[str, float]:
    text = urllib.request.urlopen(served.metrics_url, timeout=5).read().decode()
    pattern = r'^mstar_engine_steps_total\{[^}]*instance="([^"]+)"[^}]*\} (\S+)$'
    return {instance: float(value) for instance, value in re.findall(pattern, text, re.M)}


def test_two_instances_give_transformers_greedy_tokens_and_share_the_requests(two):
    tokenizer, want = transformers_greedy(two.checkpoint)
    requests = {f"r{i}": {"input_ids": want[p][0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
                for i, p in enumerate(PROMPTS)}
    got = run_stream(two.grpc_url, two.entry, requests)
    for i, prompt in enumerate(PROMPTS):
        assert got[f"r{i}"].error is None and got[f"r{i}"].token_ids == want[prompt][1], prompt

    client = openai.OpenAI(base_url=two.proxy_url + "/v1", api_key="none", max_retries=0, timeout=60)

    def completion(prompt: str) -> str:
        return client.completions.create(model=two.dep.name, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0.0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(completion, PROMPTS))
    assert texts == [tokenizer.decode(want[p][1], skip_special_tokens=True) for p in PROMPTS]

    deadline = time.monotonic() + 10  # sampled every 0.1 s (later on a loaded machine); 16 requests alternate
    while not (len(steps := _steps_by_instance(two)) == 2 and all(v > 0 for v in steps.values())):
        assert time.monotonic() < deadline, steps
        time.sleep(0.1)
    assert sorted(steps) == ["qwen3_llm_0_0", "qwen3_llm_0_1"], steps

    log = (two.log_dir / "tritonserver.log").read_text(errors="replace")  # each stub's lines name its instance
    assert all(f"INFO [{name}] " in log for name in steps), "the server log does not name both instances"
