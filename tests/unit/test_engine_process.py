"""The engine in a process of its own (mstar_common/engine/engine_process.py), driven as the Triton node drives it,
on the tiny Qwen3 on the CPU: the same tokens as the engine in this process, refusals raised at once in the caller,
cancellation, shutdown, a killed engine process, a build that fails, and no engine process left behind by a
caller that dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from mstar_common.checkpoints import resolve_checkpoint
from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.engine import engine_process
from mstar_common.engine.admission import EngineOverloaded, EngineUnavailable
from mstar_common.engine.types import AdmissionError, FinishReason, SamplingParams
from mstar_common.families.registry import get_family
from mstar_common.supervisor import is_running

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello there", "The quick brown fox", "a", "Continuous batching mixes prefill chunks with decodes."]


class Streams:
    """An `on_output` callback that records each request's tokens and its one final call."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, tuple[FinishReason, str | None]] = {}
        self.late: list[str] = []  # calls after a request's final (must stay empty)
        self._cond = threading.Condition()

    def __call__(self, request_id, token_ids, finish, error) -> None:
        with self._cond:
            if request_id in self.finals:
                self.late.append(request_id)
            self.tokens.setdefault(request_id, []).extend(token_ids)
            if finish is not None:
                self.finals[request_id] = (finish, error)
            self._cond.notify_all()

    def wait(self, request_ids, timeout: float = 60.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: all(r in self.finals for r in request_ids), timeout), self.finals

    def wait_tokens(self, request_id: str, count: int = 1, timeout: float = 60.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.tokens.get(request_id, [])) >= count, timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The default deployment (qwen3-tiny, CPU) with room for 2 running and 1 queued request."""
    cache = tmp_path_factory.mktemp("engine-process-cache")
    previous = os.environ.get("MSTAR_CACHE_DIR")
    os.environ["MSTAR_CACHE_DIR"] = str(cache)
    raw = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())
    raw["max_concurrent_requests"] = 2
    raw.setdefault("admission", {})["max_queue"] = 1
    dep = deployment_from_dict(raw, source="test-engine-process")
    family = get_family(dep.family)
    checkpoint = resolve_checkpoint(dep.checkpoint, family.builtin_checkpoints)
    spec = engine_process.EngineSpec("qwen3_llm", dep.family, "llm", dep, checkpoint, "cpu")
    yield family, dep, spec
    if previous is None:
        os.environ.pop("MSTAR_CACHE_DIR", None)
    else:
        os.environ["MSTAR_CACHE_DIR"] = previous


@pytest.fixture
def remote(setup):
    runtime = engine_process.start_engine_process(setup[2], ready_timeout_s=120)
    yield runtime
    runtime.engine.shutdown()


def _ids(runtime, text: str) -> list[int]:
    return runtime.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_tokens_equal_the_engine_in_this_process(setup, remote):
    family, dep, spec = setup
    engine = remote.engine
    assert engine.pid != os.getpid() and is_running(engine.pid)
    local = family.build_component("llm", dep, spec.checkpoint, "cpu")
    local.engine.start()
    try:
        got, want = Streams(), Streams()
        params = SamplingParams(max_tokens=12, temperature=0.0)
        for i, prompt in enumerate(PROMPTS[:2]):  # the deployment's two running requests, batched in each engine
            engine.add_request(f"r{i}", _ids(remote, prompt), replace(params), got)
            local.engine.add_request(f"r{i}", _ids(local, prompt), replace(params), want)
        got.wait(["r0", "r1"])
        want.wait(["r0", "r1"])
    finally:
        local.engine.shutdown()
    assert got.tokens == want.tokens and all(len(t) == 12 for t in got.tokens.values())
    assert got.finals == want.finals == {"r0": (FinishReason.LENGTH, None), "r1": (FinishReason.LENGTH, None)}
    assert not got.late
    assert engine.num_live == 0


def test_refusals_are_raised_in_the_caller_at_once(remote):
    engine, streams = remote.engine, Streams()
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompt_ids must be token ids in \[0, 447\], got 9999"):
        engine.add_request("bad", [1, 9999], SamplingParams(max_tokens=4), streams)
    with pytest.raises(AdmissionError, match=r"max_tokens \(600\) plus the prompt's 2 tokens must be <= max_model_len"):
        engine.add_request("big", [1, 2], SamplingParams(max_tokens=600), streams)
    for i in range(3):  # 2 running + 1 queued fill the component
        engine.add_request(f"hold{i}", [1, 2, 3], replace(long), streams)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hold0", [1, 2, 3], replace(long), streams)
    with pytest.raises(EngineOverloaded, match="its cap of 2 running and 1 queued"):
        engine.add_request("one-more", [1, 2, 3], replace(long), streams)
    assert engine.stats()["num_refused"] == 1
    for i in range(3):
        engine.cancel(f"hold{i}")
    streams.wait([f"hold{i}" for i in range(3)])
    assert {streams.finals[f"hold{i}"][0] for i in range(3)} == {FinishReason.CANCELLED}
    assert "bad" not in streams.tokens and "big" not in streams.tokens and "one-more" not in streams.tokens
    # what the cancels freed takes new requests again
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0), streams)
    streams.wait(["after"])
    assert streams.finals["after"] == (FinishReason.LENGTH, None) and len(streams.tokens["after"]) == 3


def test_shutdown_cancels_what_is_live_and_the_process_exits(remote):
    engine, streams = remote.engine, Streams()
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True), streams)
    streams.wait_tokens("long")
    engine.shutdown()
    assert streams.finals["long"] == (FinishReason.CANCELLED, None)
    assert engine._process.returncode == 0 and not is_running(engine.pid)
    with pytest.raises(EngineUnavailable, match="shut down"):
        engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=3), streams)
    engine.shutdown()  # twice is harmless
    assert not streams.late


def test_a_killed_engine_process_fails_its_requests_refuses_new_ones_and_tells_the_stub(setup):
    """`on_exit` (the Triton node ends its stub there, so that the supervisor relaunches the server) is called
    once the live requests have been ended; a stopped engine does not call it."""
    exits: list[tuple[str, dict]] = []
    streams = Streams()
    runtime = engine_process.start_engine_process(setup[2], ready_timeout_s=120,
                                                  on_exit=lambda why: exits.append((why, dict(streams.finals))))
    engine = runtime.engine
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True), streams)
    streams.wait_tokens("long")
    os.kill(engine.pid, signal.SIGKILL)
    streams.wait(["long"])
    reason, error = streams.finals["long"]
    assert reason is FinishReason.ERROR and "engine process exited (code -9)" in error
    with pytest.raises(EngineUnavailable, match="engine process has stopped"):
        engine.add_request("next", [1, 2, 3], SamplingParams(max_tokens=3), streams)
    assert engine.num_live == 0
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(why, sorted(ended)) for why, ended in exits] == [("exit code -9", ["long"])]
    engine.shutdown()

    stopped = []
    runtime = engine_process.start_engine_process(setup[2], ready_timeout_s=120, on_exit=stopped.append)
    runtime.engine.shutdown()
    assert stopped == []


def test_a_build_that_fails_raises_with_the_engine_process_traceback(setup, tmp_path):
    spec = replace(setup[2], checkpoint=tmp_path / "no-such-checkpoint")
    with pytest.raises(RuntimeError, match="failed to build the component") as info:
        engine_process.start_engine_process(spec, ready_timeout_s=120)
    assert "no-such-checkpoint" in str(info.value)


def test_the_engine_process_exits_when_its_caller_dies(setup, tmp_path):
    """A stub killed outright (no shutdown) must not leave an engine process holding the device."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import pickle, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from mstar_common.engine import engine_process
        spec = pickle.loads(bytes.fromhex(sys.argv[1]))
        runtime = engine_process.start_engine_process(spec, ready_timeout_s=120)
        print(runtime.engine.pid, flush=True)
        time.sleep(600)
    """))
    import pickle

    caller = subprocess.Popen([sys.executable, str(script), pickle.dumps(setup[2]).hex()], stdout=subprocess.PIPE,
                              text=True)
    assert _gone_after_killing(caller, within_s=30), "the engine process outlived its caller"


def _gone_after_killing(caller: subprocess.Popen, within_s: float) -> bool:
    """Kill `caller` once it has printed its child's pid (running then); whether the child is gone `within_s`."""
    try:
        child = int(caller.stdout.readline())
        assert is_running(child)
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + within_s
    while is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_running(child)


