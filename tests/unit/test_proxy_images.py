"""The image routes against a fake Triton: what reaches the entry model, the OpenAI and native response shapes,
the refusals (400 naming the field and rule), the SDK's image methods; plus the shared image rules."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from mstar import MStarClient
from mstar_common import images
from mstar_common.proxy.app import ServedModel
from mstar_common.proxy.triton_stream import StreamResponse, TritonInvalidRequest
from tests.unit.proxy_fake_triton import FakeTriton, make_app

MODEL = ServedModel("klein", "flux2_klein_walk", kind="image")


def png(width: int = 32, height: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_script(count: int = 1, seed: int = 7):
    return [StreamResponse(images=[png()] * count, seed=seed, is_final=True)]


def client(script=None, models=(MODEL,)) -> tuple[TestClient, FakeTriton]:
    app, fake = make_app(FakeTriton(script=script or image_script()), models=list(models))
    return TestClient(app), fake


def sent(fake: FakeTriton) -> dict:
    return {name: value[2].reshape(-1).tolist() for name, value in fake.requests[-1].tensors.items()}


def test_generations_sends_the_entry_model_tensors_and_answers_b64():
    http, fake = client(image_script(2, seed=11))
    body = {"model": "klein", "prompt": "a cat", "size": "96x64", "n": 2, "response_format": "b64_json", "seed": 3,
            "num_inference_steps": 2, "output_format": "jpeg", "output_compression": "80"}
    reply = http.post("/v1/images/generations", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert len(data["data"]) == 2 and data["seed"] == 11 and data["output_format"] == "jpeg" and data["size"] == "32x16"
    assert base64.b64decode(data["data"][0]["b64_json"]) == png()
    assert fake.requests[-1].model == "flux2_klein_walk"
    assert sent(fake) == {"prompt": [b"a cat"], "width": [96], "height": [64], "num_images": [2], "seed": [3],
                          "num_inference_steps": [2], "output_format": [b"jpeg"], "output_compression": [80]}


def test_edits_send_references_in_order():
    http, fake = client()
    files = [("image[]", ("a.png", png(), "image/png")), ("image[]", ("b.png", png(64, 64), "image/png"))]
    reply = http.post("/v1/images/edits", data={"prompt": "blue", "n": "1", "seed": "5"}, files=files)
    assert reply.status_code == 200, reply.text
    assert sent(fake)["reference_images"] == [png(), png(64, 64)] and sent(fake)["seed"] == [5]


@pytest.mark.parametrize("field, value", [("n", "1_0"), ("seed", "\u0665"), ("num_inference_steps", "2_0"),
                                          ("n", "0x2"), ("seed", "1" * 5000)])  # (past int()'s 4,300 digits)
def test_an_edits_form_number_is_ascii_digits(field, value):
    """int() read "1_0" as 10 and Arabic-Indic digits as theirs, so a typo became another request; the JSON routes
    take no such spelling."""
    http, fake = client()
    reply = http.post("/v1/images/edits", data={"prompt": "blue", field: value},
                      files=[("image", ("a.png", png(), "image/png"))])
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field and f"'{field}' must be an integer" in reply.text
    assert fake.requests == []


def test_edits_keep_the_upload_order_across_image_and_image_brackets():
    """Uploads were grouped by form key, so A (image), B (image[]), C (image) reached the model as A, C, B; the
    order sets each reference's position ids, so the result changed."""
    http, fake = client()
    a, b, c = png(16, 16), png(32, 32), png(48, 48)
    files = [("image", ("a.png", a, "image/png")), ("image[]", ("b.png", b, "image/png")),
             ("image", ("c.png", c, "image/png"))]
    reply = http.post("/v1/images/edits", data={"prompt": "blue"}, files=files)
    assert reply.status_code == 200, reply.text
    assert sent(fake)["reference_images"] == [a, b, c]


