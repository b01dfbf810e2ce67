"""`mstar`: serve a deployment, generate its model repository, check it, build a tiny checkpoint."""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from mstar_common.config import DeploymentError, load_deployment

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = PROJECT_ROOT / "configs"
DEFAULT_DEPLOYMENT = CONFIGS / "qwen3.yaml"


def resolve_target(target: str) -> Path:
    """A deployment YAML path, or a family/deployment key naming configs/<key>.yaml."""
    path = Path(target)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return path
    candidate = CONFIGS / f"{target}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    raise DeploymentError(f"unknown model {target!r}: no configs/{target}.yaml; available: {known}")


def serve_target(target: str | None, config: str | None) -> Path:
    """The deployment `mstar serve` starts: `--config`'s file, else the target's (a key or a YAML); a key given
    with `--config` must be of the config's family."""
    if config is None:
        return resolve_target(target or str(DEFAULT_DEPLOYMENT))
    path = Path(config)
    if not path.is_file():
        raise DeploymentError(f"--config: {config} is not a file")
    if target is not None:
        keyed = load_deployment(resolve_target(target)).family
        if (family := load_deployment(path).family) != keyed:
            raise DeploymentError(f"--config: {config} deploys family {family!r}, and {target!r} is a {keyed!r} "
                                  f"deployment; name one of them")
    return path


def parse_gpus(value: str) -> list[int]:
    """`--gpus 0,1,2,3`: distinct GPU ids >= 0."""
    try:
        gpus = [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated GPU ids such as 0,1, got {value!r}") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) < len(gpus):
        raise argparse.ArgumentTypeError(f"must be distinct GPU ids >= 0, got {value!r}")
    return gpus


def place_on_gpus(dep, gpus: list[int], source: str):
    """The deployment with every GPU-placed component on `gpus` (instances per GPU unchanged), checked again as a
    whole (KV pools are per instance); components on the cpu (a walk router, a demo's model) stay there."""
    from mstar_common.config import deployment_from_dict

    raw = dep.to_dict()
    on_gpu = [name for name, comp in raw["components"].items() if comp["placement"]["device"] == "gpu"]
    if not on_gpu:
        gpu_configs = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.resolve() != Path(source).resolve()
                             and _gpu_deployment_of(p, dep.family))
        where = f"; its family's GPU deployments: {', '.join(f'configs/{n}' for n in gpu_configs)}" if gpu_configs \
            else ""
        raise DeploymentError(f"--gpus: {Path(source).name} places no component on a GPU (a cpu demo){where}")
    for name in on_gpu:
        raw["components"][name]["placement"]["gpus"] = list(gpus)
    return deployment_from_dict(raw, source=f"{Path(source).name} with --gpus {','.join(map(str, gpus))}")


def _gpu_deployment_of(path: Path, family: str) -> bool:
    try:
        dep = load_deployment(path)
    except DeploymentError:
        return False
    return dep.family == family and any(c.placement.device == "gpu" for c in dep.components.values())


def cmd_check(args: argparse.Namespace) -> int:
    from mstar_common.checkpoints import find_checkpoint
    from mstar_common.families.registry import get_family
    from mstar_common.memory_plan import plan_lines

    path = resolve_target(args.deployment)
    dep = load_deployment(path)
    family = get_family(dep.family)
    checkpoint = find_checkpoint(dep.checkpoint, family.builtin_checkpoints)
    if checkpoint is not None:  # what `mstar serve` checks against it too (e.g. max_model_len's position limit)
        check_against_checkpoint(family, dep, checkpoint, path.name)
    print(f"ok: {dep.name} (family {dep.family}, components {sorted(dep.components)})")
    for line in plan_lines(dep, family, checkpoint):
        print(f"  {line}")
    return 0


def cmd_gen_repo(args: argparse.Namespace) -> int:
    from mstar_common.repository import generate_repository

    dep = generate_repository(resolve_target(args.deployment), args.out)
    print(f"wrote {args.out} for {dep.name}")
    return 0