def test_which_components_may_run_their_engine_in_a_process_of_their_own():
    """Token ids and sampling parameters in: qwen3, llama, orpheus's LM. Whisper's decoder (its requests carry the
    audio's encoder state) and orpheus with the codec in the LM's stub keep the engine in the stub."""
    def refusal(config: str, component: str, **model_kwargs):
        raw = yaml.safe_load((ROOT / "configs" / config).read_text())
        raw.setdefault("model_kwargs", {}).update(model_kwargs)
        dep = deployment_from_dict(raw, source=config)
        return get_family(dep.family).engine_process_refusal(component, dep)

    assert refusal("qwen3.yaml", "llm") is None
    assert refusal("orpheus.yaml", "lm") is None
    assert "codec_in_process" in refusal("orpheus.yaml", "lm", codec_in_process=True)
    assert "whisper" in refusal("whisper.yaml", "decoder")
    assert get_family("llama").engine_process_refusal("llm", None) is None


def test_the_engine_process_exits_when_its_caller_dies_during_the_build(tmp_path):
    """Nothing reads the socket while the engine builds (weights, tuning, captures: minutes on a GPU), so a stub
    killed then left the engine process building, and holding the device, until the build ended."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import os, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from mstar_common.engine import engine_process
        engine_process.watch_parent(os.getppid(), threading.Event(), interval_s=0.05)
        print(os.getpid(), flush=True)
        time.sleep(60)  # a build that would outlast the test
    """))
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, {str(child)!r}], stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert _gone_after_killing(caller, within_s=10), "the building engine process outlived its caller"


