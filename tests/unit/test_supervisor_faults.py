"""What the supervisor counts as a fault and what it does then, and the launcher's hold on its children: a stub
missing after a relaunch is a fault (it went unseen), a fault with restart_on_fault off or past max_restarts stops
the server with the reason, children end with a `mstar serve` that is killed outright, and a stopped group loses
the members its leader left behind. From a QA pass over the server lifecycle."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from mstar_common import supervisor as sup
from mstar_common.cli import DEFAULT_DEPLOYMENT
from mstar_common.config import deployment_from_dict
from mstar_common.launcher import Ports, ends_with_parent, stop_process

BASE = yaml.safe_load(DEFAULT_DEPLOYMENT.read_text())


def _dep(**server):
    raw = copy.deepcopy(BASE)
    raw["server"] = {**raw.get("server", {}), **server}
    return deployment_from_dict(raw, source="t")


def test_the_expected_stubs_are_one_per_instance_per_gpu():
    raw = copy.deepcopy(BASE)
    raw["components"]["llm"]["placement"] = {"device": "gpu", "gpus": [0, 1], "instances": 2}
    assert sup.expected_stubs(deployment_from_dict(raw, source="t")) == 4
    raw = yaml.safe_load((DEFAULT_DEPLOYMENT.parent / "whisper.yaml").read_text())
    assert sup.expected_stubs(deployment_from_dict(raw, source="t")) == 3  # walk, encoder, decoder


class _Running:
    pid, returncode = 4242, None

    def poll(self):
        return None


def _supervisor(monkeypatch, dep, alive: dict):
    watcher = sup.TritonSupervisor(None, dep, Ports(1, 2, 3, 4), None)
    watcher.proc = _Running()
    monkeypatch.setattr(sup, "find_stubs", lambda _pid: alive)
    calls = []
    monkeypatch.setattr(watcher, "_kill", lambda sig, grace: calls.append("kill"))
    monkeypatch.setattr(watcher, "_launch", lambda: calls.append("launch"))
    return watcher, calls


def test_a_stub_missing_from_the_list_taken_at_ready_is_a_fault(monkeypatch):
    watcher, calls = _supervisor(monkeypatch, _dep(), alive={})
    watcher.stubs = {}  # the list was taken after the stub had died: nothing in it to miss
    assert watcher.check() and calls == ["kill", "launch"] and watcher.num_restarts == 1
    watcher, calls = _supervisor(monkeypatch, _dep(), alive={7: sup.Stub(7, "qwen3_llm")})
    watcher.stubs = {}
    assert not watcher.check() and watcher.stubs == {7: sup.Stub(7, "qwen3_llm")}  # watched from now on


def test_a_fault_with_restart_off_stops_the_server_with_the_reason(monkeypatch):
    watcher, calls = _supervisor(monkeypatch, _dep(restart_on_fault=False), alive={})
    watcher.stubs = {7: sup.Stub(7, "qwen3_llm")}
    assert watcher.check() and calls == ["kill"] and watcher.is_failed
    assert "Python stub(s) died: qwen3_llm (pid 7)" in watcher.failure
    assert "server.restart_on_fault is off" in watcher.failure


def test_past_max_restarts_it_gives_up_without_saying_it_relaunches(monkeypatch, caplog):
    watcher, calls = _supervisor(monkeypatch, _dep(max_restarts=0), alive={})
    watcher.stubs = {7: sup.Stub(7, "qwen3_llm")}
    assert watcher.check() and calls == ["kill"] and watcher.is_failed
    assert "a crash loop" in watcher.failure and "relaunching" not in caplog.text


def test_a_child_ends_with_the_process_that_started_it():
    starter = ("import os, subprocess, sys, time; from mstar_common.launcher import ends_with_parent; "
               "child = subprocess.Popen(['sleep', '60'], start_new_session=True, "
               "preexec_fn=ends_with_parent(os.getpid())); print(child.pid, flush=True); time.sleep(60)")
    middle = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    assert sup.is_running(child)
    middle.kill()  # SIGKILL: no handler of its own could stop the child
    middle.wait()
    deadline = time.monotonic() + 10
    while sup.is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sup.is_running(child)


def test_a_child_that_ignores_the_parent_death_signal_is_killed_with_its_group_after_the_grace():
    """tritonserver logged SIGTERM four times and served on after its `mstar serve` was killed (CI, 2026-12-06):
    the launcher's watcher SIGKILLs the server's process group (its stubs with it) once the grace is past."""
    deaf = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "subprocess.Popen(['sleep', '60']); time.sleep(60)"
    starter = ("import os, subprocess, sys, time; from mstar_common.launcher import ends_with_parent; "
               "from mstar_common.orphan_watch import kill_group_when_orphaned; "
               f"child = subprocess.Popen([sys.executable, '-c', {deaf!r}], start_new_session=True, "
               "preexec_fn=ends_with_parent(os.getpid())); kill_group_when_orphaned(child.pid, 1); "
               "print(child.pid, flush=True); time.sleep(60)")
    middle = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    time.sleep(1)  # the deaf child has set its handler and started its own child
    middle.kill()
    middle.wait()
    time.sleep(0.5)
    assert sup.is_running(child)  # it ignored the parent-death SIGTERM: only the watcher ends it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)  # the whole group: the child and the process it started


def test_the_group_watcher_leaves_with_a_child_that_ends_normally():
    from mstar_common.orphan_watch import kill_group_when_orphaned

    child = subprocess.Popen(["sleep", "0.5"], start_new_session=True)
    watcher = kill_group_when_orphaned(child.pid, 30)
    assert child.wait(10) == 0
    assert watcher.wait(10) == 0  # it saw its child end (reaped here): nothing left to watch, nothing signalled


def test_a_child_whose_parent_died_before_it_armed_the_signal_exits():
    arm = ends_with_parent(os.getpid() + 10**6)  # a "parent" other than the real one
    child = subprocess.Popen(["sleep", "60"], preexec_fn=arm)
    assert child.wait(10) == 1


def test_stopping_a_group_whose_leader_exited_ends_the_members_it_left():
    group = subprocess.Popen(["sh", "-c", "sleep 60 & exit 0"], start_new_session=True)
    group.wait(10)
    os.killpg(group.pid, 0)  # the background sleep still holds the group
    stop_process(group, grace=5)
    with pytest.raises(ProcessLookupError):
        os.killpg(group.pid, 0)


def test_stop_process_lets_a_leader_exit_on_sigterm():
    leader = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    started = time.monotonic()
    stop_process(leader, grace=5)
    assert leader.returncode == -signal.SIGTERM and time.monotonic() - started < 5


def test_free_ports_are_distinct_even_where_the_kernel_hands_a_closed_port_out_again(monkeypatch):
    """A kernel may give the port of a socket just closed to the next bind (CI once started tritonserver with one port
    for HTTP and gRPC). Here every bind gets the lowest port no open socket holds: only ports picked while all the
    sockets stay bound come out distinct."""
    from mstar_common import launcher

    held: set[int] = set()

    class ReusingSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            held.discard(self.port)

        def bind(self, address):
            self.port = min(set(range(40000, 40100)) - held)
            held.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launcher.socket, "socket", ReusingSocket)
    assert sorted(launcher.free_ports(4)) == [40000, 40001, 40002, 40003]
    ports = Ports.free()
    assert len({ports.http, ports.grpc, ports.metrics, ports.proxy}) == 4
    assert not held


def test_a_relaunch_that_does_not_come_up_stops_the_server(monkeypatch):
    """A relaunched server that never got ready was retried on the next pass, each try taking the whole start
    timeout: with the defaults (600 s, 5 relaunches within 600 s) the budget never ran out, and the server was
    relaunched every 10 minutes for ever, serving nothing."""
    watcher, calls = _supervisor(monkeypatch, _dep(), alive={})
    watcher.stubs = {7: sup.Stub(7, "qwen3_llm")}

    def never_ready():
        calls.append("launch")
        raise TimeoutError("tritonserver not ready at http://127.0.0.1:2/v2/health/ready after 600 s")

    monkeypatch.setattr(watcher, "_launch", never_ready)
    assert watcher.check() and watcher.is_failed and calls == ["kill", "launch", "kill"]
    assert "Python stub(s) died: qwen3_llm (pid 7)" in watcher.failure
    assert "the relaunched tritonserver did not come up: tritonserver not ready" in watcher.failure
    assert not watcher.check()  # given up: nothing more is launched


def test_a_start_waits_until_a_stop_and_readiness_is_asked_where_the_proxy_binds():
    import threading

    from mstar_common.launcher import StopRequested, connect_host, wait_ready

    stop = threading.Event()
    stop.set()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = time.monotonic()
        with pytest.raises(StopRequested, match="stopped while tritonserver was starting"):
            wait_ready("http://127.0.0.1:9/", sleeper, 30, "tritonserver", stop=stop)
        assert time.monotonic() - started < 2
    finally:
        sleeper.kill()
        sleeper.wait(5)
    # a proxy bound to one address answers there (its health was asked at 127.0.0.1: a whole --timeout, then an
    # error); a wildcard at the loopback
    assert [connect_host(h) for h in ("0.0.0.0", "::", "10.1.2.3", "fe80::1", "127.0.0.1")] == [
        "127.0.0.1", "[::1]", "10.1.2.3", "[fe80::1]", "127.0.0.1"]


def test_a_port_another_serve_reserved_is_refused_until_that_serve_ends(tmp_path):
    """tritonserver binds its ports only after loading its models, so a second `mstar serve` on the same ports,
    started meanwhile, passed the port check, loaded everything again, and took the first one's readiness answer
    for its own. Each serve now holds a file lock per port for its life."""
    from mstar_common import launcher

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from mstar_common.launcher import reserve_ports; "
        f"assert reserve_ports([40001, 40002], Path({str(tmp_path)!r})) == {{}}; print('held', flush=True); "
        "time.sleep(60)")], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "held"
        assert launcher.reserve_ports([40003, 40002], tmp_path) == {40002: f"mstar serve pid {holder.pid}"}
        assert 40003 not in launcher._HELD_PORT_LOCKS  # all or nothing: the free one was let go again
    finally:
        holder.kill()
        holder.wait(5)
    assert launcher.reserve_ports([40003, 40002], tmp_path) == {}  # the kernel dropped the dead holder's locks
    assert {40002, 40003} <= set(launcher._HELD_PORT_LOCKS)
    launcher.release_ports([40002, 40003])
    # released: their files go too; the killed holder's other one stays, unlocked, for the next serve to take
    assert [p.name for p in tmp_path.glob("*.lock")] == ["40001.lock"]
    assert launcher.reserve_ports([40001], tmp_path) == {}
    launcher.release_ports([40001])


def test_the_captures_progress_reaches_the_console_while_the_start_is_awaited(tmp_path):
    """tritonserver's output goes to the run folder's log, so `mstar serve` showed nothing of a start that captured
    CUDA graphs for minutes, though the docs promise their progress on the console. The lines written since the
    launch that carry the marker are echoed, each once, the last ones too when the server turns ready."""
    import io

    from mstar_common.launcher import LogEcho, free_ports, wait_ready

    log = tmp_path / "tritonserver.log"
    log.write_text("I1207 model.py] [cuda graphs] 9/9 decode 1 captured (a launch before this one)\n")
    echo_out = io.StringIO()
    progress = LogEcho(log, out=echo_out)
    (port,) = free_ports(1)
    script = f"""
