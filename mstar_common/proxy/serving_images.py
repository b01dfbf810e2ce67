"""Images: POST /v1/images/generations, POST /v1/images/edits (OpenAI) and /generate with image output.

generations (JSON): `prompt`, `size` ('WxH', width first), `n`, `response_format` (b64_json only: no URLs are
hosted), `seed`, and as extra fields `num_inference_steps`, `output_format` (alias `image_output_format`),
`png_compress_level`, `output_compression`. edits (multipart): the same fields as form values plus `image`
(or `image[]`, repeatable: up to four references, in order); `mask` (inpainting) is refused. OpenAI fields
the model cannot honour (`quality`, `style`, `background` other than auto, `moderation` other than auto or low
(nothing is moderated), `guidance_scale` other than 0: no model here runs classifier-free guidance)
are refused rather than dropped. Geometry (latent grid, `max_image_area`), step and count limits are
checked by the entry model, whose `invalid_request` errors become 400s naming the rule.

/generate (image models): `text` is the prompt, `files` (repeatable) the references, `model_kwargs` holds
`width`/`height` (or `size`), `n`, `seed`, `num_inference_steps` and the output knobs; the answer is
`{"outputs": {"image": [base64, ...]}, "seed", "output_format"}`.
"""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import UploadFile

from mstar_common import images, wire
from mstar_common.diffusion.image_options import MAX_REFERENCE_IMAGES
from mstar_common.proxy.errors import (
    APIError,
    check_wire_number,
    client_field,
    from_exception,
    from_pydantic,
    invalid_request,
    parse_json,
    validation_error,
)
from mstar_common.proxy.serving_common import (
    FORM_TYPES,
    MODALITY_FIELDS,
    ServingContext,
    form_bool,
    form_float,
    form_int,
    form_modalities,
    read_utf8_form,
    until_disconnect,
)
from mstar_common.proxy.triton_stream import GenerationRequest

router = APIRouter()

IMAGE_KINDS = ("image",)
MAX_REFERENCES = MAX_REFERENCE_IMAGES  # a deployment's own limit (<= this) the entry model enforces
_IMAGE_FIELDS = ("image", "image[]")
_REFUSED = {  # OpenAI field -> values that may pass (the harmless ones)
    "quality": (None, "auto"), "style": (None,), "background": (None, "auto", "opaque"),  # every output is opaque
    "moderation": (None, "auto", "low"), "negative_prompt": (None,), "mask": (None,),
    # no classifier-free guidance in these distilled models: 0 (diffusers' "off", Z-Image-Turbo's card) is what runs
    "guidance_scale": (None, 0, "0", "0.0"),
    # images arrive whole: no stream of partial images (a form value is the string)
    "stream": (None, False, "false"), "partial_images": (None, 0, "0"),
}