def test_an_engine_process_whose_stub_died_while_it_started_exits_at_once():
    """The child asked for its parent only once its imports were done (torch: seconds): a stub that died before
    then left it another parent, which it then watched, and it built the whole engine for nobody. It now takes the
    stub's pid from its command line and exits if its parent is not that one."""
    ours, theirs = socket.socketpair()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    child = subprocess.Popen([sys.executable, "-m", "mstar_common.engine.engine_process", str(theirs.fileno()),
                              str(dead.pid)], pass_fds=[theirs.fileno()], cwd=ROOT, stderr=subprocess.PIPE,
                             text=True)
    theirs.close()
    try:
        assert child.wait(60) == 1  # without the check it waited in recv() for a spec, its parent alive
        assert f"the stub (pid {dead.pid}) is gone before the engine was built" in child.stderr.read()
    finally:
        child.kill()
        ours.close()


def test_the_message_that_ends_a_request_carries_the_engines_stats():
    """The engine sent its stats every STATS_S only: a level's last steps reached the stub's metrics up to 0.1 s after
    its last final, so a reader that saw that final and then two samples could read the level without them. The
    message that carries a final (or an error) now carries the stats taken after it."""
    sent = []

    class Conn:
        def send(self, message):
            sent.append(message)

    class Engine:
        num_steps = 0

        def stats(self):
            return {"num_steps": self.num_steps}

    engine = Engine()
    outbox = engine_process._Outbox(Conn(), engine)
    try:
        outbox.on_output("a", [1], None, None)  # the first message carries stats (due at once)
        deadline = time.monotonic() + 5
        while not sent and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.num_steps = 7  # a step within STATS_S of the last stats: a token, then the request's final
        outbox.on_output("a", [2], None, None)
        outbox.on_output("a", [3], FinishReason.LENGTH, None)
        while sum(len(m[1]) for m in sent if m[0] == "out") < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        outbox.close()
    final = next(m for m in sent if m[0] == "out" and any(out[2] is not None for out in m[1]))
    assert final[2] == {"num_steps": 7}
