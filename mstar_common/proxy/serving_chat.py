"""POST /v1/chat/completions: OpenAI chat over a text family's entry model (chat template applied there)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from mstar_common.proxy import protocol
from mstar_common.proxy.serving_common import Completion, ServingContext
from mstar_common.proxy.sse import SSEResponse, sse_body
from mstar_common.proxy.triton_stream import GenerationRequest, StreamResponse

router = APIRouter()


def chat_generation(body: protocol.ChatCompletionRequest) -> GenerationRequest:
    protocol.refuse_unsupported_chat(body)
    if body.max_tokens is None and body.max_completion_tokens is not None:
        body.max_tokens = body.max_completion_tokens
    gen = body.to_generation(
        messages=protocol.text_messages(body.messages, body.model),
        chat_template_kwargs=protocol.template_kwargs(body.chat_template_kwargs, body.enable_thinking),
    )
    # the entry model's name for the prompt, whatever form it took, and max_completion_tokens where sent
    gen.field_names = {"prompt": "messages", **body.field_names(),
                       **protocol.thinking_shortcut_names(body.chat_template_kwargs, body.enable_thinking,
                                                          "enable_thinking")}
    return gen


@router.post("/v1/chat/completions")
async def create_chat_completion(body: protocol.ChatCompletionRequest, request: Request):
    ctx: ServingContext = request.app.state.serving
    served = ctx.resolve(body.model)
    gen = chat_generation(body)
    rid, created = f"chatcmpl-{request.state.request_id}", protocol.now()
    if body.stream:
        stream = await ctx.stream(request, served, gen)
        events = _chunks(stream, rid, body.model, created, body.include_usage, body.continuous_usage)
        return SSEResponse(sse_body(events, ctx.settings.request_timeout_s))
    done = await ctx.complete(request, served, gen)
    return protocol.chat_completion(rid, body.model, created, done.text, done.finish, done.usage)


async def _chunks(stream: AsyncIterator[StreamResponse], rid: str, model: str, created: int, include_usage: bool,
                  continuous_usage: bool = False):
    """role chunk -> content chunks -> finish chunk [-> usage chunk]. With `continuous_usage` the content and
    finish chunks also carry the usage so far."""
    done = Completion()

    def chunk(delta: dict, finish: str | None = None, counted: bool = True) -> dict:
        body = protocol.chat_chunk(rid, model, created, delta, finish)
        if include_usage:  # OpenAI: with include_usage every other chunk has "usage": null
            body["usage"] = done.usage if continuous_usage and counted else None
        return body

    try:
        yield chunk({"role": "assistant", "content": ""}, counted=False)  # before anything is counted
        async for response in stream:
            done.add(response)
            if response.text:
                yield chunk({"content": response.text})
        yield chunk({}, done.finish)
        if include_usage:
            yield protocol.usage_chunk(rid, model, created, "chat.completion.chunk", done.usage)
    finally:
        await stream.aclose()
