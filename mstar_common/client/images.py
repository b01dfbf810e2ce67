"""Image methods of `MStarClient` (native /generate with image output); each returns the first image's bytes.

    png = client.generate_image("a cat in a hat", width=1024, height=1024, seed=0)
    png = client.edit_image("make it a watercolor", "cat.png", seed=1)        # or bytes, or up to 4 images
"""

from __future__ import annotations

import base64
import os
from typing import Any, BinaryIO

from mstar_common.client.types import encode_json, read_file_input, set_knobs

ImageInput = str | os.PathLike | bytes | bytearray | memoryview | BinaryIO


class ImageMethods:
    """Mixed into MStarClient: uses its `_model`, `_post` and `_json` (which turns a missing key into a 502)."""

    def generate_image(self, prompt: str, width: int | None = None, height: int | None = None,
                       seed: int | None = None, *, model: str | None = None, **model_kwargs: Any) -> bytes:
        """Text to image. `model_kwargs`: num_inference_steps, output_format (png | jpeg | webp),
        png_compress_level, output_compression. Omitted sizes use the deployment's default."""
        return self.generate_images(prompt, width, height, seed, model=model, **model_kwargs)[0]

    def generate_images(self, prompt: str, width: int | None = None, height: int | None = None,
                        seed: int | None = None, *, n: int = 1, model: str | None = None,
                        **model_kwargs: Any) -> list[bytes]:
        kwargs = _knobs(width, height, seed, n, model_kwargs)
        body: dict[str, Any] = {"text": prompt, "output_modalities": ["image"], "model_kwargs": kwargs}
        if (name := self._model(model)) is not None:
            body["model"] = name
        return self._json(self._post(json=body), _images)

    def edit_image(self, prompt: str, image: ImageInput | list[ImageInput] | tuple[ImageInput, ...],
                   seed: int | None = None, *,
                   width: int | None = None, height: int | None = None, model: str | None = None,
                   **model_kwargs: Any) -> bytes:
        """Edit with one to four reference images (paths, open binary files or bytes), in order. The output size
        defaults to the first reference's (cropped to the latent grid)."""
        images = list(image) if isinstance(image, (list, tuple)) else [image]
        if not images:  # sent without a file, the form would be a plain text-to-image request
            raise ValueError("image: edit_image takes one to four reference images, got none")
        files = [("files", (f"image{i}.png", _read(img, f"image[{i}]"), "application/octet-stream"))
                 for i, img in enumerate(images)]
        data = {"text": prompt, "output_modalities": "image",
                "model_kwargs": encode_json(_knobs(width, height, seed, 1, model_kwargs))}
        if (name := self._model(model)) is not None:
            data["model"] = name
        return self._json(self._post(data=data, files=files), _images)[0]


def _knobs(width: int | None, height: int | None, seed: int | None, n: int, extra: dict[str, Any]) -> dict[str, Any]:
    kwargs = set_knobs(extra)
    if width is not None or height is not None:
        kwargs["width"], kwargs["height"] = width, height
    if seed is not None:
        kwargs["seed"] = seed
    if n != 1:
        kwargs["n"] = n
    return kwargs


def _read(image: ImageInput, name: str) -> bytes:
    return read_file_input(image, name)


def _images(data: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(b64) for b64 in data["outputs"]["image"]]