@pytest.mark.parametrize("first, second", [("PNG", "png"), ("jpg", "jpeg"), ("Jpeg", "JPG")])
def test_a_format_and_its_alias_naming_one_format_agree(first, second):
    http, fake = client()
    reply = http.post("/v1/images/generations", json={"model": "klein", "prompt": "x", "output_format": first,
                                                      "image_output_format": second})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("body,field", [
    ({"size": "1024"}, "size"),
    ({"response_format": "url"}, "response_format"),
    ({"quality": "hd"}, "quality"),
    ({"guidance_scale": 3.5}, "guidance_scale"),
    ({"guidance_scale": False}, "guidance_scale"),
    ({"partial_images": False}, "partial_images"),
    ({"output_format": "gif"}, "output_format"),
    ({"png_compress_level": 50.9}, "png_compress_level"),
    ({"png_compress_level": True}, "png_compress_level"),
    ({"png_compress_level": 10}, "png_compress_level"),
    ({"output_format": "webp", "output_compression": float("inf")}, "output_compression"),
    ({"output_format": "png", "image_output_format": "jpeg"}, "output_format"),
    ({"n": 1.5}, "n"),
    ({"prompt": " "}, "prompt"),
    ({"colour": "red"}, "colour"),
])
def test_generation_refusals_name_the_field(body, field):
    http, fake = client()
    reply = http.post("/v1/images/generations",
                      content=__import__("json").dumps({"prompt": "x", **body}, allow_nan=True),
                      headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"]
    assert not fake.requests


def test_only_the_chosen_formats_knob_is_checked_and_whole_numbers_pass():
    """The spec's rule (MODELS.md E1): only the knob of the chosen format is checked; the other's is ignored, and the
    walk gets the chosen format's knob alone (its default where none was given)."""
    http, fake = client()
    reply = http.post("/v1/images/generations", json={"prompt": "x", "output_format": "png", "png_compress_level": "9"})
    assert reply.status_code == 200 and sent(fake)["png_compress_level"] == [9]
    reply = http.post("/v1/images/generations",
                      json={"prompt": "x", "output_format": "webp", "output_compression": 50.0})
    assert reply.status_code == 200 and sent(fake)["output_compression"] == [50]
    reply = http.post("/v1/images/generations",
                      json={"prompt": "x", "output_format": "webp", "output_compression": 500})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "output_compression", reply.text
    # the spec's rule: only the chosen format's knob is checked; the other's is ignored, whatever it holds
    for body in ({"output_format": "png", "output_compression": 500}, {"output_compression": "high"},
                 {"output_format": "jpeg", "png_compress_level": 60},
                 {"output_format": "webp", "png_compress_level": 6}):
        reply = http.post("/v1/images/generations", json={"prompt": "x", **body})
        assert reply.status_code == 200, (body, reply.text)
        knobs = {k: v for k, v in sent(fake).items() if k in ("png_compress_level", "output_compression")}
        assert knobs == ({"png_compress_level": [6]} if body.get("output_format", "png") == "png"
                         else {"output_compression": [100]}), body


def test_harmless_openai_values_pass_and_streaming_is_refused():
    http, fake = client()
    reply = http.post("/v1/images/generations", json={"prompt": "x", "background": "opaque", "stream": False,
                                                      "partial_images": 0, "safety_identifier": "u1", "user": "u1"})
    assert reply.status_code == 200, reply.text
    for body, field in (({"stream": True}, "stream"), ({"partial_images": 2}, "partial_images"),
                        ({"background": "transparent"}, "background")):
        reply = http.post("/v1/images/generations", json={"prompt": "x", **body})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text


def test_a_reference_is_used_upright_as_its_exif_orientation_says():
    """A phone photo stores its pixels sideways with EXIF Orientation 6: it was used (and sized) sideways."""
    from PIL import Image

    from mstar_common.images import decode_image

    stored = Image.new("RGB", (128, 64))
    exif = stored.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue(), "image[0]").size == (64, 128)


