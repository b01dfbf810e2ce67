"""python -m mstar_common.proxy --triton-url 127.0.0.1:8001 --port 8000 --model qwen3=qwen3_llm"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from mstar_common.proxy.app import MODEL_KINDS, ProxySettings, ServedModel, create_app


def parse_model(spec: str) -> ServedModel:
    """NAME=TRITON_MODEL[:KIND]"""
    name, sep, target = spec.partition("=")
    triton_model, _, kind = target.partition(":")
    if not sep or not name or not triton_model:
        raise argparse.ArgumentTypeError(f"--model must be NAME=TRITON_MODEL[:KIND], got {spec!r}")
    if kind and kind not in MODEL_KINDS:
        raise argparse.ArgumentTypeError(f"--model {spec!r}: KIND must be one of {MODEL_KINDS}")
    return ServedModel(name=name, triton_model=triton_model, kind=kind or "text")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mstar_common.proxy",
                                     description="OpenAI-compatible proxy in front of Triton")
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton gRPC host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", type=parse_model, action="append", required=True, metavar="NAME=TRITON_MODEL",
                        help="serve Triton entry model TRITON_MODEL as OpenAI model NAME (repeatable)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="0: no limit")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--retry-after-s", type=int, default=1, help="Retry-After of a 429 or 503")
    parser.add_argument("--max-upload-s", type=float, default=600.0, help="longest media upload, seconds")
    parser.add_argument("--allow-remote-urls", action="store_true",
                        default=os.environ.get("MSTAR_ALLOW_REMOTE") == "1",
                        help="fetch media given as http(s) URLs (default: MSTAR_ALLOW_REMOTE=1)")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0,
                        help="on SIGTERM, in-flight requests get this long to finish")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = ProxySettings(
        triton_url=args.triton_url,
        models=args.model,
        request_timeout_s=args.request_timeout_s or None,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after_s,
        max_upload_s=args.max_upload_s,
        allow_remote_urls=args.allow_remote_urls,
    )
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.drain_timeout_s)


if __name__ == "__main__":
    main()