class ImageFields(BaseModel):
    """The fields of both OpenAI image routes (form values arrive as strings and are converted first)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    n: int | None = None
    size: str | None = None
    response_format: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    output_format: Any = None
    image_output_format: Any = None
    png_compress_level: Any = None
    output_compression: Any = None
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of `user`: nothing is moderated or tracked here
    stream: Any = None
    partial_images: Any = None
    quality: Any = None
    style: Any = None
    background: Any = None
    moderation: Any = None
    guidance_scale: Any = None
    negative_prompt: Any = None
    mask: Any = None


# the client's names of the fields

# The OpenAI routes: the entry model's names (and those of its refusals) as the client sent them.
OPENAI_NAMES = {"num_images": "n", "width": "size", "height": "size", "reference_images": "image"}
_KNOBS = ("n", "seed", "num_inference_steps", "size", "output_format", "image_output_format", "png_compress_level",
          "output_compression", "response_format", *_REFUSED)


def native_names(sent_width: bool, sent_num_images: bool = False) -> dict[str, str]:
    """/generate's names: the prompt is `text`, every knob sits in `model_kwargs`, a size sent as width/height is
    named by its width, the image count by the spelling sent (`n` or `num_images`), and the uploads are `files`."""
    size = "model_kwargs.width" if sent_width else "model_kwargs.size"
    count = "model_kwargs.num_images" if sent_num_images else "model_kwargs.n"
    return {**{knob: f"model_kwargs.{knob}" for knob in _KNOBS}, "prompt": "text", "num_images": count, "n": count,
            "size": size, "width": size, "height": size, "image": "files", "reference_images": "files"}


# request -> Triton tensors


def image_tensors(fields: ImageFields, references: list[bytes], names: dict[str, str] | None = None
                  ) -> tuple[list[tuple[str, str, np.ndarray]], str]:
    """The entry model's input tensors (wire.IMAGE_INPUTS) and the chosen output format; 400s on bad fields.
    `names`: the client's name of each field where it differs (`OPENAI_NAMES`, `native_names`), for the 400s."""
    names = OPENAI_NAMES if names is None else names

    def named(field: str) -> str:
        return names.get(field, field)

    for name, allowed in _REFUSED.items():
        value = getattr(fields, name)
        if not any(value is ok if isinstance(ok, bool) or isinstance(value, bool) else value == ok for ok in allowed):
            raise invalid_request(f"'{named(name)}' is not supported by this model (got {getattr(fields, name)!r})",
                                  param=named(name))
    if fields.response_format not in (None, "b64_json"):
        raise invalid_request(f"'{named('response_format')}': only 'b64_json' is served (no image URLs are hosted), "
                              f"got {fields.response_format!r}", param=named("response_format"))
    if not fields.prompt.strip():
        raise invalid_request(f"'{named('prompt')}' (the prompt) must not be empty", param=named("prompt"))
    fmt = _one_of(fields.output_format, fields.image_output_format)
    try:
        options = images.output_options(fmt, fields.png_compress_level, fields.output_compression)
        size = None if fields.size in (None, "auto") else images.parse_size(fields.size)
    except ValueError as exc:
        message, param = client_field(str(exc), names)
        raise invalid_request(message, param=param) from None
    if len(references) > MAX_REFERENCES:
        raise invalid_request(f"'{named('image')}': at most {MAX_REFERENCES} reference images, got "
                              f"{len(references)}", param=named("image"))
    values: dict[str, Any] = {"prompt": fields.prompt, "num_images": fields.n, "seed": fields.seed,
                              "num_inference_steps": fields.num_inference_steps, "output_format": options.format}
    if size is not None:
        values["width"], values["height"] = size
    if options.format == "png":
        values["png_compress_level"] = options.png_compress_level
    else:
        values["output_compression"] = options.output_compression
    tensors = []
    for name, value in values.items():
        if value is None:
            continue
        dtype, np_dtype = wire.IMAGE_INPUTS[name]
        if dtype != "BYTES":
            # The model's refusal gives n's and the steps' real range ([1, its cap]); a 0x0 size is the model's to
            # refuse, by its grid.
            check_wire_number(value, np_dtype, named(name),
                              minimum=1 if name in ("num_images", "num_inference_steps") else 0,
                              wrap_only=name in ("num_images", "num_inference_steps"))
        array = np.array([value.encode("utf-8") if dtype == "BYTES" else value], dtype=np_dtype)
        tensors.append((name, dtype, array))
    if references:
        tensors.append((wire.REFERENCE_IMAGES, "BYTES", np.array(references, dtype=np.object_)))
    return tensors, options.format


def _one_of(first: Any, second: Any) -> Any:
    """output_format and its alias: the one sent, or both if they name the same format (any case, jpg = jpeg)."""
    def same(value: Any) -> Any:
        return images.format_name(value) if isinstance(value, str) else value

    if first is not None and second is not None and same(first) != same(second):
        raise invalid_request("'output_format' and 'image_output_format' disagree; send one", param="output_format")
    return first if first is not None else second


# running a request


async def run_images(request: Request, ctx: ServingContext, served, tensors,
                     names: dict[str, str] | None = None) -> tuple[list[bytes], int | None]:
    """The entry model's images and seed; its refusals name the fields as the client sent them (`names`)."""
    gen = GenerationRequest(tensors=tensors)
    gen.field_names = OPENAI_NAMES if names is None else names

    async def collect() -> tuple[list[bytes], int | None]:
        found: list[bytes] = []
        seed = None
        stream = ctx.triton.generate(served.triton_model, request.state.request_id, gen, ctx.settings.request_timeout_s)
        try:
            async for response in stream:
                found += response.images
                seed = response.seed if response.seed is not None else seed
        finally:
            await stream.aclose()
        return found, seed

    try:
        found, seed = await until_disconnect(request, collect())
    except Exception as exc:
        raise ctx.error(exc, gen) from None
    if not found:
        raise from_exception(RuntimeError(f"{served.triton_model} answered without images"))
    return found, seed