def test_edit_refusals():
    http, _ = client()
    assert "image" in http.post("/v1/images/edits", data={"prompt": "x"}).json()["error"]["message"]
    five = [("image[]", ("a.png", png(), "image/png"))] * 5
    reply = http.post("/v1/images/edits", data={"prompt": "x"}, files=five)
    assert reply.status_code == 400 and "at most 4" in reply.json()["error"]["message"]
    mask = [("image", ("a.png", png(), "image/png"))]
    reply = http.post("/v1/images/edits", data={"prompt": "x", "mask": "m"}, files=mask)
    assert reply.status_code == 400 and "mask" in reply.json()["error"]["message"]


def test_entry_model_refusal_is_a_400_with_its_message():
    http, _ = client([TritonInvalidRequest("size: 100x100 is not on the latent grid")])
    reply = http.post("/v1/images/generations", json={"prompt": "x", "size": "100x100"})
    assert reply.status_code == 400 and "latent grid" in reply.json()["error"]["message"]


def test_text_routes_refuse_an_image_model_and_image_routes_a_text_model():
    http, _ = client(models=(MODEL, ServedModel("qwen3", "qwen3_llm")))
    reply = http.post("/v1/chat/completions", json={"model": "klein", "messages": [{"role": "user", "content": "x"}]})
    assert reply.status_code == 400
    assert http.post("/v1/images/generations", json={"model": "qwen3", "prompt": "x"}).status_code == 400


def test_native_generate_with_image_output_json_and_multipart():
    http, fake = client()
    reply = http.post("/generate", json={"text": "a cat", "output_modalities": ["image"],
                                         "model_kwargs": {"width": 64, "height": 48, "seed": 1, "n": 1}})
    assert reply.status_code == 200, reply.text
    assert base64.b64decode(reply.json()["outputs"]["image"][0]) == png() and reply.json()["seed"] == 7
    assert sent(fake)["width"] == [64] and sent(fake)["height"] == [48]
    reply = http.post("/generate", data={"text": "edit", "model_kwargs": '{"num_inference_steps": 2}'},
                      files=[("files", ("a.png", png(), "image/png"))])
    assert reply.status_code == 200 and sent(fake)["reference_images"] == [png()]
    for body in ({"text": "x", "streaming": True}, {"text": "x", "output_modalities": ["text"]},
                 {"text": "x", "model_kwargs": {"width": 64}}, {"model_kwargs": {}}):
        assert http.post("/generate", json=body).status_code == 400, body


def test_sdk_generate_image_and_edit_image(tmp_path):
    http, fake = client()
    sdk = MStarClient(http_client=http)
    assert sdk.generate_image("a cat", width=64, height=64, seed=0) == png()
    assert sent(fake)["seed"] == [0] and sent(fake)["width"] == [64]
    path = tmp_path / "cat.png"
    path.write_bytes(png(80, 80))
    assert sdk.edit_image("make it a watercolor", str(path), seed=1) == png()
    assert sent(fake)["reference_images"] == [png(80, 80)]


# the shared rules


@pytest.mark.parametrize("value,expected", [("6", 6), (6.0, 6), (np.int64(3), 3), (0, 0)])
def test_whole_numbers_accepted(value, expected):
    assert images.whole_number(value, "k", 0, 9) == expected


@pytest.mark.parametrize("value", [True, 5.5, float("inf"), float("nan"), "x", 10, -1, None, [1]])
def test_whole_numbers_refused(value):
    with pytest.raises(ValueError, match="k"):
        images.whole_number(value, "k", 0, 9)