import http.server, time
log = open({str(log)!r}, "a")
for i in range(1, 4):
    log.write(f"I1207 model.py:61] [cuda graphs] {{i}}/3 decode {{i}} captured in 0.10 s\\n")
    log.write("I1207 unrelated line\\n"); log.flush(); time.sleep(0.3)
log.write("I1207 model.py] [cuda graphs] 3 of 3 graphs captured in 0.9 s"); log.flush()  # no newline yet
time.sleep(0.3); log.write("\\n"); log.flush()
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", {port}), Ready).serve_forever()
"""
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_ready(f"http://127.0.0.1:{port}/", server, 30, "tritonserver", progress=progress)
    finally:
        server.kill()
        server.wait(5)
    assert echo_out.getvalue().splitlines() == [
        "[mstar] [cuda graphs] 1/3 decode 1 captured in 0.10 s",
        "[mstar] [cuda graphs] 2/3 decode 2 captured in 0.10 s",
        "[mstar] [cuda graphs] 3/3 decode 3 captured in 0.10 s",
        "[mstar] [cuda graphs] 3 of 3 graphs captured in 0.9 s"]


def test_readiness_is_asked_directly_whatever_http_proxy_says(monkeypatch):
    """urllib sends even a loopback request through the environment's http_proxy on Linux: on a host with one set,
    `mstar serve` never saw its servers ready and gave up after --timeout."""
    from mstar_common.launcher import wait_ready
    from tests.unit.local_http import answering, behind_unreachable_proxy

    behind_unreachable_proxy(monkeypatch)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with answering() as url:
            wait_ready(f"{url}/", sleeper, 5, "tritonserver")
    finally:
        sleeper.kill()
        sleeper.wait(5)


def test_a_port_lock_never_writes_through_a_symlink_nor_chmods_a_linked_folder(tmp_path):
    """The lock folder is shared in $TMPDIR: another user's `8000.lock -> ~/.bashrc` there made a serve truncate the
    file it named and write its pid into it, and a folder that was itself a link to a private one was made 1777."""
    import stat as stat_module

    from mstar_common import launcher

    victim = tmp_path / "victim"
    victim.write_text("keep")
    locks = tmp_path / "locks"
    locks.mkdir()
    (locks / "40010.lock").symlink_to(victim)
    assert launcher.reserve_ports([40010], locks) == {}
    launcher.release_ports([40010])
    assert victim.read_text() == "keep" and (locks / "40010.lock").is_symlink()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(private)
    assert launcher.reserve_ports([40011], tmp_path / "linked") == {}
    launcher.release_ports([40011])
    assert stat_module.S_IMODE(private.stat().st_mode) == 0o700 and not list(private.iterdir())
    assert launcher.reserve_ports([40012], locks) == {}  # a real folder of this user's still locks
    assert (locks / "40012.lock").read_text() == str(os.getpid())
    launcher.release_ports([40012])


def test_another_users_loading_serve_is_seen_without_its_lock_file_being_written(tmp_path, monkeypatch):
    """The lock folder is shared by every user's serves: another user's lock file is asked (read only), so a serve
    of theirs still loading is seen; since the symlink fix, root skipped such a file and loaded a second server.
    (This process plays the other user: its uid as the launcher sees it is not the lock file's owner's.)"""
    from mstar_common import launcher

    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from mstar_common.launcher import reserve_ports; "
        f"assert reserve_ports([41011], Path({str(tmp_path)!r})) == {{}}; print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (tmp_path / "41011.lock").read_text()
        monkeypatch.setattr(launcher.os, "geteuid", lambda: os.getuid() + 4242)
        assert launcher.reserve_ports([41011], tmp_path) == {41011: f"mstar serve pid {holder.pid}"}
        assert (tmp_path / "41011.lock").read_text() == before
    finally:
        holder.kill()
        holder.wait(5)
    assert launcher.reserve_ports([41011], tmp_path) == {}  # no holder left: another user's file is left unchecked
    assert 41011 not in launcher._HELD_PORT_LOCKS and (tmp_path / "41011.lock").read_text() == before