def cmd_build_checkpoint(args: argparse.Namespace) -> int:
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import family_names, get_family

    if args.family not in family_names():
        raise DeploymentError(f"unknown family {args.family!r}; available: {family_names()}")
    family = get_family(args.family)
    path = resolve_checkpoint(args.checkpoint, family.builtin_checkpoints)
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mstar_common import run_folders
    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.families.registry import get_family
    from mstar_common.launcher import Ports, port_in_use, release_ports, reserve_ports
    from mstar_common.memory_plan import shared_gpu_notes
    from mstar_common.switches import check_switches

    path = serve_target(args.target, args.config)
    dep = load_deployment(path)
    if args.gpus is not None:
        dep = place_on_gpus(dep, args.gpus, str(path))
    try:
        check_switches()  # a misspelt MSTAR_* switch: refused here, not after tritonserver has loaded the models
    except ValueError as exc:
        raise DeploymentError(str(exc)) from None
    family = get_family(dep.family)
    checkpoint = resolve_checkpoint(dep.checkpoint, family.builtin_checkpoints)
    check_against_checkpoint(family, dep, checkpoint, path.name)  # e.g. max_model_len against its position limit
    print(f"[mstar] deployment {dep.name} ({path}) is valid for its checkpoint {checkpoint}", flush=True)
    for note in shared_gpu_notes(dep, family):  # allowed, but slower than one instance: said before the load
        print(f"[mstar] {note}", flush=True)
    check_gpus_visible(dep, path.name)
    check_shm_size(dep, path.name)
    s = dep.server
    ports = Ports(
        http=s.http_port if args.http_port is None else args.http_port,
        grpc=s.grpc_port if args.grpc_port is None else args.grpc_port,
        metrics=s.metrics_port if args.metrics_port is None else args.metrics_port,
        proxy=s.proxy_port if args.port is None else args.port,
    )
    used = [ports.http, ports.grpc, ports.metrics] + ([] if args.no_proxy else [ports.proxy])
    if len(set(used)) < len(used):  # --no-proxy: the proxy's port is not used, so it may be one of Triton's
        proxy = "" if args.no_proxy else f", proxy {ports.proxy}"
        raise DeploymentError(f"the ports must differ: Triton HTTP {ports.http}, gRPC {ports.grpc}, metrics "
                              f"{ports.metrics}{proxy} (server.*_port and the --*port options)")
    # Another server on one of them would answer this one's readiness checks, and this one would report itself
    # serving while its own tritonserver or proxy had failed to bind.
    wanted = [("Triton HTTP", ports.http, "--http-port"), ("Triton gRPC", ports.grpc, "--grpc-port"),
              ("Triton metrics", ports.metrics, "--metrics-port")]
    if not args.no_proxy:
        wanted.append(("proxy", ports.proxy, "--port"))
    if busy := [f"{what} {port} ({flag})" for what, port, flag in wanted if port_in_use(port)]:
        raise DeploymentError(f"port(s) already in use: {', '.join(busy)}; stop what listens there or choose others")
    run_folders.usable_root()  # refused before anything is written there (the port locks live in it too)
    _check_stub_folder()
    if held := reserve_ports([port for _, port, _ in wanted]):  # a serve still loading has not bound them yet
        named = [f"{what} {port} ({flag}: {held[port]})" for what, port, flag in wanted if port in held]
        raise DeploymentError(f"port(s) taken by a server still starting: {', '.join(named)}; stop it or choose "
                              f"other ports")
    try:
        return _serve_on(args, path, dep, ports)
    finally:
        release_ports([port for _, port, _ in wanted])  # an in-process caller (a test) must not keep them