def test_geometry_rules_name_the_nearest_valid_sizes():
    with pytest.raises(ValueError, match="multiples of 16 .nearest valid: 992x1008 or 1008x1024"):
        images.check_geometry(1000, 1010, 16, 4096 * 4096)
    with pytest.raises(ValueError, match="exceeds max_image_area=4194304"):
        images.check_geometry(4096, 4096, 16, 2048 * 2048)
    images.check_geometry(2048, 2048, 16, 2048 * 2048)
    assert images.parse_size("1024x768") == (1024, 768)
    with pytest.raises(ValueError, match="must be 'WIDTHxHEIGHT'"):
        images.parse_size("\uff16\uff14x64")  # full-width digits
    # Off the grid and over the area: the area is the rule to state (the grid's neighbours would not fit either).
    with pytest.raises(ValueError, match=r"99999x99999 = 9999800001 pixels exceeds max_image_area=65536 .e.g. 256x256"):
        images.check_geometry(99999, 99999, 16, 65536)
    # Off the grid at the area's edge: only the neighbour that fits is offered.
    with pytest.raises(ValueError, match=r"nearest valid: 240x256\)$"):
        images.check_geometry(250, 260, 16, 65536)


def test_unreadable_and_huge_uploads_are_refused():
    with pytest.raises(ValueError, match="image.0.: not a readable image"):
        images.decode_image(b"not an image", "image[0]")
    with pytest.raises(ValueError, match="empty"):
        images.decode_image(b"", "image[0]")
    assert images.decode_image(png(), "image[0]").size == (32, 16)


def _dds_with_unknown_flags() -> bytes:
    import struct

    buffer = io.BytesIO()
    Image.new("RGB", (96, 80)).save(buffer, "DDS")
    data = bytearray(buffer.getvalue())
    data[80:84] = struct.pack("<I", 0x19)  # the pixel format's flags
    return bytes(data)


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature, IHDR and an empty IDAT: Pillow reads the size from it without decoding anything."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def _tiff() -> bytes:
    """A small deflated TIFF (the format a tile bomb comes in: a 64x64 image declaring one 46,336-pixel-square
    tile, which libtiff fills whole to decode)."""
    buffer = io.BytesIO()
    Image.new("L", (64, 64)).save(buffer, "TIFF", compression="tiff_adobe_deflate")
    return buffer.getvalue()


@pytest.mark.parametrize("data, shown", [
    (b"P6\n9x 80\n255\n" + bytes(96 * 80 * 3), "UnidentifiedImageError"),  # PPM: Pillow read it, failing its own way
    (_dds_with_unknown_flags(), "UnidentifiedImageError"),  # DDS: a NotImplementedError (a 500) once
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "UnidentifiedImageError"),  # EPS: Ghostscript
])
def test_an_upload_in_a_format_the_routes_do_not_take_is_refused_before_pillow_decodes_it(data, shown):
    """Pillow's other formats do not bound their decoding by the declared size (a TIFF tile, EPS's Ghostscript)."""
    with pytest.raises(ValueError, match=rf"^image\[0\]: not a readable image in a format this server takes "
                                         rf"\(PNG, JPEG, WEBP, GIF, (AVIF, )?BMP; {shown}\)$"):
        images.decode_image(data, "image[0]")


def test_a_tiff_is_refused_before_it_is_decoded():
    """2 MB of TIFF declaring one huge deflated tile made libtiff fill 2 GiB, then passed as a 64x64 reference: the
    format itself is refused (any TIFF, this one a plain one)."""
    assert Image.open(io.BytesIO(_tiff())).format == "TIFF"  # a TIFF Pillow itself reads
    with pytest.raises(ValueError, match=r"^image\[0\]: not a readable image in a format this server takes"):
        images.decode_image(_tiff(), "image[0]")


def test_oversized_images_are_named_by_the_upload_limit_however_large():
    with pytest.raises(ValueError, match=r"^image\[0\]: 9000x9000 exceeds the 67108864-pixel upload limit$"):
        images.decode_image(_png_header(9000, 9000), "image[0]")
    # past twice Pillow's own cap it raised first, and the image was called "not a readable image"
    with pytest.raises(ValueError, match=r"^image\[0\]: the image exceeds the 67108864-pixel upload limit \(Image "
                                         r"size \(3600000000 pixels\)"):
        images.decode_image(_png_header(60000, 60000), "image[0]")


