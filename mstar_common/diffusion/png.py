"""PNG encoding for the image walks, off the single-core path of PIL's encoder.

PIL filters and deflates a 1024x1024 RGB image on one core (~110-580 ms at level 6 depending on content, more
than the whole GPU pipeline's budget at c=1). Here the work is split:

- `paeth_filter`: every row Paeth-filtered (what adaptive filtering picks for most rows of photographic content)
  by a dozen elementwise torch ops on any device. The image components run it on the GPU, where the pixels are,
  when the walk asks for PNG rows (`want_png_rows`): ~0.1 ms there. On the CPU the same ops took 5-75 ms per
  1024x1024 image on the H200 host depending on what else ran, so a decoder on the CPU answers pixels and
  `encode_png` filters them with numpy over strips on a thread pool (8.5 ms on 8 threads there, in a bare
  process). `scripts/probe_png.py` measures each part on the machine it runs on.
- `encode_png_rows`: the filtered rows cut into strips of `STRIP_ROWS`, deflated on a thread pool, each strip
  primed with the 32 KiB before it so the size stays within a few percent of PIL's. The strips' raw deflate
  streams, sync-flushed, concatenate into one zlib stream (as pigz does).

The output is a standard PNG of exactly the same pixels; only the bytes differ from PIL's, and they do not
depend on the number of cores or on where the filter ran.

Deflate runs on Intel's ISA-L (`isal`, a dependency) where it is installed: 6-15x faster than zlib's level 6
on one core and no larger (`scripts/probe_png.py`, 1024x1024 RGB, Paeth-filtered, 2-core CPU, 2026-12-01:
noise-like 5.9 against 86 ms at the same size, smooth 22 against 131 ms and 3.4% smaller). ISA-L has levels
1-3, so `level` maps 1-5 -> 1, 6-8 -> 2, 9 -> 3; level 0 stores (zlib's level 0, as PNG's "no compression"
means). Without ISA-L, zlib at `level`. Unlike zlib, python-isal holds the GIL for much of its work (two
threads ran 1.3x one, zlib's 1.8x), ~0.35 ms per strip of a noise-like 1024-wide image: the walk's event loop
waits about that long at most.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

try:
    from isal import isal_zlib
except ImportError:  # zlib then (slower at the same sizes)
    isal_zlib = None
DEFLATE = "zlib" if isal_zlib is None else "isal"  # the library levels 1-9 deflate with

STRIP_ROWS = 64  # rows per parallel strip
MAX_WORKERS = 8
_WINDOW = 32768  # deflate's history: the dictionary each strip is primed with
_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)
_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def encode_png(pixels: np.ndarray, level: int = 6) -> bytes:
    """uint8 `[H, W, C]` (C = 1, 2, 3 or 4) or `[H, W]` -> PNG bytes, zlib `level` 0-9, filtered on this CPU: numpy
    over `STRIP_ROWS`-row strips on the thread pool (`paeth_filter_strip`), which held up better than torch's own
    threads beside other busy processes (a CPU deployment, 2 cores: 1.57 against 1.84 s p50 at c=8)."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] not in _COLOR_TYPES:
        raise ValueError(f"encode_png: expected uint8 [H, W, 1|2|3|4], got {pixels.dtype} {list(pixels.shape)}")
    height, width, channels = pixels.shape
    rows = np.ascontiguousarray(pixels).reshape(height, width * channels)
    starts = range(0, height, STRIP_ROWS)
    run = _map if len(starts) > 1 else lambda fn, items: [fn(item) for item in items]
    strips = run(lambda start: paeth_filter_strip(rows[start:start + STRIP_ROWS], rows[start - 1] if start else None,
                                                  channels), starts)
    return encode_png_rows(np.concatenate(strips), channels, level)


