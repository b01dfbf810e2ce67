"""A throwaway HTTP server on 127.0.0.1, and an environment whose http_proxy leads nowhere: for the tests that our
own servers are asked directly (mstar_common.launcher.open_direct)."""

from __future__ import annotations

import contextlib
import http.server
import threading
import urllib.request
from collections.abc import Iterator


@contextlib.contextmanager
def answering(body: bytes = b"") -> Iterator[str]:
    """A server that answers every GET with 200 and `body`; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def behind_unreachable_proxy(monkeypatch) -> None:
    """http_proxy set to a port nothing listens on, no no_proxy, and urlopen's opener built anew from it."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)
