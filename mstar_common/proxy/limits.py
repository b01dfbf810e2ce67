"""Input safety rules every route applies to media references and uploads (400/413 naming the rule).

- A request never makes the server read its own files: `file:` URLs and bare paths are refused, whatever the
  setting. Media come inline (`data:` URLs, base64 fields, multipart uploads).
- `http(s)` URLs are refused unless the deployment enables them (`limits.allow_remote_urls`, or
  `MSTAR_ALLOW_REMOTE=1` for the proxy); a failed fetch names the status, never a server path.
- Uploads longer than `limits.max_upload_s` seconds of media are refused before they are decoded further.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from mstar_common.proxy.errors import APIError, invalid_request

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


def check_upload_duration(seconds: float, field: str, max_upload_s: float) -> None:
    if not seconds <= max_upload_s:  # also refuses NaN
        raise APIError(413, f"'{field}': {seconds:.1f} s of media exceeds the limit of {max_upload_s:g} s",
                       param=field)