def encode_png_rows(filtered: np.ndarray, channels: int, level: int = 6) -> bytes:
    """`paeth_filter`'s scanlines of one image, uint8 `[H, 1 + W*channels]` -> PNG bytes, zlib `level` 0-9."""
    if channels not in _COLOR_TYPES:
        raise ValueError(f"encode_png: channels must be 1, 2, 3 or 4, got {channels}")
    if filtered.dtype != np.uint8 or filtered.ndim != 2 or (filtered.shape[1] - 1) % channels:
        raise ValueError(f"encode_png: expected uint8 [H, 1 + W*{channels}] scanlines, got {filtered.dtype} "
                         f"{list(filtered.shape)}")
    if not 0 <= level <= 9:
        raise ValueError(f"encode_png: level must be in [0, 9], got {level}")
    height, row_bytes = filtered.shape
    data = memoryview(np.ascontiguousarray(filtered).reshape(-1))
    bounds = [(start * row_bytes, min(start + STRIP_ROWS, height) * row_bytes)
              for start in range(0, height, STRIP_ROWS)]
    run = _map if len(bounds) > 1 else lambda fn, items: [fn(item) for item in items]
    deflated = run(lambda b: _deflate(data[b[0]:b[1]], data[max(0, b[0] - _WINDOW):b[0]] if b[0] else None, level,
                                      is_last=b[1] == len(data)), bounds)
    checksums = isal_zlib or zlib
    stream = _zlib_header(level) + b"".join(deflated) + struct.pack(">I", checksums.adler32(data))
    header = struct.pack(">IIBBBBB", (row_bytes - 1) // channels, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    return _SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", stream) + _chunk(b"IEND", b"")


def paeth_filter_strip(rows: np.ndarray, above: np.ndarray | None, bpp: int) -> np.ndarray:
    """numpy rows `[R, W*bpp]` (and the row above the first, if any) -> scanlines `[R, 1 + W*bpp]`: the same bytes
    as `paeth_filter` on those rows of the image."""
    num_rows, width = rows.shape
    padded = np.zeros((num_rows + 1, width + bpp), np.int16)  # the row above (zero at the top), a zero pixel left
    if above is not None:
        padded[0, bpp:] = above
    padded[1:, bpp:] = rows
    x, left, up, up_left = padded[1:, bpp:], padded[1:, :-bpp], padded[:-1, bpp:], padded[:-1, :-bpp]
    dist_left, dist_up = up - up_left, left - up_left
    dist_up_left = np.abs(dist_left + dist_up)
    np.abs(dist_left, out=dist_left)
    np.abs(dist_up, out=dist_up)
    predictor = np.where(dist_up <= dist_up_left, up, up_left)
    np.copyto(predictor, left, where=(dist_left <= dist_up) & (dist_left <= dist_up_left))
    out = np.empty((num_rows, width + 1), np.uint8)
    out[:, 0] = 4
    out[:, 1:] = np.subtract(x, predictor, out=predictor)  # modulo 256
    return out


def paeth_filter(rows: torch.Tensor, bpp: int) -> torch.Tensor:
    """uint8 rows `[..., H, W*bpp]` (one image per leading index; any device) -> scanlines `[..., H, 1 + W*bpp]`,
    each led by filter type 4 (Paeth), on the same device."""
    *lead, num_rows, width = rows.shape
    padded = rows.new_zeros((*lead, num_rows + 1, width + bpp), dtype=torch.int16)  # zero row above, pixel left
    padded[..., 1:, bpp:] = rows
    x, left = padded[..., 1:, bpp:], padded[..., 1:, :-bpp]
    up, up_left = padded[..., :-1, bpp:], padded[..., :-1, :-bpp]
    # The predictor nearest to left + up - up_left, ties broken left, then up (the PNG spec's order):
    # |p - left| = |up - up_left|, |p - up| = |left - up_left|, |p - up_left| = |both differences summed|.
    dist_left, dist_up = up - up_left, left - up_left
    dist_up_left = (dist_left + dist_up).abs_()
    dist_left.abs_()
    dist_up.abs_()
    predictor = torch.where(dist_up <= dist_up_left, up, up_left)
    predictor = torch.where((dist_left <= dist_up) & (dist_left <= dist_up_left), left, predictor)
    out = rows.new_empty((*lead, num_rows, width + 1))
    out[..., 0] = 4
    out[..., 1:] = x - predictor  # modulo 256 in the cast
    return out


def _deflate(data: bytes, history: bytes | None, level: int, is_last: bool) -> bytes:
    extra = {"zdict": history} if history else {}
    lib, lib_level = (zlib, level) if isal_zlib is None or level == 0 else (isal_zlib, isal_level(level))
    compressor = lib.compressobj(lib_level, lib.DEFLATED, -15, 9, lib.Z_DEFAULT_STRATEGY, **extra)
    return compressor.compress(data) + compressor.flush(lib.Z_FINISH if is_last else lib.Z_SYNC_FLUSH)


def isal_level(level: int) -> int:
    """zlib's level 1-9 -> ISA-L's 1-3."""
    return 1 if level <= 5 else 2 if level <= 8 else 3


def _zlib_header(level: int) -> bytes:
    cmf = 0x78  # deflate, 32 KiB window
    flevel = 0 if level < 2 else 1 if level < 6 else 2 if level == 6 else 3
    flg = flevel << 6
    flg += 31 - (cmf * 256 + flg) % 31
    return bytes((cmf, flg))


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = (isal_zlib or zlib).crc32
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc(data, crc(kind)))


def _map(fn, items) -> list:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(MAX_WORKERS, os.cpu_count() or 1), thread_name_prefix="png")
    return list(_pool.map(fn, items))
