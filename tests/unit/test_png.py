"""The image walks' parallel PNG encoder: the decoded pixels are exactly the input (every colour type, level, odd
size and strip split), the bytes do not depend on the thread count, and the size stays near PIL's."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from ensembles.image_walk import ImageWalk
from mstar_common.diffusion import png
from mstar_common.images import OutputOptions, encode_image

RNG = np.random.default_rng(0)


def _decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def _smooth(height: int, width: int) -> np.ndarray:
    """Photograph-like content (strong row and column correlation), where filtering and deflate matter."""
    walk = np.cumsum(RNG.integers(-2, 3, (height, width, 3)), axis=1) + np.cumsum(RNG.integers(-1, 2, (height, 1, 3)),
                                                                                   axis=0)
    return np.clip(walk + 128, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("shape", [(1, 1, 3), (63, 17, 3), (64, 64, 3), (65, 31, 3), (200, 129, 3), (130, 67, 4),
                                   (90, 33, 1), (70, 40, 2), (77, 51)])
@pytest.mark.parametrize("level", [0, 1, 6, 9])
def test_decodes_to_the_same_pixels(shape, level):
    pixels = RNG.integers(0, 256, shape, dtype=np.uint8)
    decoded = _decode(png.encode_png(pixels, level))
    assert np.array_equal(decoded.reshape(pixels.shape), pixels)


def test_extreme_values_and_smooth_content_round_trip():
    for pixels in (np.zeros((150, 90, 3), np.uint8), np.full((150, 90, 3), 255, np.uint8), _smooth(300, 200),
                   np.tile(np.array([0, 255], np.uint8), (130, 45, 3))[:, :, :3]):
        assert np.array_equal(_decode(png.encode_png(pixels)), pixels)


def test_bytes_do_not_depend_on_the_number_of_threads(monkeypatch):
    pixels = _smooth(300, 64)
    first = png.encode_png(pixels, 6)
    monkeypatch.setattr(png, "_pool", None)
    monkeypatch.setattr(png, "MAX_WORKERS", 1)
    assert png.encode_png(pixels, 6) == first


def test_size_stays_near_pil():
    pixels = _smooth(512, 512)
    ours, pil = png.encode_png(pixels, 6), encode_image(pixels, OutputOptions("png", 6))
    assert len(ours) <= 1.1 * len(pil)


def test_refuses_what_is_not_an_8_bit_image():
    with pytest.raises(ValueError, match="uint8"):
        png.encode_png(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        png.encode_png(np.zeros((4, 4, 5), np.uint8))
    with pytest.raises(ValueError, match="level"):
        png.encode_png(np.zeros((4, 4, 3), np.uint8), 10)


def test_the_walk_encodes_png_in_strips_and_other_formats_with_pil():
    walk = ImageWalk(tokenizer=None, options=None, multiple=16)
    pixels = RNG.integers(0, 256, (2, 80, 48, 3), dtype=np.uint8)
    encoded = walk.encode_images(pixels, OutputOptions("png", 3))
    assert [_decode(data).tolist() for data in encoded] == [p.tolist() for p in pixels]
    jpeg = walk.encode_images(pixels, OutputOptions("jpeg", 6, 90))
    assert [Image.open(io.BytesIO(data)).format for data in jpeg] == ["JPEG", "JPEG"]
