"""The rule for media given by URL (a 400 naming the field), for the routes that take one.

No route takes a media URL yet: the spec's are the voice-cloning TTS families' `ref_audio`, which are not built.
Media come inline today (base64 fields, multipart uploads), so `limits.allow_remote_urls` has no effect yet.

- A request never makes the server read its own files: `file:` URLs and bare paths are refused, whatever the
  setting.
- `http(s)` URLs are refused unless the deployment enables them (`limits.allow_remote_urls`, or
  `MSTAR_ALLOW_REMOTE=1` for the proxy).

The length of an upload (`limits.max_upload_s`) is checked where the audio is decoded: the whisper walk (a 400
naming `file`), which reads it from the deployment; the proxy decodes no media and takes no such limit.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from mstar_common.proxy.errors import invalid_request

REMOTE_SCHEMES = ("http", "https")


def check_media_url(url: str, field: str, allow_remote: bool) -> str:
    """Return the URL's scheme ("data", "http", "https") if the request may use it; else raise a 400."""
    if not isinstance(url, str) or not url:
        raise invalid_request(f"'{field}' must be a non-empty URL string", param=field)
    scheme = urlsplit(url).scheme.lower() if ":" in url else ""
    if scheme == "data":
        return scheme
    if scheme in REMOTE_SCHEMES:
        if not allow_remote:
            raise invalid_request(f"'{field}': remote URLs are disabled on this server; send the media inline as "
                                  "a data: URL (or ask the operator to enable limits.allow_remote_urls)", param=field)
        return scheme
    # file:, bare paths, and anything else would read or reach something on the server's side.
    raise invalid_request(f"'{field}': only data: URLs{' and http(s) URLs' if allow_remote else ''} are accepted; "
                          "server-side files are never read", param=field)