def _serve_on(args: argparse.Namespace, path: Path, dep, ports) -> int:
    """`mstar serve` once the deployment is checked and its ports reserved: the run folder, tritonserver, the
    proxy, supervision, and the stop."""
    from mstar_common import run_folders
    from mstar_common.launcher import StopRequested, connect_host, start_proxy, stop_process, wait_ready
    from mstar_common.repository import entry_model, generate_repository
    from mstar_common.supervisor import RESTART_WINDOW_S, RestartBudget, TritonSupervisor

    s = dep.server
    # after the refusals, so none leaves a folder; the name as far as a folder name can carry it
    run_dir = run_folders.make(run_folder_prefix(dep.name), s.keep_run_folders)
    repo = run_dir / "model_repository"
    generate_repository(path, repo, dep=dep)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    proxy = None
    triton = TritonSupervisor(repo, dep, ports, run_dir / "tritonserver.log", ready_timeout_s=args.timeout)
    try:
        print(f"[mstar] tritonserver starting (log: {run_dir / 'tritonserver.log'})", flush=True)
        try:
            triton.start(stop=stop)  # a stop while it loads ends the wait at once (a load can take minutes)
        except StopRequested:
            print("[mstar] stopped before tritonserver was ready", flush=True)
            return 0
        except (RuntimeError, TimeoutError) as exc:
            print(f"mstar: error: {exc}", file=sys.stderr)
            for line in load_errors(run_dir / "tritonserver.log"):
                print(f"  {line}", file=sys.stderr)
            print(f"  (the whole log: {run_dir / 'tritonserver.log'})", file=sys.stderr)
            return 1
        triton.watch()  # relaunches tritonserver when it or a stub dies, or gives up (docs/reliability.md)

        def launch_proxy(stop_event: threading.Event | None = None) -> subprocess.Popen:
            """Start the proxy and wait for it (at the address it binds); one that fails or is stopped first
            is stopped with its workers."""
            started = start_proxy(dep, entry_model(dep), ports, run_dir / "proxy.log", host=args.host)
            try:
                wait_ready(f"http://{connect_host(args.host)}:{ports.proxy}/health", started, args.timeout, "proxy",
                           stop=stop_event)
            except BaseException:
                stop_process(started, grace=5)
                raise
            return started

        try:
            # the supervisor already watches: one that gives up while the proxy starts ends the wait (the proxy's
            # /health would answer 503 until --timeout, which was then blamed on the proxy)
            proxy = None if args.no_proxy else launch_proxy(_RelaunchStop(stop, triton))
        except StopRequested:
            if triton.is_failed:
                print(f"[mstar] {triton.failure}; shutting down", file=sys.stderr)
                return 1
            print("[mstar] stopped before the proxy was ready", flush=True)
            return 0
        except (RuntimeError, TimeoutError) as exc:
            print(f"mstar: error: {exc}", file=sys.stderr)
            for line in tail_lines(run_dir / "proxy.log", 12):
                print(f"  {line}", file=sys.stderr)
            print(f"  (the whole log: {run_dir / 'proxy.log'})", file=sys.stderr)
            return 1
        _print_urls(dep, ports, args, run_dir)
        proxy_restarts = RestartBudget(s.max_restarts if s.restart_on_fault else 0)
        while not stop.is_set():
            if triton.is_failed:
                print(f"[mstar] {triton.failure}; shutting down", file=sys.stderr)
                return 1
            if proxy is not None and proxy.poll() is not None:
                code = proxy.returncode
                stop_process(proxy, grace=5)  # what its group left (its workers)
                if not proxy_restarts.take():
                    why = "server.restart_on_fault is off" if not s.restart_on_fault else \
                        f"{s.max_restarts} relaunches within {RESTART_WINDOW_S:.0f} s already (server.max_restarts)"
                    print(f"[mstar] the proxy exited with code {code}; {why}: shutting down", file=sys.stderr)
                    return 1
                print(f"[mstar] the proxy exited with code {code}; relaunching it (its streams ended with it)",
                      file=sys.stderr, flush=True)
                try:
                    proxy = launch_proxy(_RelaunchStop(stop, triton))
                except StopRequested:
                    proxy = None
                    if triton.is_failed:
                        print(f"[mstar] {triton.failure}; shutting down", file=sys.stderr)
                        return 1
                    break  # a Ctrl-C or SIGTERM during the relaunch: the stop below
                except (RuntimeError, TimeoutError) as exc:
                    print(f"[mstar] the proxy did not come back ({exc}); shutting down", file=sys.stderr)
                    return 1
                print("[mstar] the proxy serves again", flush=True)
            stop.wait(0.5)
        print("\n[mstar] draining in-flight requests, then shutting down", flush=True)
        return 0
    finally:
        # The proxy first: it takes no new work and its in-flight requests finish (drain_timeout_s) against a
        # Triton that still serves every component. Stopped together, Triton counted a walk's request (its BLS
        # hops between components) as nothing in flight and unloaded the components under it, so whisper, the
        # image families and orpheus's codec failed their last requests. Then Triton drains what came to it
        # directly.
        if proxy is not None and proxy.poll() is None:
            proxy.send_signal(signal.SIGTERM)
            try:
                proxy.wait(s.drain_timeout_s + 5)
            except subprocess.TimeoutExpired:
                pass
        triton.stop()
        stop_process(proxy, grace=5)
        print("[mstar] stopped", flush=True)


# optional packages -> (the extra that installs them, what needs them): a bare `pip install -e .` lacks them, and the
# builtin checkpoints of those families are built with them on first use
OPTIONAL_EXTRAS = {
    "diffusers": ("images", "the image families' builtin checkpoints (flux2_klein, z_image_turbo)"),
    "snac": ("orpheus", "orpheus's builtin checkpoints (the random SNAC)"),
    "matplotlib": ("bench", "the benchmark report's plots"),
}