def openai_body(found: list[bytes], seed: int | None, fmt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"created": int(time.time()),
                            "data": [{"b64_json": base64.b64encode(img).decode("ascii")} for img in found],
                            "output_format": fmt, "size": _size(found[0])}
    if seed is not None:
        body["seed"] = seed
    return body


def _size(data: bytes) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return f"{image.width}x{image.height}"


def _fields(raw: dict[str, Any]) -> ImageFields:
    try:
        return ImageFields.model_validate(raw)
    except ValidationError as error:
        raise from_pydantic(error) from None


# routes


@router.post("/v1/images/generations")
async def generations(request: Request):
    ctx: ServingContext = request.app.state.serving
    raw = parse_json(await request.body(), "request body")
    if not isinstance(raw, dict):
        raise invalid_request("request body must be a JSON object")
    fields = _fields(raw)
    served = ctx.resolve(fields.model, kinds=IMAGE_KINDS)
    tensors, fmt = image_tensors(fields, [])
    found, seed = await run_images(request, ctx, served, tensors)
    return openai_body(found, seed, fmt)


@router.post("/v1/images/edits")
async def edits(request: Request):
    ctx: ServingContext = request.app.state.serving
    raw, references = await _form(request, file_fields=_IMAGE_FIELDS)
    if not references:
        raise invalid_request("'image' is required: an edit takes one to four reference images (a text-to-image "
                              "model takes none: use /v1/images/generations)", param="image")
    fields = _fields(raw)
    served = ctx.resolve(fields.model, kinds=IMAGE_KINDS)
    tensors, fmt = image_tensors(fields, references)
    found, seed = await run_images(request, ctx, served, tensors)
    return openai_body(found, seed, fmt)


