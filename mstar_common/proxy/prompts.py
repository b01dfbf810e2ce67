"""Tokenizing a text model's prompts in the proxy, so the entry model receives token ids.

The entry model can tokenize (native Triton clients send it text or chat messages), but there the tokenizer runs
in the component's process, where it competes for the GIL with the step loop and the output pump. On the H200 a
512-token prompt sent as text instead of ids cost one stream ~1.1 ms of TTFT (with the 0.5 ms switch interval),
and at 64 streams about half of the proxy path's throughput gap to Triton (docs/benchmarks.md, the proxy at 64
streams). The proxy process has the CPU to spare, so where a deployment lets it (`server.tokenize_in_proxy`, on by
default) it loads the checkpoint's tokenizer and sends `input_ids`: the same tokenizer, the same calls
(`mstar_common.families.text`: `encode` without special tokens for a raw prompt, the chat template with the
generation prompt for messages), so the model sees the same ids either way.

The refusals the entry model would give are given here, naming the client's field: a prompt of more bytes than
`max_model_len` tokens can stand for (refused before tokenizing), an empty prompt, and a prompt that leaves no
room for output. Tokenizing runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mstar_common.families.text import chat_prompt_ids, max_text_bytes_for, messages_bytes_limit
from mstar_common.proxy.errors import invalid_request
from mstar_common.proxy.triton_stream import GenerationRequest


class PromptEncoder:
    """One text model's tokenizer in the proxy, with its `max_model_len`."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_text_bytes = max_text_bytes_for(tokenizer, max_model_len)

    @classmethod
    def load(cls, directory: str, max_model_len: int) -> PromptEncoder:
        """The tokenizer of the checkpoint at `directory` (what the entry model loads; offline)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(directory), max_model_len)

    def encode(self, gen: GenerationRequest, param: str) -> GenerationRequest:
        """`gen` with its text or messages replaced by their token ids; `param` is the client's field for them
        (named in a refusal). A request that already carries ids, or neither, comes back as it is."""
        if gen.input_ids is not None or (gen.text is None and gen.messages is None):
            return gen
        if gen.text is not None:
            self._check_size(len(gen.text.encode("utf-8")), self.max_text_bytes, param)
            ids = self.tokenizer.encode(gen.text, add_special_tokens=False)
        else:
            size = len(json.dumps(gen.messages, ensure_ascii=False).encode("utf-8"))
            self._check_size(size, messages_bytes_limit(self.max_text_bytes), param)
            ids = self._chat_ids(gen, param)
        if not ids:
            raise invalid_request(f"{param}: must not be empty", param=param)
        if len(ids) >= self.max_model_len:
            raise invalid_request(f"{param}: {len(ids)} tokens leave no room for output within "
                                  f"max_model_len={self.max_model_len}", param=param)
        return dataclasses.replace(gen, text=None, messages=None, chat_template_kwargs=None, input_ids=list(ids))

    def _check_size(self, size: int, limit: int, param: str) -> None:
        if size > limit:
            raise invalid_request(f"{param}: {size} bytes cannot fit max_model_len={self.max_model_len} tokens "
                                  f"(at most {limit} bytes)", param=param)

    def _chat_ids(self, gen: GenerationRequest, param: str) -> list[int]:
        from jinja2 import TemplateError

        try:
            return chat_prompt_ids(self.tokenizer, gen.messages, gen.chat_template_kwargs or {})
        except ValueError as exc:  # the messages' shape, or no chat template; the message names the field
            message = str(exc)
            if message.startswith("messages"):  # the client's name for them: messages[2].role -> param[2].role
                message = param + message.removeprefix("messages")
            raise invalid_request(message, param=param) from None
        except TemplateError as exc:  # the checkpoint's template refused these messages (raise_exception)
            raise invalid_request(f"{param}: the chat template refused them: {exc}", param=param) from None


def load_encoders(models: list[Any]) -> dict[str, PromptEncoder]:
    """A `PromptEncoder` per served model that names a tokenizer (`ServedModel.tokenizer`), by model name. A
    tokenizer that cannot load stops the proxy at startup, naming the model."""
    encoders = {}
    for model in models:
        if model.tokenizer is None:
            continue
        try:
            encoders[model.name] = PromptEncoder.load(model.tokenizer, model.max_model_len)
        except Exception as exc:  # noqa: BLE001 - any failure to load is a bad deployment
            raise ValueError(f"model {model.name!r}: cannot load the tokenizer at {model.tokenizer}: {exc}") from exc
    return encoders

