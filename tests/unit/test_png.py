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


def test_deflates_with_isal_where_installed_else_zlib(monkeypatch):
    """ISA-L (levels 1-9 mapped onto its 1-3) and zlib make different bytes of the same pixels; level 0 stores,
    the same bytes either way."""
    pytest.importorskip("isal")
    pixels = _smooth(200, 100)
    fast, stored = png.encode_png(pixels, 6), png.encode_png(pixels, 0)
    monkeypatch.setattr(png, "isal_zlib", None)
    slow = png.encode_png(pixels, 6)
    assert fast != slow and png.encode_png(pixels, 0) == stored
    for data in (fast, slow, stored):
        assert np.array_equal(_decode(data), pixels)
    assert [png.isal_level(level) for level in range(1, 10)] == [1, 1, 1, 1, 1, 2, 2, 2, 3]


def test_a_batch_of_images_filters_as_each_image_alone():
    """paeth_filter over `[n, H, W*C]` starts every image from a zero row above (the decoders filter a request's
    images in one call); encode_png_rows of each image's scanlines decodes to that image."""
    import torch

    images = RNG.integers(0, 256, (3, 40, 24, 3), dtype=np.uint8)
    batch = png.paeth_filter(torch.from_numpy(images.reshape(3, 40, 72)), 3)
    for image, rows in zip(images, batch, strict=True):
        assert torch.equal(rows, png.paeth_filter(torch.from_numpy(image.reshape(40, 72)), 3))
        assert np.array_equal(_decode(png.encode_png_rows(rows.numpy(), 3, 6)), image)
    with pytest.raises(ValueError, match="scanlines"):
        png.encode_png_rows(batch[0].numpy()[:, :-1], 3)


@pytest.mark.gpu
def test_the_filter_on_the_gpu_equals_the_cpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = torch.from_numpy(RNG.integers(0, 256, (2, 1024, 3072), dtype=np.uint8))
    assert torch.equal(png.paeth_filter(rows.cuda(), 3).cpu(), png.paeth_filter(rows, 3))


def test_the_strip_filter_equals_the_torch_filter():
    import torch

    for shape in [(130, 67, 3), (64, 64, 4), (90, 33, 1)]:
        pixels = RNG.integers(0, 256, shape, dtype=np.uint8)
        rows = pixels.reshape(shape[0], -1)
        strips = np.concatenate([png.paeth_filter_strip(rows[s:s + 64], rows[s - 1] if s else None, shape[2])
                                 for s in range(0, shape[0], 64)])
        assert np.array_equal(strips, png.paeth_filter(torch.from_numpy(rows), shape[2]).numpy())


def test_decoders_answer_png_rows_on_a_gpu_and_pixels_on_the_cpu():
    """host_image: PNG rows are filtered where the VAE ran only on a GPU; the walk encodes either answer."""
    import torch

    from mstar_common.diffusion.image_components import host_image

    pixels = torch.from_numpy(RNG.integers(0, 256, (2, 40, 24, 3), dtype=np.uint8))
    assert set(host_image(pixels, png_rows=True)) == {"pixels"}
    walk = ImageWalk(tokenizer=None, options=None, multiple=16)
    want = [p.numpy() for p in pixels]
    assert [_decode(d).tolist() for d in walk.encode_images(pixels.numpy(), OutputOptions("png", 6))] == \
        [w.tolist() for w in want]
    rows = png.paeth_filter(pixels.reshape(2, 40, 72), 3).numpy()  # what a GPU decoder answers
    encoded = walk.encode_images(rows, OutputOptions("png", 6), png_rows=True)
    assert [_decode(d).tolist() for d in encoded] == [w.tolist() for w in want]
    if torch.cuda.is_available():
        answer = host_image(pixels.cuda(), png_rows=True)
        assert np.array_equal(answer["png_rows"].numpy(), rows)