async def _form(request: Request, file_fields: tuple[str, ...]) -> tuple[dict[str, Any], list[bytes]]:
    """Form values (numbers converted) and the uploaded files of `file_fields`, in order."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in FORM_TYPES:
        raise invalid_request(f"this route takes multipart/form-data, got {content_type or 'no content type'!r}")
    form = await read_utf8_form(request)
    raw: dict[str, Any] = {}
    uploads: list[bytes] = []
    for key, value in form.multi_items():  # files in the order sent: the order sets each reference's position
        if key in file_fields:
            if not isinstance(value, UploadFile):
                raise invalid_request(f"'{key}' must be an uploaded file", param=key)
            uploads.append(await value.read())
    for key in dict.fromkeys(form.keys()):
        if key in file_fields:
            continue
        values = form.getlist(key)
        if any(isinstance(v, UploadFile) for v in values):
            raise invalid_request(f"'{key}': unexpected file upload", param=key)
        if key in MODALITY_FIELDS:  # a list: repeated as the text models' /generate takes it
            raw[key] = form_modalities(values, key)
            continue
        if len(values) > 1:
            raise invalid_request(f"'{key}' was sent {len(values)} times; send it once", param=key)
        raw[key] = _form_value(key, values[0])
    return raw, uploads


def _form_value(key: str, value: str) -> Any:
    if key in ("n", "seed", "num_inference_steps"):
        return form_int(value, key)
    if key == "stream":  # read as the transcription routes read it (False, 0, no, off), so only `true` is refused
        return form_bool(value, key)
    if key in ("guidance_scale", "partial_images"):  # a number: 0.00 is the harmless 0
        number = form_float(value)
        return value if number is None else number  # none: refused as sent
    return value


# native /generate


async def generate_native(request: Request, ctx: ServingContext, served) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in FORM_TYPES:
        raw, references = await _form(request, file_fields=("files", "image", "image[]"))
        kwargs = parse_json(raw.pop("model_kwargs", "") or "{}", "'model_kwargs'", param="model_kwargs")
    else:
        raw, references = parse_json(await request.body(), "request body"), []
        if not isinstance(raw, dict):
            raise invalid_request("request body must be a JSON object")
        kwargs = raw.pop("model_kwargs", None)
        if kwargs is None:
            kwargs = {}
        elif isinstance(kwargs, str):
            kwargs = parse_json(kwargs, "'model_kwargs'", param="model_kwargs")
    if not isinstance(kwargs, dict):
        raise invalid_request("'model_kwargs' must be a JSON object", param="model_kwargs")
    names = native_names(sent_width="width" in kwargs or "height" in kwargs, sent_num_images="num_images" in kwargs)
    fields = _native_fields(raw, dict(kwargs))
    tensors, fmt = image_tensors(fields, references, names)
    found, seed = await run_images(request, ctx, served, tensors, names)
    return {"id": request.state.request_id, "model": served.name,
            "outputs": {"image": [base64.b64encode(img).decode("ascii") for img in found]},
            "seed": seed, "output_format": fmt}


def _native_fields(raw: dict[str, Any], kwargs: dict[str, Any]) -> ImageFields:
    raw.pop("model", None)
    streaming = raw.pop("streaming", False)
    if isinstance(streaming, str):  # a form's value
        streaming = form_bool(streaming, "streaming")
    if streaming is not None and not isinstance(streaming, bool):
        raise invalid_request(f"'streaming' must be true or false, got {streaming!r}", param="streaming")
    if streaming:
        raise invalid_request("'streaming' is not supported for image output: images arrive whole",
                              param="streaming")
    for key in ("input_modalities", "output_modalities"):
        values = _modalities(raw.pop(key, None), key)
        allowed = {"text", "image"} if key == "input_modalities" else {"image"}
        if values is not None and (not values or set(values) - allowed):
            raise invalid_request(f"'{key}': this image model supports {sorted(allowed)}, got {values}", param=key)
    if unknown := sorted(set(raw) - {"text"}):
        raise invalid_request(f"unknown field '{unknown[0]}'", param=unknown[0])
    if raw.get("text") is None:
        raise invalid_request("'text' (the prompt) is required", param="text")
    if not isinstance(raw["text"], str):
        raise invalid_request(f"'text' (the prompt) must be a string, got {type(raw['text']).__name__}", param="text")
    for key, where in (("prompt", "the prompt goes in 'text'"), ("model", "the model is the request's 'model'")):
        if key in kwargs:
            raise invalid_request(f"model_kwargs.{key}: not a model_kwargs field ({where})",
                                  param=f"model_kwargs.{key}")
    sent_num_images = "num_images" in kwargs
    if sent_num_images:
        if "n" in kwargs:
            raise invalid_request("model_kwargs: give 'n' or 'num_images' (the same knob), not both",
                                  param="model_kwargs.num_images")
        kwargs["n"] = kwargs.pop("num_images")
    width, height = kwargs.pop("width", None), kwargs.pop("height", None)
    if (width is None) != (height is None):
        raise invalid_request("model_kwargs: give both 'width' and 'height', or 'size'", param="model_kwargs.width")
    if width is not None:
        if "size" in kwargs:
            raise invalid_request("model_kwargs: give 'width'/'height' or 'size', not both", param="model_kwargs.size")
        # (above six digits a size string is no longer one: no model's area comes near it)
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 999_999 for v in (width, height)):
            raise invalid_request(f"model_kwargs.width/height: must be integers in [1, 999999], got {width!r} and "
                                  f"{height!r}", param="model_kwargs.width")
        kwargs["size"] = f"{width}x{height}"
    try:
        return ImageFields.model_validate({"prompt": raw["text"], **kwargs})
    except ValidationError as error:
        errors = [{**e, "loc": ("model_kwargs", *(("num_images", *e["loc"][1:])
                                                  if sent_num_images and e["loc"][:1] == ("n",) else e["loc"]))}
                  for e in error.errors()]
        raise validation_error(errors) from None


def _modalities(value: Any, key: str) -> list[str] | None:
    """A modalities field: a list of strings, a JSON list in a string, or comma-separated names."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        value = parse_json(text, f"'{key}'", param=key) if text.startswith("[") else \
            [v.strip() for v in text.split(",") if v.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise APIError(400, f"'{key}': must be a list of modality names, got {value!r}", param=key)
    return value


