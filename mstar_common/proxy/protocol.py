"""Request models (OpenAI and native) and the OpenAI response shapes.

Request models are strict: a number sent as a string, a float for an integer or an unknown field is a 400
naming the field. OpenAI fields the server cannot honour are declared (so they are not "unknown") and
refused by `refuse_unsupported_*` unless they carry their harmless value. `null` means unset.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from mstar_common import wire
from mstar_common.engine.stop_strings import validate_stops
from mstar_common.engine.types import SamplingParams
from mstar_common.proxy.errors import APIError, invalid_request
from mstar_common.proxy.triton_stream import GenerationRequest

_STRICT = ConfigDict(extra="forbid", strict=True)
MEDIA_PART_TYPES = ("image_url", "input_audio", "audio_url", "video_url", "image", "audio", "video", "file")
# FP32 knobs whose rule leaves out 0 (SamplingParams.validate; a penalty below 0.001 is refused as sent)
_ZERO_REFUSED = ("top_p",)


class SamplingFields(BaseModel):
    """Generation knobs shared by every route (top-level fields in OpenAI bodies, `model_kwargs` in /generate)."""

    model_config = _STRICT

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stop: Any = None
    stop_token_ids: list[int] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling_inputs(self, field_names: dict[str, str] | None = None) -> dict[str, int | float | bool]:
        """The set knobs, range-checked with the server's own rules (`SamplingParams.validate`, the stop rules)
        as the server will hold them: FP32 knobs rounded to 32 bits first, so that 1e39 or a min_p of
        0.99999999999 is refused here with the value the client sent. `field_names` renames a field for the
        client (/generate's `model_kwargs.`)."""
        knobs = {name: getattr(self, name) for name in wire.SAMPLING_INPUTS if getattr(self, name) is not None}
        stop_ids = list(self.stop_token_ids or [])

        def refuse(error: ValueError, rounded: bool = False) -> APIError:
            name, rule = str(error).split(": ", 1)
            if rounded:
                rule += f" (as a 32-bit float; {knobs.get(name)!r} was sent)"
            field = (field_names or {}).get(name, name)
            return invalid_request(f"{field}: {rule}", param=field)

        try:  # the values sent: a value that breaks the rule as sent is told so, with no word of rounding
            SamplingParams(**knobs, stop_token_ids=stop_ids).validate()
            validate_stops(self.stop)
        except ValueError as error:
            raise refuse(error) from None
        held = dict(knobs)
        with np.errstate(over="ignore", under="ignore"):
            for name, value in knobs.items():
                if wire.SAMPLING_INPUTS[name][0] == "FP32":
                    held[name] = float(np.float32(value))
                    if held[name] == 0.0 and value != 0:  # e.g. a temperature of 1e-46 would decode greedily
                        field = (field_names or {}).get(name, name)
                        advice = "a larger value" if name in _ZERO_REFUSED else "0 or a larger value"
                        raise invalid_request(f"{field}: {value!r} is 0 as a 32-bit float (the smallest non-zero "
                                              f"is about 1.4e-45); send {advice}", param=field)
        try:  # then as held: a top_p of 1.00000001 is 1.0 as 32 bits, and not in (0, 1]
            SamplingParams(**held, stop_token_ids=stop_ids).validate()
        except ValueError as error:
            raise refuse(error, rounded=True) from None
        return knobs

    @classmethod
    def field_names(cls) -> dict[str, str]:
        """The client's names for the knobs where they differ from the wire's (none at the top level)."""
        return {}

    def to_generation(self, **prompt: Any) -> GenerationRequest:
        return GenerationRequest(
            **prompt,
            sampling=self.sampling_inputs(self.field_names()),
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
        )


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    # the openai package's obfuscation padding of stream events (random characters a client drops): none is added,
    # whichever value, so the field is accepted without effect rather than refused as unknown
    include_obfuscation: bool | None = None


class OpenAIFields(SamplingFields):
    """Fields common to /v1/chat/completions and /v1/completions, harmless ones and refused ones."""

    model: str
    stream: bool | None = None  # null: false
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every content chunk as well (`stream_options.continuous_usage_stats`, as vLLM has it)."""
        return bool(self.include_usage and self.stream_options.continuous_usage_stats)


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Any = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    # fields of an assistant reply that a client sends back as it got it (the SDK's model_dump keeps their nulls)
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        for i, part in enumerate(value):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"part [{i}] must be an object with a string 'type'")
        return value


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def field_names(self) -> dict[str, str]:
        """`max_tokens` is the client's `max_completion_tokens` when that is what it sent."""
        return {"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {}


class CompletionRequest(OpenAIFields):
    prompt: Any
    echo: bool | None = None
    suffix: Any = None
    best_of: int | None = None


def drop_nulls_of_defaulted(model: type[BaseModel], data: Any) -> Any:
    """`null` means unset: a null field that has a default other than None is dropped before validation (a strict
    bool or object field refused it, where the image models' /generate took it)."""
    fields = model.model_fields
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if not (v is None and k in fields and not fields[k].is_required()
                                                      and fields[k].default is not None)}
    return data


class GenerateKwargs(SamplingFields):
    """`model_kwargs` of native /generate."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return drop_nulls_of_defaulted(cls, data)

    @classmethod
    def field_names(cls) -> dict[str, str]:
        """The knobs' names as a /generate client gives them (`max_tokens` -> `model_kwargs.max_tokens`), for
        `GenerationRequest.field_names`."""
        return {name: f"model_kwargs.{name}" for name in cls.model_fields}

    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    return_token_ids: bool = False
    voice: str | None = None  # speech models


class GenerateRequest(BaseModel):
    """Native /generate, after multipart fields are decoded."""

    model_config = _STRICT

    text: str | None = None
    model: str | None = None
    streaming: bool = False
    input_modalities: list[str] | None = None
    output_modalities: list[str] | None = None
    model_kwargs: GenerateKwargs = GenerateKwargs()

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return drop_nulls_of_defaulted(cls, data)


# refusals of OpenAI fields the server cannot honour


def _refuse(field: str, rule: str) -> None:
    raise invalid_request(f"'{field}' is not supported: {rule}", param=field)


def _refuse_common(req: OpenAIFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats and not req.include_usage:
        raise invalid_request("'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true",
                              param="stream_options.continuous_usage_stats")
    if req.n not in (None, 1):
        _refuse("n", f"only one choice per request (n=1), got {req.n}")
    if req.presence_penalty not in (None, 0):
        _refuse("presence_penalty", f"only 0 is served (use repetition_penalty), got {req.presence_penalty}")
    if req.frequency_penalty not in (None, 0):
        _refuse("frequency_penalty", f"only 0 is served (use repetition_penalty), got {req.frequency_penalty}")
    if req.logit_bias not in (None, {}):
        _refuse("logit_bias", "logit biasing is not available")
    if req.service_tier not in (None, "auto", "default"):
        _refuse("service_tier", f"one tier is served ('auto' or 'default'), got {req.service_tier!r}")


def refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    _refuse_common(req)
    if req.logprobs is not None and req.logprobs is not False:  # `0 in (None, False)` holds: 0 passed as false
        _refuse("logprobs", "log-probabilities are not returned by the OpenAI routes")
    if req.top_logprobs is not None:
        _refuse("top_logprobs", "log-probabilities are not returned by the OpenAI routes")
    for name in ("tools", "functions"):
        if getattr(req, name) not in (None, []):
            _refuse(name, "tool calling is not available")
    if req.tool_choice not in (None, "none"):
        _refuse("tool_choice", "tool calling is not available")
    if req.function_call not in (None, "none"):
        _refuse("function_call", "tool calling is not available")
    if req.response_format not in (None, {"type": "text"}):
        _refuse("response_format", "only {'type': 'text'} is served")
    if req.store:
        _refuse("store", "completions are not stored")
    if req.modalities not in (None, ["text"]):
        _refuse("modalities", "only ['text'] is served")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(req, name) is not None:
            _refuse(name, "not available on this server")
    if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
        _refuse("max_completion_tokens", "differs from max_tokens; send one of them")


def refuse_unsupported_completion(req: CompletionRequest) -> None:
    _refuse_common(req)
    if req.logprobs is not None:
        _refuse("logprobs", "log-probabilities are not returned by the OpenAI routes")
    if req.echo:
        _refuse("echo", "the prompt is not echoed")
    if req.suffix is not None:
        _refuse("suffix", "insertion (suffix) is not available")
    if req.best_of not in (None, 1):
        _refuse("best_of", f"only one candidate per request (best_of=1), got {req.best_of}")


# messages -> the entry model's `messages` tensor


def text_messages(messages: list[ChatMessage], model: str, field: str = "messages") -> list[dict[str, Any]]:
    """Plain {role, content[, name]} dicts for a text-only model; media parts and tool turns are 400s."""
    if not messages:
        raise invalid_request(f"'{field}' must hold at least one message", param=field)
    out = []
    for i, msg in enumerate(messages):
        where = f"{field}[{i}]"
        if msg.role in ("tool", "function"):
            _refuse(f"{where}.role", f"'{msg.role}' messages need tool calling, which is not available")
        for name in ("tool_calls", "tool_call_id", "function_call"):
            if getattr(msg, name) is not None:
                _refuse(f"{where}.{name}", "tool calling is not available")
        if msg.audio is not None:
            _refuse(f"{where}.audio", "audio replies are not available")
        if msg.annotations not in (None, []):
            _refuse(f"{where}.annotations", "annotations (citations) are not part of a prompt")
        content = msg.content
        if msg.refusal is not None:  # an assistant's refusal, sent back: its text is what the assistant said
            if msg.role != "assistant" or not isinstance(msg.refusal, str) or content not in (None, ""):
                raise invalid_request(f"'{where}.refusal' must be a string on an assistant message without content",
                                      param=f"{where}.refusal")
            content = msg.refusal
        if content is None:
            raise invalid_request(f"'{where}.content' is required", param=f"{where}.content")
        entry = {"role": "system" if msg.role == "developer" else msg.role,
                 "content": _text_content(content, model, f"{where}.content", msg.role)}
        if msg.name is not None:
            entry["name"] = msg.name
        out.append(entry)
    return out


def _text_content(content: str | list[dict[str, Any]], model: str, where: str, role: str = "user") -> str:
    """The message's text: a string, or its text parts joined (an assistant's `refusal` parts are its text too)."""
    if isinstance(content, str):
        return content
    if not content:  # as OpenAI: a list of parts holds at least one (an empty turn is sent as "")
        raise invalid_request(f"{where}: a list of content parts must hold at least one part", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part["type"]
        if kind in MEDIA_PART_TYPES:
            raise invalid_request(f"'{where}[{j}]': {kind} parts are not supported: model '{model}' is text-only",
                                  param=f"{where}[{j}]")
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != key:
            raise invalid_request(f"'{where}[{j}].type': unknown content part type '{kind}'", param=f"{where}[{j}]")
        if set(part) - {"type", key}:
            extra = sorted(set(part) - {"type", key})[0]
            raise invalid_request(f"unknown field '{where}[{j}].{extra}'", param=f"{where}[{j}].{extra}")
        if not isinstance(part.get(key), str):
            raise invalid_request(f"'{where}[{j}].{key}' must be a string", param=f"{where}[{j}].{key}")
        texts.append(part[key])
    return "\n".join(texts)


def template_kwargs(kwargs: dict[str, Any] | None, enable_thinking: bool | None,
                    field: str = "chat_template_kwargs") -> dict[str, Any] | None:
    """chat_template_kwargs, checked by the component's rule (`wire.check_chat_template_kwargs`), with the
    `enable_thinking` shortcut folded in (a conflict is a 400). `field` is the client's name for the object."""
    try:
        merged = wire.check_chat_template_kwargs(dict(kwargs or {}), field)
    except ValueError as error:
        message = str(error)
        raise invalid_request(message, param=message.split(":", 1)[0]) from None
    if enable_thinking is not None:
        shortcut = "model_kwargs.enable_thinking" if field.startswith("model_kwargs.") else "enable_thinking"
        if merged.get("enable_thinking", enable_thinking) != enable_thinking:
            raise invalid_request(f"'{shortcut}' conflicts with {field}.enable_thinking", param=shortcut)
        merged["enable_thinking"] = enable_thinking
    return merged or None


def thinking_shortcut_names(kwargs: dict[str, Any] | None, enable_thinking: bool | None,
                            shortcut: str) -> dict[str, str]:
    """`field_names` for a refusal of `chat_template_kwargs.enable_thinking` (a template without that variable)
    where the client sent it as the `shortcut` field alone: named as the client sent it."""
    if enable_thinking is None or (kwargs or {}).get("enable_thinking") is not None:  # (null: unset)
        return {}
    return {f"{wire.CHAT_TEMPLATE_KWARGS}.enable_thinking": shortcut}


# OpenAI response shapes


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(rid: str, model: str, created: int, text: str, finish_reason: str, use: dict) -> dict:
    # `refusal` as OpenAI's message has it (null: the model does not refuse through it here)
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}, "logprobs": None,
              "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def text_completion(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    use: dict | None = None) -> dict:
    """A text_completion response or stream chunk (a chunk carries usage only under continuous_usage_stats)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "mstar"}