class _RelaunchStop:
    """What a proxy's readiness wait (its first start and each relaunch) stops at: a Ctrl-C or SIGTERM (`stop`), or
    tritonserver given up on by its supervisor, after which the proxy's /health stays 503. It waited out --timeout
    (600 s) through both, serving nothing, and then blamed the proxy."""

    def __init__(self, stop: threading.Event, triton) -> None:
        self._stop, self._triton = stop, triton

    def is_set(self) -> bool:
        return self._stop.is_set() or self._triton.is_failed

    def wait(self, seconds: float) -> bool:
        return self._stop.wait(seconds) or self._triton.is_failed


def check_against_checkpoint(family, dep, checkpoint: Path, source: str) -> None:
    """The family's checks of `dep` against its checkpoint; a config it cannot read is a refusal naming the file
    (not a traceback)."""
    from mstar_common.memory_plan import check_cpu_pools_fit
    from mstar_common.safetensors_io import check_readable

    try:
        family.check_checkpoint(dep, checkpoint, source)
    except DeploymentError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # AttributeError: JSON not an object
        reason = f"{type(exc).__name__}: {exc}"
        raise DeploymentError(f"checkpoint {checkpoint}: cannot read its config ({reason})") from None
    weights = sorted(checkpoint.rglob("*.safetensors"))
    if not weights:
        raise DeploymentError(f"checkpoint {checkpoint}: no *.safetensors weights in it (the loaders read "
                              f"safetensors only)")
    try:
        check_readable(weights)  # each header: a Git LFS pointer or a cut download fails here, naming its file
    except ValueError as exc:
        raise DeploymentError(f"{source}: checkpoint {exc}") from None
    check_cpu_pools_fit(dep, family, checkpoint, source)


def check_shm_size(dep, source: str, shm: str = "/dev/shm") -> None:
    """Every stub's shared-memory region must fit in what /dev/shm has free: the Python backend allocates each
    stub's whole `server.shm_default_byte_size` when the stub starts (posix_fallocate), one stub per instance of
    each component, and a model whose region does not fit fails to load with an error that names no key (in a
    container whose /dev/shm is Docker's 64 MiB, three stubs of the 32 MiB image default)."""
    from mstar_common.supervisor import expected_stubs

    try:
        stats = os.statvfs(shm)
    except OSError:
        return  # no /dev/shm to measure; tritonserver says what it finds
    free = stats.f_frsize * stats.f_bavail
    size, stubs = dep.server.shm_default_byte_size, expected_stubs(dep)
    if size * stubs > free:
        raise DeploymentError(
            f"{source}: server.shm_default_byte_size: {stubs} stub(s) (one per component instance) x {size:,} bytes "
            f"= {size * stubs:,} bytes is more than {shm} has free ({free:,} bytes); lower it, or give {shm} more "
            f"room (a container: docker run --shm-size=1g or more)")


def check_gpus_visible(dep, source: str) -> None:
    """Every GPU a placement names must be visible here (torch's count, which honours CUDA_VISIBLE_DEVICES):
    refused before tritonserver starts, naming the placement."""
    wanted = {name: comp.placement.gpus for name, comp in dep.components.items() if comp.placement.device == "gpu"}
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count()
    for name, gpus in wanted.items():
        if missing := [g for g in gpus if g >= count]:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f"{count} GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            raise DeploymentError(f"{source}: components.{name}.placement.gpus: {missing} not visible on this "
                                  f"machine, which shows {shown}")


def tail_lines(log: Path, most: int) -> list[str]:
    """The last `most` non-empty lines of a log (none if it cannot be read)."""
    try:
        return [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.strip()][-most:]
    except OSError:
        return []


def load_errors(log: Path, most: int = 8) -> list[str]:
    """The error lines of a tritonserver log (a model that failed to load says why there), the last `most`."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    errors = [line.strip() for line in lines if (re.match(r"E\d{4} ", line) or "failed to load" in line)
              and "CudaDriverHelper has not been initialized" not in line]  # said by every CPU-only server
    return errors[-most:]


def run_folder_prefix(name: str) -> str:
    """`mstar-<name>-<hash>-`: the name as far as a folder name can carry it, and a hash of the whole name, so that
    names alike once cut or cleaned (`org/model`, `org_model`) never prune each other's run folders."""
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"mstar-{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:40]}-{digest}-"


def _print_urls(dep, ports, args, run_dir: Path) -> None:
    from mstar_common.launcher import connect_host
    from mstar_common.repository import entry_model

    host = connect_host(args.host)  # a wildcard's loopback; an IPv6 address in brackets
    host = "localhost" if host in ("127.0.0.1", "[::1]") else host
    lines = [
        f"[mstar] serving {dep.name}",
        f"  OpenAI API   http://{host}:{ports.proxy}/v1   (model: {dep.name})" if not args.no_proxy else "",
        f"  health       http://{host}:{ports.proxy}/health" if not args.no_proxy else "",
        f"  Triton gRPC  127.0.0.1:{ports.grpc}   (model: {entry_model(dep)})",
        f"  Triton HTTP  http://127.0.0.1:{ports.http}",
        f"  metrics      http://127.0.0.1:{ports.metrics}/metrics",
        f"  logs         {run_dir}",
        "  Ctrl-C stops both servers.",
    ]
    print("\n".join(line for line in lines if line), flush=True)


