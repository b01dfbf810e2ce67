"""POST /generate: the native route, as a multipart form or a JSON body.

Fields: `text`, `model` (optional when one model is served), `streaming`, `input_modalities`,
`output_modalities`, `model_kwargs` (a JSON object, or a JSON string of one: generation knobs, `messages`,
`chat_template_kwargs`, `enable_thinking`, `return_token_ids`). `text` is sent as one user message, so the
checkpoint's chat template applies; `model_kwargs.messages` replaces it with a whole conversation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from mstar_common import wire
from mstar_common.proxy import protocol, serving_images, serving_speech, serving_transcriptions
from mstar_common.proxy.errors import from_pydantic, invalid_request, parse_json
from mstar_common.proxy.serving_common import (
    FORM_TYPES,
    MODALITY_FIELDS,
    Completion,
    ServingContext,
    form_bool,
    form_modalities,
    generate_model,
    read_utf8_form,
    requested_model,
)
from mstar_common.proxy.sse import SSEResponse, sse_body
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

router = APIRouter()

TEXT_MODALITIES = ["text"]


# reading the body


def _json_object(raw: str | bytes, field: str) -> dict[str, Any]:
    value = parse_json(raw, f"'{field}'", param=None if field == "body" else field)  # the body's fields: their names
    if not isinstance(value, dict):
        raise invalid_request(f"'{field}' must be a JSON object, got {type(value).__name__}", param=field)
    return value


async def _form_fields(request: Request, kind: str) -> dict[str, Any]:
    form = await read_utf8_form(request)
    fields: dict[str, Any] = {}
    for key in dict.fromkeys(form.keys()):
        values = form.getlist(key)
        if any(isinstance(v, UploadFile) for v in values):
            raise invalid_request(f"'{key}': media uploads are not supported: the model is a {kind} model (uploads go "
                                  "to transcription and image models)", param=key)
        if key in MODALITY_FIELDS:
            fields[key] = form_modalities(values, key)
        elif len(values) > 1:
            raise invalid_request(f"'{key}' was sent {len(values)} times; send it once", param=key)
        elif key == "streaming":
            fields[key] = form_bool(values[0], key)
        elif key == "model_kwargs":
            fields[key] = _json_object(values[0], key) if values[0].strip() else {}
        else:
            fields[key] = values[0]
    return fields


async def read_generate_request(request: Request, kind: str = "text") -> protocol.GenerateRequest:
    """The body of a /generate for a text or speech model (`kind`, which a refused upload names)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in FORM_TYPES:
        fields = await _form_fields(request, kind)
    else:
        fields = _json_object(await request.body(), "body")
        if isinstance(fields.get("model_kwargs"), str):
            fields["model_kwargs"] = _json_object(fields["model_kwargs"], "model_kwargs")
    try:
        return protocol.GenerateRequest.model_validate(fields)
    except ValidationError as error:
        raise from_pydantic(error) from None


# building the Triton request


def _check_modalities(req: protocol.GenerateRequest, model: str) -> None:
    for field in MODALITY_FIELDS:
        values = getattr(req, field)
        if values is not None and (not values or set(values) - set(TEXT_MODALITIES)):
            raise invalid_request(f"'{field}': model '{model}' supports only {TEXT_MODALITIES}, got {values}",
                                  param=field)


def generate_generation(req: protocol.GenerateRequest, model: str) -> GenerationRequest:
    _check_modalities(req, model)
    kwargs = req.model_kwargs
    if kwargs.voice is not None:
        raise invalid_request(f"'model_kwargs.voice': model '{model}' is a text model", param="model_kwargs.voice")
    if kwargs.messages is not None:
        if req.text:
            raise invalid_request("send either 'text' or 'model_kwargs.messages', not both", param="text")
        messages = protocol.text_messages(kwargs.messages, model, field="model_kwargs.messages")
    elif req.text is None:
        raise invalid_request("'text' is required (or 'model_kwargs.messages')", param="text")
    else:
        messages = [{"role": "user", "content": req.text}]
    gen = kwargs.to_generation(
        messages=messages, chat_template_kwargs=protocol.template_kwargs(kwargs.chat_template_kwargs,
                                                                        kwargs.enable_thinking,
                                                                        "model_kwargs.chat_template_kwargs")
    )
    prompt_field = "model_kwargs.messages" if kwargs.messages is not None else "text"
    gen.field_names = {**protocol.GenerateKwargs.field_names(), "prompt": prompt_field, wire.MESSAGES: prompt_field,
                       **protocol.thinking_shortcut_names(kwargs.chat_template_kwargs, kwargs.enable_thinking,
                                                          "model_kwargs.enable_thinking")}
    return gen


@router.post("/generate")
async def generate(request: Request):
    ctx: ServingContext = request.app.state.serving
    if (image_model := await generate_model(request, ctx, serving_images.IMAGE_KINDS)) is not None:
        return await serving_images.generate_native(request, ctx, image_model)
    if (asr_model := await generate_model(request, ctx, serving_transcriptions.TRANSCRIPTION_KINDS)) is not None:
        return await serving_transcriptions.generate_native(request, ctx, asr_model)
    # A 404 naming an unknown model, and the 400 of one left out where several are served, before the body's parse
    # as a text model's (which refused an upload for a transcription or image model as text-only).
    if (name := await requested_model(request)) is None and len(ctx.models) > 1:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in FORM_TYPES:  # a body that cannot be read says so, not that `model` is missing
            _json_object(await request.body(), "body")
        ctx.resolve(None)
    if isinstance(name, str) and name not in ctx.models:
        ctx.resolve(name)
    target = name if isinstance(name, str) else next(iter(ctx.models)) if len(ctx.models) == 1 else None
    req = await read_generate_request(request, ctx.models[target].kind if target is not None else "text")
    served = ctx.resolve(req.model, kinds=("text", *serving_speech.SPEECH_KINDS))
    if served.kind in serving_speech.SPEECH_KINDS:
        return await serving_speech.generate_speech(request, ctx, served, req)
    gen = generate_generation(req, served.name)
    rid, with_ids = request.state.request_id, req.model_kwargs.return_token_ids
    if req.streaming:
        stream = await ctx.stream(request, served, gen)
        return SSEResponse(sse_body(_events(stream, with_ids), ctx.settings.request_timeout_s))
    done = await ctx.complete(request, served, gen)
    body = {"id": rid, "model": served.name, "outputs": {"text": [done.text]}, "finish_reason": done.finish,
            "usage": done.usage}
    if with_ids:
        body["token_ids"] = done.token_ids
    return body


async def _events(stream: AsyncIterator[StreamResponse], with_ids: bool):
    """{"text", "token_ids"?} per response -> {"finish_reason", "usage"}."""
    done = Completion()
    try:
        async for response in stream:
            done.add(response)
            if response.text or (with_ids and response.token_ids):
                event: dict[str, Any] = {"text": response.text}
                if with_ids:
                    event["token_ids"] = response.token_ids
                yield event
        yield {"finish_reason": done.finish, "usage": done.usage}
    finally:
        await stream.aclose()
