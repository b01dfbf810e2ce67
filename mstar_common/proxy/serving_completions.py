"""POST /v1/completions: raw-prompt completion (no chat template) over a text family's entry model; the prompt is a
string or token ids."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from mstar_common import wire
from mstar_common.engine.types import INT32_MAX
from mstar_common.proxy import protocol
from mstar_common.proxy.errors import invalid_request
from mstar_common.proxy.serving_common import Completion, ServingContext
from mstar_common.proxy.sse import SSEResponse, sse_body
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

router = APIRouter()


def _prompt(prompt: object) -> dict[str, str | list[int]]:
    """One prompt: a string, or token ids (as vLLM takes them), either alone or as a list's only item.
    Returns the `GenerationRequest` field it fills."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i <= INT32_MAX for i in prompt):  # the entry model holds the vocabulary's own bound
            raise invalid_request(f"prompt: token ids must be in [0, {INT32_MAX}]", param="prompt")
        return {"input_ids": list(prompt)}
    if isinstance(prompt, list) and not prompt:
        raise invalid_request("prompt: must not be empty", param="prompt")
    raise invalid_request("'prompt' must be one prompt: a string or a list of token ids (or a list holding one of "
                          "them); batched prompts are not served", param="prompt")


def completion_generation(body: protocol.CompletionRequest) -> GenerationRequest:
    protocol.refuse_unsupported_completion(body)
    gen = body.to_generation(**_prompt(body.prompt))
    gen.field_names = {wire.TEXT_INPUT: "prompt", wire.INPUT_IDS: "prompt"}
    return gen


@router.post("/v1/completions")
async def create_completion(body: protocol.CompletionRequest, request: Request):
    ctx: ServingContext = request.app.state.serving
    served = ctx.resolve(body.model)
    gen = completion_generation(body)
    rid, created = f"cmpl-{request.state.request_id}", protocol.now()
    if body.stream:
        stream = await ctx.stream(request, served, gen)
        events = _chunks(stream, rid, body.model, created, body.include_usage, body.continuous_usage)
        return SSEResponse(sse_body(events, ctx.settings.request_timeout_s))
    done = await ctx.complete(request, served, gen)
    return protocol.text_completion(rid, body.model, created, done.text, done.finish, done.usage)


async def _chunks(stream: AsyncIterator[StreamResponse], rid: str, model: str, created: int, include_usage: bool,
                  continuous_usage: bool = False):
    """text chunks -> finish chunk [-> usage chunk]. With `continuous_usage` the text and finish chunks also carry
    the usage so far."""
    done = Completion()

    def chunk(text: str, finish: str | None = None) -> dict:
        body = protocol.text_completion(rid, model, created, text, finish)
        if include_usage:  # OpenAI: with include_usage every other chunk has "usage": null
            body["usage"] = done.usage if continuous_usage else None
        return body

    try:
        async for response in stream:
            done.add(response)
            if response.text:
                yield chunk(response.text)
        yield chunk("", done.finish)
        if include_usage:
            yield protocol.usage_chunk(rid, model, created, "text_completion", done.usage)
    finally:
        await stream.aclose()
