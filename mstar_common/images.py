"""Image request rules shared by the proxy and the image walks: sizes, output-format knobs, decode and encode.

No torch here (the proxy imports it). Every refusal is a `ValueError` whose message names the field and the
rule; the proxy answers it with a 400 and a walk with an `invalid_request` error.

Output knobs: `output_format` (alias `image_output_format`): png | jpeg | webp (default png); `png_compress_level`
0-9 for png; `output_compression` 0-100 for jpeg/webp (100 = best quality, the default as OpenAI's). Only the
knob of the chosen format is checked (the spec's rule): the other format's is ignored, whatever it holds; null
means the default. A knob accepts any whole number that `int()` reads ("6", 6.0); bools, fractions (50.9),
infinities, NaN and out-of-range values are refused. JPEG and WebP cap a side (65,500 and 16,383 px, the
formats' own limits), refused before any work (`check_format_size`).
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMATS = ("png", "jpeg", "webp")
PNG_LEVELS = (0, 9)
COMPRESSION = (0, 100)
DEFAULT_PNG_LEVEL = 6
DEFAULT_COMPRESSION = 100  # OpenAI's default output_compression
MAX_UPLOAD_PIXELS = 8192 * 8192  # decoded-size cap of one uploaded image (decompression bombs)
_SIZE = re.compile(r"\s*([0-9]{1,6})\s*[xX×]\s*([0-9]{1,6})\s*")  # ASCII digits: int() would read others too


@dataclass(frozen=True, slots=True)
class OutputOptions:
    format: str = "png"
    png_compress_level: int = DEFAULT_PNG_LEVEL
    output_compression: int = DEFAULT_COMPRESSION


def whole_number(value: Any, field: str, low: int, high: int) -> int:
    """An integer knob: any whole number `int()` reads, within [low, high]; bools and fractions refused."""
    if isinstance(value, bool):
        raise ValueError(f"{field}: must be a whole number in [{low}, {high}], got {value!r} (a boolean)")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{field}: must be a whole number in [{low}, {high}], got {value!r}")
        value = int(value)
    elif isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{field}: must be a whole number in [{low}, {high}], got {value!r}") from None
    elif not isinstance(value, (int, np.integer)):
        raise ValueError(f"{field}: must be a whole number in [{low}, {high}], got {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{field}: {value} is out of range [{low}, {high}]")
    return value


def format_name(value: str) -> str:
    """An output format as the code names it: lower case, jpg as jpeg."""
    return "jpeg" if value.lower() == "jpg" else value.lower()


def output_options(output_format: Any = None, png_compress_level: Any = None,
                   output_compression: Any = None) -> OutputOptions:
    fmt = "png" if output_format is None else output_format
    if not isinstance(fmt, str) or fmt.lower() not in (*FORMATS, "jpg"):
        raise ValueError(f"output_format: must be one of {list(FORMATS)}, got {output_format!r}")
    fmt = format_name(fmt)
    level, quality = DEFAULT_PNG_LEVEL, DEFAULT_COMPRESSION
    if png_compress_level is not None and fmt == "png":
        level = whole_number(png_compress_level, "png_compress_level", *PNG_LEVELS)
    if output_compression is not None and fmt != "png":
        quality = whole_number(output_compression, "output_compression", *COMPRESSION)
    return OutputOptions(fmt, level, quality)


MAX_FORMAT_SIDE = {"jpeg": 65_500, "webp": 16_383}  # libjpeg's and libwebp's largest side; png's is past our areas


def check_format_size(width: int, height: int, fmt: str, field: str = "size") -> None:
    """Refuse a size the output format cannot hold, before any image is made (the encoder would fail after)."""
    limit = MAX_FORMAT_SIDE.get(fmt)
    if limit is not None and max(width, height) > limit:
        raise ValueError(f"{field}: {width}x{height} is too large for output_format {fmt!r}: {fmt} images are at "
                         f"most {limit} px a side")


def parse_size(size: Any, field: str = "size") -> tuple[int, int]:
    """'WxH' (width first) -> (width, height)."""
    match = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"{field}: must be 'WIDTHxHEIGHT' in pixels, e.g. '1024x1024', got {size!r}")
    return int(match.group(1)), int(match.group(2))


def check_geometry(width: int, height: int, multiple: int, max_area: int, field: str = "size") -> None:
    """Refuse sizes off the latent grid or over the area budget, naming the nearest valid sizes."""
    if width < multiple or height < multiple:
        raise ValueError(f"{field}: {width}x{height} is too small: width and height must be at least {multiple}")
    if width * height > max_area:  # ahead of the grid, whose nearest sizes would be over the area too
        side = math.isqrt(max_area) // multiple * multiple
        raise ValueError(f"{field}: {width}x{height} = {width * height} pixels exceeds max_image_area={max_area} "
                         f"(e.g. {side}x{side} fits)")
    if width % multiple or height % multiple:
        lower = f"{width // multiple * multiple}x{height // multiple * multiple}"
        upper = f"{-(-width // multiple) * multiple}x{-(-height // multiple) * multiple}"
        fits = [size for size in (lower, upper) if math.prod(map(int, size.split("x"))) <= max_area]
        raise ValueError(f"{field}: {width}x{height} is not on the latent grid: width and height must be multiples "
                         f"of {multiple} (nearest valid: {' or '.join(fits)})")


# The formats an upload may be (OpenAI's edits take png, webp and jpg): decoding cost follows the declared size in
# these. Pillow's others do not bound it so: a 64x64 TIFF declaring one 46,336-pixel-square deflated tile made
# libtiff fill 2 GiB from a 2 MB file, and EPS runs Ghostscript.
UPLOAD_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "AVIF", "BMP")
MAX_JPEG_SCANS = 256  # progressive JPEGs have ~10; each scan walks every block (8192x8192: ~3 ms a scan, ~124 bytes)


def decode_image(data: bytes, field: str):
    """Uploaded bytes -> an RGB-convertible PIL image, fully decoded; unreadable data is a ValueError naming `field`.
    Pillow's decoders fail on damaged data in many ways besides OSError (a ValueError from a PNG chunk, an
    EOFError, a struct.error ...): every one of them is the upload's fault, so all are caught."""
    from PIL import Image, ImageOps

    if not data:
        raise ValueError(f"{field}: the upload is empty")
    Image.init()
    formats = [name for name in UPLOAD_FORMATS if name in Image.OPEN]  # (AVIF where this Pillow has it)
    try:
        with Image.open(io.BytesIO(data), formats=formats) as probe:
            width, height, kind = *probe.size, probe.format
    except Image.DecompressionBombError as exc:  # past twice Pillow's own cap: its message gives the size
        raise ValueError(f"{field}: the image exceeds the {MAX_UPLOAD_PIXELS}-pixel upload limit ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (see the docstring)
        raise ValueError(f"{field}: not a readable image in a format this server takes "
                         f"({', '.join(formats)}; {type(exc).__name__})") from None
    if width * height > MAX_UPLOAD_PIXELS:
        raise ValueError(f"{field}: {width}x{height} exceeds the {MAX_UPLOAD_PIXELS}-pixel upload limit")
    # start-of-scan markers (entropy-coded data cannot hold FF DA): a file repeating a scan thousands of times
    # passes the size cap and takes minutes of CPU that no deadline can stop
    if kind in ("JPEG", "MPO") and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:  # MPO: a camera's JPEGs
        raise ValueError(f"{field}: a JPEG of {scans} scans; this server decodes at most {MAX_JPEG_SCANS}")
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
        image.load()
        # upright, as it displays: a phone photo stores its pixels sideways and says so in EXIF Orientation
        return ImageOps.exif_transpose(image)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{field}: not a readable image ({type(exc).__name__})") from None


def encode_image(pixels: np.ndarray, options: OutputOptions) -> bytes:
    """uint8 `[H, W, 3]` -> encoded bytes."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(pixels))
    buffer = io.BytesIO()
    if options.format == "png":
        image.save(buffer, format="PNG", compress_level=options.png_compress_level)
    elif options.format == "jpeg":
        image.save(buffer, format="JPEG", quality=options.output_compression)
    else:
        image.save(buffer, format="WEBP", quality=options.output_compression)
    return buffer.getvalue()


PNG_ENCODERS = ("parallel", "pil")


def png_encoder() -> str:
    """`MSTAR_PNG_ENCODER`: who encodes a PNG output, `parallel` (the default: rows Paeth-filtered on the decoder's
    device, deflated in parallel, mstar_common/diffusion/png.py) or `pil` (PIL from the pixels)."""
    value = os.environ.get("MSTAR_PNG_ENCODER", "") or "parallel"
    if value not in PNG_ENCODERS:
        raise ValueError(f"MSTAR_PNG_ENCODER={value!r}: expected one of {', '.join(PNG_ENCODERS)}")
    return value


def media_type(fmt: str) -> str:
    return {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}[fmt]
