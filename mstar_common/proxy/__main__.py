"""python -m mstar_common.proxy --triton-url 127.0.0.1:8001 --port 8000 --model qwen3=qwen3_llm"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import math
import os
import re
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI
from uvicorn.supervisors import Multiprocess

from mstar_common.cli import bind_host_arg, tcp_port_arg
from mstar_common.config import env_switch
from mstar_common.proxy.app import MODEL_KINDS, ProxySettings, ServedModel, create_app
from mstar_common.proxy.sse import SEND_STALL_S

# A multi-worker proxy's settings, from the parent to each worker process (uvicorn starts workers fresh and builds
# each one's app with `app_from_env`).
SETTINGS_ENV = "MSTAR_PROXY_SETTINGS"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def parse_model(spec: str) -> ServedModel:
    """NAME=TRITON_MODEL[:KIND]"""
    name, sep, target = spec.partition("=")
    triton_model, _, kind = target.partition(":")
    if not sep or not name or not triton_model:
        raise argparse.ArgumentTypeError(f"--model must be NAME=TRITON_MODEL[:KIND], got {spec!r}")
    if kind and kind not in MODEL_KINDS:
        raise argparse.ArgumentTypeError(f"--model {spec!r}: KIND must be one of {MODEL_KINDS}")
    return ServedModel(name=name, triton_model=triton_model, kind=kind or "text")


# uvicorn's log levels, and each one's for `logging` (trace: uvicorn's own level 5)
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "debug": logging.DEBUG, "trace": 5}


def seconds_arg(value: str) -> float:
    """An argparse type: seconds >= 0 (a negative drain timeout was no drain on SIGTERM at all)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise argparse.ArgumentTypeError(f"must be seconds >= 0, got {value!r}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mstar_common.proxy",
                                     description="OpenAI-compatible proxy in front of Triton")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    parser.add_argument("--host", type=bind_host_arg, default="127.0.0.1")
    parser.add_argument("--port", type=tcp_port_arg, default=8000)
    parser.add_argument("--model", type=parse_model, action="append", required=True, metavar="NAME=TRITON_MODEL",
                        help="serve Triton entry model TRITON_MODEL as OpenAI model NAME (repeatable)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="0: no limit")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of a 429 or 503")
    try:
        allow_remote = env_switch("MSTAR_ALLOW_REMOTE", False)
    except ValueError as exc:
        parser.error(str(exc))
    parser.add_argument("--allow-remote-urls", action="store_true", default=allow_remote,
                        help="fetch media given as http(s) URLs (default: MSTAR_ALLOW_REMOTE=1)")
    parser.add_argument("--drain-timeout-s", type=seconds_arg, default=30.0,
                        help="on SIGTERM, in-flight requests get this long to finish")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes sharing the port, each with its own event loop and Triton channel "
                             "(1: one process)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= 64:
        parser.error(f"--workers must be in [1, 64], got {args.workers}")

    logging.basicConfig(level=LOG_LEVELS[args.log_level], format=LOG_FORMAT)
    try:
        settings = ProxySettings(
            triton_url=args.triton_url,
            models=args.model,
            request_timeout_s=args.request_timeout_s or None,
            max_body_bytes=args.max_body_bytes,
            retry_after_s=args.retry_after_s,
            allow_remote_urls=args.allow_remote_urls,
            created=int(time.time()),
        )
    except ValueError as exc:  # a usage error, not a traceback
        parser.error(re.sub(r"ProxySettings\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(exc)))
    serve = dict(host=bind_host(args.host), port=args.port, log_level=args.log_level,
                 timeout_graceful_shutdown=args.drain_timeout_s)
    if args.workers == 1:
        serve_one(create_app(settings), **serve)
        return
    os.environ[SETTINGS_ENV] = json.dumps({"settings": dataclasses.asdict(settings), "log_level": args.log_level})
    run_workers("mstar_common.proxy.__main__:app_from_env", args.workers, **serve)


class _Workers(Multiprocess):
    """uvicorn's supervisor of worker processes, closing the parent's copy of the listening socket before it
    signals the workers. uvicorn's keeps it open until every worker has drained, so through a drain the kernel went
    on accepting connections that no worker would take: they hung, then were reset, where one process refuses
    them at once."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def bind_host(host: str) -> str:
    """`--host` as both asyncio and a bound socket read it: "*" (every address) is "", since uvicorn's workers bind
    ("*", port) on a socket of their own, which no resolver takes (the proxy failed to start after the load)."""
    return "" if host == "*" else host


def run_workers(app: str, workers: int, **serve) -> None:
    """`uvicorn.run(app, factory=True, workers=workers, **serve)`, with `_Workers` as the supervisor and the
    listening sockets `listening_sockets`' (uvicorn's own is one AF_INET socket unless the host has a ':', so
    "every address" was IPv4 alone with several workers, where one worker's asyncio server listens on IPv6 too)."""
    config = uvicorn.Config(app, factory=True, workers=workers, **serve)
    _Workers(config, sockets=_listen(config)).run()


def serve_one(app: FastAPI, **serve) -> None:
    """`uvicorn.run(app, **serve)` in this process, on `listening_sockets`' sockets (which `_bound` gives the
    kernel's write timeout)."""
    config = uvicorn.Config(app, **serve)
    sockets = _listen(config)
    try:
        uvicorn.Server(config).run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it drained on again; uvicorn.run ends there quietly too
        pass


def _listen(config: uvicorn.Config) -> list[socket.socket]:
    log = logging.getLogger("uvicorn.error")
    try:
        sockets = listening_sockets(config.host, config.port)
    except OSError as exc:
        log.error("cannot listen on %r port %s: %s", config.host, config.port, exc)
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as its own bind_socket exits
    for sock in sockets:  # uvicorn logs where it listens only for a socket it bound itself
        host, port = sock.getsockname()[:2]
        log.info("listening on %s port %d (%d worker%s)", f"[{host}]" if ":" in host else host, port,
                 config.workers, "" if config.workers == 1 else "s")
    return sockets


_NO_IPV6 = (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT, errno.EADDRNOTAVAIL)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound, inheritable TCP sockets for the workers, where one worker's asyncio server would listen: for ""
    (every address) one IPv6 socket that takes IPv4 too (IPV6_V6ONLY off), or IPv4 alone where the host has no
    IPv6 (not where the port's IPv6 side is taken: that refuses, as one worker's start does); for a name or
    address, every address it resolves to (a name with A and AAAA records listens on both)."""
    if host == "":
        try:
            return [_bound(socket.AF_INET6, ("::", port), dual_stack=True)]
        except OSError as exc:
            if exc.errno not in _NO_IPV6:
                raise
        return [_bound(socket.AF_INET, ("", port))]
    addresses = []
    for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE):
        if (family, address[:2]) not in [(f, a[:2]) for f, a in addresses]:
            addresses.append((family, address))
    sockets: list[socket.socket] = []
    try:
        for family, address in addresses:
            if not port and sockets:  # port 0: every address on the port the first one got
                port = sockets[0].getsockname()[1]
            try:
                sockets.append(_bound(family, (address[0], port, *address[2:])))
            except OSError as exc:  # a family this kernel lacks is skipped, as asyncio's server skips it
                if exc.errno not in (errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT) or family != socket.AF_INET6:
                    raise
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address of {host!r} to listen on")
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bound(family: int, address: tuple, dual_stack: bool = False) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; the connections it accepts inherit it
            # A peer that takes none of what is sent for this long (its window shut, or gone without a word) is
            # dropped by the kernel. The stream's own cut (sse.SEND_STALL_S) frees its request but cannot close a
            # socket whose buffer never drains; without this it stayed until the client left.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(SEND_STALL_S * 1000))
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if dual_stack else 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def settings_from_json(text: str) -> tuple[ProxySettings, str]:
    """(settings, log level) as `main` hands them to the workers."""
    raw = json.loads(text)
    fields = raw["settings"]
    models = [ServedModel(**model) for model in fields.pop("models")]
    return ProxySettings(models=models, **fields), raw["log_level"]


def app_from_env() -> FastAPI:
    """One worker's app (uvicorn's factory in a multi-worker proxy), from the settings its parent left in
    MSTAR_PROXY_SETTINGS."""
    settings, log_level = settings_from_json(os.environ[SETTINGS_ENV])
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    return create_app(settings)


if __name__ == "__main__":
    main()