def test_a_jpeg_of_more_scans_than_any_encoder_writes_is_refused_before_decoding():
    """Each progressive scan walks every block: a file repeating one scan thousands of times passed the size cap and
    took minutes of CPU in a thread no deadline stops. The count is of start-of-scan markers in the bytes."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buffer, "JPEG", progressive=True)
    progressive = buffer.getvalue()
    assert 2 <= progressive.count(b"\xff\xda") <= 20 and images.decode_image(progressive, "image[0]").size == (64, 64)
    sos = progressive.index(b"\xff\xda")
    end = progressive.index(b"\xff", sos + 4 + int.from_bytes(progressive[sos + 2:sos + 4], "big"))  # one scan's end
    while progressive[end + 1] == 0 or 0xD0 <= progressive[end + 1] <= 0xD7:  # stuffed bytes and restart markers
        end = progressive.index(b"\xff", end + 2)
    bomb = progressive[:end] + progressive[sos:end] * 300 + progressive[end:]
    # a camera's multi-picture JPEG (Pillow's MPO, opened through the JPEG entry) decodes, under the same count
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), "red").save(buffer, "MPO", save_all=True, append_images=[Image.new("RGB", (64, 48))])
    assert images.decode_image(buffer.getvalue(), "image[0]").size == (64, 48)
    with pytest.raises(ValueError, match=r"^image\[0\]: a JPEG of 302 scans"):
        images.decode_image(buffer.getvalue() + b"\xff\xda" * 300, "image[0]")  # (MPO was not counted)
    with pytest.raises(ValueError, match=r"^image\[0\]: a JPEG of 310 scans; this server decodes at most 256$"):
        images.decode_image(bomb, "image[0]")


def test_encode_round_trips_each_format():
    pixels = np.random.RandomState(0).randint(0, 255, (16, 32, 3), dtype=np.uint8)
    for fmt in images.FORMATS:
        data = images.encode_image(pixels, images.output_options(fmt))
        assert Image.open(io.BytesIO(data)).format.lower() == fmt
    assert np.array_equal(np.array(Image.open(io.BytesIO(images.encode_image(pixels, images.OutputOptions())))), pixels)


@pytest.mark.parametrize("route, body, refusal, param", [
    # the walk names its own inputs (num_images, width, reference_images[i]), as a direct Triton client sent them
    ("/v1/images/generations", {"prompt": "x", "n": 9}, "num_images: must be in [1, 4], got 9", "n"),
    ("/generate", {"model": "klein", "text": "x", "model_kwargs": {"n": 9}}, "num_images: must be in [1, 4], got 9",
     "model_kwargs.n"),
    ("/generate", {"model": "klein", "text": "x", "model_kwargs": {"size": "96x80"}}, "width: 96x80 is too large",
     "model_kwargs.size"),
    ("/generate", {"model": "klein", "text": "x", "model_kwargs": {"width": 96, "height": 80}},
     "width: 96x80 is too large", "model_kwargs.width"),
    ("/v1/images/generations", {"prompt": "x", "size": "96x80"}, "width: 96x80 is too large", "size"),
    ("/generate", {"model": "klein", "text": "x"}, "prompt: too long", "text"),
])
def test_the_models_refusals_name_the_field_as_the_client_sent_it(route, body, refusal, param):
    http, _ = client([TritonInvalidRequest(refusal)])
    error = http.post(route, json=body).json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_native_generate_names_its_own_fields_in_the_proxys_refusals():
    http, fake = client()
    for kwargs, param, fragment in (
        ({"text": " "}, "text", "'text' (the prompt) must not be empty"),
        ({"text": "x", "model_kwargs": {"width": -64, "height": 64}}, "model_kwargs.width",
         "model_kwargs.width/height: must be integers in [1, 999999], got -64 and 64"),
        # over six digits it was refused as a size string the client never sent
        ({"text": "x", "model_kwargs": {"width": 1000000, "height": 64}}, "model_kwargs.width",
         "model_kwargs.width/height: must be integers in [1, 999999], got 1000000 and 64"),
        ({"text": "x", "model_kwargs": {"size": "64"}}, "model_kwargs.size",
         "model_kwargs.size: must be 'WIDTHxHEIGHT'"),
        ({"text": "x", "model_kwargs": {"quality": "hd"}}, "model_kwargs.quality", "'model_kwargs.quality' is not"),
        # a modalities list of anything but names (once a 500: unhashable), named as the field it came in
        ({"text": "x", "output_modalities": [["image"]]}, "output_modalities", "must be a list of modality names"),
        ({"text": "x", "input_modalities": "[{\"a\": 1}]"}, "input_modalities", "must be a list of modality names"),
        ({"text": "x", "input_modalities": 3}, "input_modalities", "must be a list of modality names"),
        # the prompt is `text`, and only `text`; a knob given twice under its two names is refused
        ({"text": 5}, "text", "'text' (the prompt) must be a string, got int"),
        ({"text": "x", "model_kwargs": {"prompt": "y"}}, "model_kwargs.prompt", "the prompt goes in 'text'"),
        ({"text": "x", "model_kwargs": {"model": "other"}}, "model_kwargs.model", "not a model_kwargs field"),
        ({"text": "x", "model_kwargs": {"n": 1, "num_images": 2}}, "model_kwargs.num_images", "not both"),
        ({"text": "x", "model_kwargs": []}, "model_kwargs", "must be a JSON object"),
        ({"text": "x", "model_kwargs": 0}, "model_kwargs", "must be a JSON object"),
        ({"text": "x", "streaming": True}, "streaming", "not supported for image output"),
        # strict as the text models' /generate (2 and "maybe" were served as false)
        ({"text": "x", "streaming": 1}, "streaming", "'streaming' must be true or false, got 1"),
        ({"text": "x", "streaming": 2}, "streaming", "'streaming' must be true or false, got 2"),
        ({"text": "x", "streaming": "maybe"}, "streaming", "'streaming' must be true or false, got 'maybe'"),
        # the image count is named as sent (it was model_kwargs.n for a num_images the client sent)
        ({"text": "x", "model_kwargs": {"num_images": "two"}}, "model_kwargs.num_images", "valid integer"),
        ({"text": "x", "model_kwargs": {"n": "two"}}, "model_kwargs.n", "valid integer"),
    ):
        error = http.post("/generate", json={"model": "klein", **kwargs}).json()["error"]
        assert error["param"] == param and fragment in error["message"], error
    assert fake.requests == []
    reply = http.post("/generate", json={"model": "klein", "text": "x", "model_kwargs": {"num_images": 2}})
    assert reply.status_code == 200 and sent(fake)["num_images"] == [2]


@pytest.mark.parametrize("value", [0, 0.0])
def test_guidance_scale_zero_is_what_runs_and_passes(value):
    """Z-Image-Turbo's card calls its pipeline with guidance_scale=0.0 (diffusers' 'no CFG', what these distilled
    models do); it was a 400. Anything above 0 is still refused."""
    http, fake = client()
    reply = http.post("/v1/images/generations", json={"model": "klein", "prompt": "x", "guidance_scale": value})
    assert reply.status_code == 200, reply.text
    assert "guidance_scale" not in sent(fake)
    form = http.post("/v1/images/edits", data={"prompt": "x", "guidance_scale": "0"},
                     files=[("image", ("a.png", png(), "image/png"))])
    assert form.status_code == 200, form.text
    stream = http.post("/v1/images/generations", json={"model": "klein", "prompt": "x", "stream": False})
    assert stream.status_code == 200, stream.text


def test_native_generate_names_the_uploads_files_and_takes_a_forms_streaming_flag():
    """/generate's uploads are `files` (docs/flux2_klein.md): too many, or one the model cannot read, was a 400
    naming `image`/`image[0]`, fields the client never sent."""
    http, fake = client([TritonInvalidRequest("reference_images[0]: not a readable image")])
    five = [("files", ("a.png", png(), "image/png"))] * 5
    error = http.post("/generate", data={"text": "x"}, files=five).json()["error"]
    assert error["param"] == "files" and error["message"].startswith("'files': at most 4 reference images")
    error = http.post("/generate", data={"text": "x"}, files=five[:1]).json()["error"]
    assert error["param"] == "files[0]" and error["message"] == "files[0]: not a readable image"
    # the OpenAI route keeps OpenAI's name for the same refusals
    error = http.post("/v1/images/edits", data={"prompt": "x"},
                      files=[("image[]", ("a.png", png(), "image/png"))] * 5).json()["error"]
    assert error["param"] == "image"
    http, fake = client([TritonInvalidRequest("reference_images[0]: not a readable image")])
    error = http.post("/v1/images/edits", data={"prompt": "x"},
                      files=[("image[]", ("a.png", png(), "image/png"))]).json()["error"]
    assert error["param"] == "image[0]" and error["message"] == "image[0]: not a readable image"
    http, fake = client()
    for value, status in (("false", 200), ("true", 400), ("maybe", 400)):
        reply = http.post("/generate", data={"text": "x", "streaming": value}, files=five[:1])
        assert reply.status_code == status, (value, reply.text)


def test_a_deployment_cannot_ask_more_references_than_uploads_can_carry():
    """The proxy takes four uploads (the model's limit); a deployment's max_reference_images of 8 was accepted and
    could never be used over HTTP."""
    from mstar_common.config import DeploymentError
    from mstar_common.families.flux2_klein.options import options_from_kwargs

    assert options_from_kwargs({"max_reference_images": 4}, "x").max_reference_images == 4
    assert options_from_kwargs({"max_reference_images": 2}, "x").max_reference_images == 2
    with pytest.raises(DeploymentError, match=r"x: model_kwargs.max_reference_images: at most 4"):
        options_from_kwargs({"max_reference_images": 5}, "x")


@pytest.mark.parametrize("path, field", [("/v1/images/generations", "prompt"), ("/generate", "text")])
def test_a_body_sent_as_text_plain_in_utf16_is_refused_not_a_server_error(path, field):
    """The image routes read a body of any content type as JSON; json.loads decoded UTF-16 itself, and a lone
    surrogate in the prompt failed at its encode (a 500)."""
    http, fake = client()
    raw = ('{"model": "klein", "%s": "a\ud800"}' % field).encode("utf-16-le", "surrogatepass")
    reply = http.post(path, content=raw, headers={"content-type": "text/plain"})
    assert reply.status_code == 400 and "not UTF-8 text" in reply.json()["error"]["message"], reply.text
    assert fake.requests == []


def test_an_edits_forms_harmless_values_pass_as_the_docs_list_them():
    """Form values were compared as strings: `stream=False` (what `requests` sends for False), `stream=0` and
    `guidance_scale=0.00` were refused as unsupported though flux2_klein.md lists false and 0 as accepted."""
    http, fake = client()
    files = [("image", ("a.png", png(), "image/png"))]
    for fields in ({"stream": "False"}, {"stream": "0"}, {"stream": "off"}, {"guidance_scale": "0.00"},
                   {"partial_images": "0"}):
        reply = http.post("/v1/images/edits", data={"prompt": "blue", **fields}, files=files)
        assert reply.status_code == 200, (fields, reply.text)
    for fields, param in (({"stream": "true"}, "stream"), ({"guidance_scale": "3.5"}, "guidance_scale"),
                          ({"guidance_scale": "nan"}, "guidance_scale"), ({"stream": "maybe"}, "stream")):
        reply = http.post("/v1/images/edits", data={"prompt": "blue", **fields}, files=files)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (fields, reply.text)
    assert len(fake.requests) == 5