def _check_stub_folder() -> None:
    """The Python backend's own folder goes through the same unquoted shell as the repository (every stub is started
    as `bash -c "exec <its folder>/triton_python_backend_stub <model folder> ..."`): a venv or TRITONSERVER_HOME at a
    path with a space passed every check and no stub ever started."""
    from mstar_common.triton_env import find_triton, shell_unsafe

    try:
        install = find_triton()
    except FileNotFoundError:
        return  # no tritonserver: refused where it is started, with the install hint
    if reason := shell_unsafe(install.backend_dir / "python"):
        raise DeploymentError(f"tritonserver's Python backend folder: {reason}; install the project (its venv, or "
                              "TRITONSERVER_HOME) at a path without them")


def tcp_port_arg(value: str) -> int:
    """An argparse type: a TCP port in [1, 65535] (the deployment's `server.*_port` rule)."""
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {value!r}")
    return port


def bind_host_arg(value: str) -> str:
    """An argparse type: the proxy's bind address, an IP address (v4 or v6, or "" / "*" for every address) or a
    host name; anything else failed only after the load, at the first readiness check, with a traceback."""
    if value in ("", "*"):
        return value
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if len(value) > 253 or not all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label)
                                   for label in labels):
        raise argparse.ArgumentTypeError(f"must be an IP address or a host name, got {value!r}")
    return value


def _positive_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds > 0 (0, a negative or nan gave up on the server at once, after
    starting it)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {value!r}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mstar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="validate, generate the repository, start tritonserver + the proxy")
    p.add_argument("target", nargs="?", default=None,
                   help="deployment key (configs/<key>.yaml) or deployment YAML (default: the qwen3 demo)")
    p.add_argument("--config", default=None, help="deployment YAML to serve (a key given too must be its family's)")
    p.add_argument("--gpus", type=parse_gpus, default=None, metavar="0,1,...",
                   help="place every GPU component of the deployment on these GPUs (instances per GPU kept)")
    p.add_argument("--host", type=bind_host_arg, default="127.0.0.1", help="proxy bind address")
    p.add_argument("--port", type=tcp_port_arg, default=None, help="proxy port (default: server.proxy_port)")
    p.add_argument("--http-port", type=tcp_port_arg, default=None, help="Triton HTTP port (default: server.http_port)")
    p.add_argument("--grpc-port", type=tcp_port_arg, default=None, help="Triton gRPC port (default: server.grpc_port)")
    p.add_argument("--metrics-port", type=tcp_port_arg, default=None,
                   help="Triton metrics port (default: server.metrics_port)")
    p.add_argument("--no-proxy", action="store_true", help="start tritonserver only")
    p.add_argument("--timeout", type=_positive_seconds, default=600.0, help="seconds to wait for readiness")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("gen-repo", help="deployment YAML -> Triton model repository")
    p.add_argument("deployment")
    p.add_argument("--out", default="model_repository")
    p.set_defaults(func=cmd_gen_repo)
    p = sub.add_parser("check", help="validate a deployment")
    p.add_argument("deployment")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("build-checkpoint", help="build (or find) a builtin tiny checkpoint and print its path")
    p.add_argument("family")
    p.add_argument("checkpoint", help="e.g. builtin:qwen3-tiny")
    p.set_defaults(func=cmd_build_checkpoint)
    sub.add_parser("bench", add_help=False,
                   help="serving benchmark: sweeps against Triton and the proxy, HF baseline, reports "
                        "(`mstar bench --help`)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its own parser (mstar_common/bench/cli.py), arguments untouched
        from mstar_common.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (DeploymentError, FileNotFoundError) as exc:
        print(f"mstar: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (extra := OPTIONAL_EXTRAS.get((exc.name or "").split(".")[0])) is None:
            raise
        print(f"mstar: error: {exc.name} is not installed: {extra[1]} needs it (pip install "
              f"'mstar-triton[{extra[0]}]', or ./scripts/setup.sh, which installs every extra)", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mstar check ... | head -1`: the reader left; no traceback for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl-C before serve's own handlers (a checkpoint build, the imports): no traceback
        print("\n[mstar] stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
