"""The text-generation component shared by causal-LM families (Qwen3 now; Llama-style backbones later).

It turns wire inputs (numpy arrays keyed by tensor name, see mstar_common/wire.py) into prompt ids and
SamplingParams, refusing bad input with a ValueError that names the field and the rule, and bundles the
engine with the checkpoint's tokenizer for the Triton node.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError, TemplateSyntaxError, meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mstar_common import wire
from mstar_common.engine.stop_strings import validate_stops
from mstar_common.engine.types import SamplingParams
from mstar_common.graph import TensorSpec

TEXT_LM_INPUTS = (
    TensorSpec(wire.TEXT_INPUT, "BYTES"),
    TensorSpec(wire.MESSAGES, "BYTES"),
    TensorSpec(wire.INPUT_IDS, "INT32", (-1,)),
    TensorSpec(wire.CHAT_TEMPLATE_KWARGS, "BYTES"),
    *(TensorSpec(name, dtype) for name, (dtype, _) in wire.SAMPLING_INPUTS.items()),
    TensorSpec(wire.STOP, "BYTES", (-1,)),
    TensorSpec(wire.STOP_TOKEN_IDS, "INT32", (-1,)),
)
TEXT_LM_OUTPUTS = (
    TensorSpec(wire.TEXT_OUTPUT, "BYTES"),
    TensorSpec(wire.TOKEN_IDS, "INT32", (-1,)),
    TensorSpec(wire.FINISH_REASON, "BYTES"),
    TensorSpec(wire.PROMPT_TOKENS, "INT32"),
    TensorSpec(wire.COMPLETION_TOKENS, "INT32"),
)

MAX_STOP_TOKEN_IDS = 64


@dataclass(slots=True)
class TextRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)


# generation_config.json's sampling fields a request that sets none takes (model_kwargs.generation_config: auto)
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_sampling_defaults(gen_config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a checkpoint recommends: the `SAMPLING_DEFAULT_FIELDS` its generation_config.json
    sets, as vLLM's `--generation-config auto` reads them (`do_sample` is not read, as vLLM does not). ValueError
    naming the field where a value breaks the request rules (top_p 0, a temperature that is not a number, ...)."""
    found = {name: gen_config[name] for name in SAMPLING_DEFAULT_FIELDS if gen_config.get(name) is not None}
    for name, value in found.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: must be a number, got {value!r}")
    defaults = {name: float(value) for name, value in found.items() if name != "top_k"}
    if "top_k" in found:  # a count: 20.0 reads as 20; 20.5 is left for validate() to refuse, not truncated
        top_k = found["top_k"]
        defaults["top_k"] = int(top_k) if isinstance(top_k, float) and top_k.is_integer() else top_k
    SamplingParams(**defaults).validate()
    return defaults


@dataclass(slots=True)
class TextLMRuntime:
    """What a text LM Triton instance runs: the engine and the tokenizer that frames its requests."""

    engine: Any  # mstar_common.engine.ar_engine.AREngine
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    default_max_tokens: int | None  # None: a request that sets no max_tokens runs to the room its prompt leaves
    max_text_bytes: int = 0  # a prompt text longer than this cannot fit max_model_len; 0: from the tokenizer
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # for knobs a request leaves unset

    def __post_init__(self) -> None:
        if not self.max_text_bytes:
            self.max_text_bytes = self.max_model_len * max_token_bytes(self.tokenizer)

    def parse_request(self, inputs: dict[str, np.ndarray]) -> TextRequest:
        prompt_ids = self._prompt_ids(inputs)
        # named as the input that held it (a direct Triton client sent that tensor; the proxy renames it)
        field = next(name for name in (wire.MESSAGES, wire.TEXT_INPUT, wire.INPUT_IDS) if name in inputs)
        if not prompt_ids:
            raise ValueError(f"{field}: must not be empty")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"{field}: {len(prompt_ids)} tokens leave no room for output within max_model_len={self.max_model_len}"
            )
        cap = room if self.default_max_tokens is None else min(self.default_max_tokens, room)
        params = sampling_params_from_inputs(inputs, default_max_tokens=cap,
                                             defaults=self.sampling_defaults)
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens: {params.max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds "
                f"max_model_len={self.max_model_len} (at most {room})"
            )
        params.validate(self.vocab_size)
        stops = [_decode(s, wire.STOP) for s in inputs[wire.STOP].reshape(-1)] if wire.STOP in inputs else []
        validate_stops(stops)
        return TextRequest(prompt_ids, params, stops)

    def _prompt_ids(self, inputs: dict[str, np.ndarray]) -> list[int]:
        given = [n for n in (wire.TEXT_INPUT, wire.MESSAGES, wire.INPUT_IDS) if n in inputs]
        if len(given) != 1:
            raise ValueError(f"prompt: give exactly one of text_input, messages, input_ids (got {given or 'none'})")
        self._check_prompt_size(inputs)
        if wire.CHAT_TEMPLATE_KWARGS in inputs and wire.MESSAGES not in inputs:
            raise ValueError(f"{wire.CHAT_TEMPLATE_KWARGS}: applies only to a messages prompt (the chat template is "
                             f"not used for {given[0]})")
        if wire.INPUT_IDS in inputs:
            ids = [int(i) for i in inputs[wire.INPUT_IDS].reshape(-1)]
            if bad := [i for i in ids if not 0 <= i < self.vocab_size]:
                raise ValueError(f"input_ids: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
            return ids
        if wire.TEXT_INPUT in inputs:
            # As the tokenizer's own call frames a text (transformers' `tokenizer(text)`, vLLM's completions): with
            # the BOS a Llama tokenizer adds (<|begin_of_text|>); Qwen3's adds none. A chat template writes its own.
            return list(self.tokenizer.encode(_scalar_text(inputs, wire.TEXT_INPUT), add_special_tokens=True))
        messages = _json(inputs, wire.MESSAGES)
        template_kwargs = _json(inputs, wire.CHAT_TEMPLATE_KWARGS) if wire.CHAT_TEMPLATE_KWARGS in inputs else {}
        template_kwargs = wire.check_chat_template_kwargs(template_kwargs)
        return chat_prompt_ids(self.tokenizer, messages, template_kwargs)

    def _check_prompt_size(self, inputs: dict[str, np.ndarray]) -> None:
        """Refuse a prompt that cannot fit max_model_len before spending time on it (tokenizing 16 MB of text
        would stall this instance's request intake)."""
        if wire.INPUT_IDS in inputs and inputs[wire.INPUT_IDS].size >= self.max_model_len:
            raise ValueError(f"input_ids: {inputs[wire.INPUT_IDS].size} ids leave no room for output within "
                             f"max_model_len={self.max_model_len}")
        # JSON may escape every character as \uXXXX (6 bytes); the chat template adds a little.
        limits = {wire.TEXT_INPUT: self.max_text_bytes, wire.MESSAGES: 6 * self.max_text_bytes + 65536}
        for name, limit in limits.items():
            if name in inputs:
                size = sum(len(v) if isinstance(v, bytes) else len(str(v)) for v in inputs[name].reshape(-1))
                if size > limit:
                    raise ValueError(f"{name}: {size} bytes cannot fit max_model_len={self.max_model_len} tokens "
                                     f"(at most {limit} bytes)")


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes one token stands for (byte-level BPE maps each byte to one char)."""
    try:
        return max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return 1024


def check_text_fits(text: str, field: str, max_tokens: int, max_bytes: int) -> None:
    """Refuse a text that cannot tokenize to `max_tokens` tokens or fewer (more than `max_bytes`, i.e. `max_tokens x
    max_token_bytes`, UTF-8 bytes) before tokenizing it: a tokenizer reads ~1 MB a second, so a 16 MB text held the
    thread (a walk's event loop, a component's intake) for ~20 s only to be refused by its token count."""
    if (size := len(text.encode("utf-8"))) > max_bytes:
        raise ValueError(f"{field}: {size} bytes cannot fit {max_tokens} tokens (at most {max_bytes} bytes)")


# what apply_chat_template itself gives every template, beside its own arguments (wire.RESERVED_TEMPLATE_KWARGS)
_GIVEN_TO_TEMPLATES = frozenset({"raise_exception", "strftime_now"})


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """(the names a chat template reads from its context, those of them it may overwrite before reading), or None
    where this environment cannot parse it (a template that needs an extension of transformers'), in which case no
    variable is checked.

    The first are jinja2's undeclared variables: the messages, the special tokens, its own switches such as
    Qwen3's `enable_thinking`. jinja2 counts a name the template sets itself (`{% set content = ... %}` in both
    branches of an if) and then reads too: such a name, unless the template asks whether it was given (`is
    defined`, `| default(...)`, as Llama 3's `date_string`), is the second kind, which only a render can tell
    apart (`check_overwritten`)."""
    environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = environment.parse(source)
    except TemplateSyntaxError:
        return None

    def names(target: nodes.Node) -> set[str]:  # `x`, or each name of `a, b`
        return {target.name} if isinstance(target, nodes.Name) else {n.name for n in target.find_all(nodes.Name)}

    set_here = {name for assign in tree.find_all((nodes.Assign, nodes.AssignBlock)) for name in names(assign.target)}
    asked = {test.node.name for test in tree.find_all(nodes.Test)
             if test.name == "defined" and isinstance(test.node, nodes.Name)}
    asked |= {f.node.name for f in tree.find_all(nodes.Filter)
              if f.name in ("default", "d") and isinstance(f.node, nodes.Name)}
    read = frozenset(meta.find_undeclared_variables(tree))
    return read, read & frozenset(set_here - asked)


def _unread(name: str, known: tuple[frozenset[str], frozenset[str]]) -> ValueError:
    read, overwritten = known
    own = sorted(n for n in read - overwritten - wire.RESERVED_TEMPLATE_KWARGS - _GIVEN_TO_TEMPLATES
                 if not n.endswith("_token"))
    return ValueError(f"{wire.CHAT_TEMPLATE_KWARGS}.{name}: this checkpoint's chat template has no variable "
                      f"'{name}' (it would be ignored); its own variables: {', '.join(own) or 'none'}")


def check_template_variables(template: Any, template_kwargs: dict[str, Any]) -> None:
    """Refuse a `chat_template_kwargs` entry the checkpoint's template never reads: a misspelt switch
    (`enable_thinkng`) would otherwise be ignored without a word, the prompt the same as without it."""
    known = template_variables(template) if isinstance(template, str) else None
    if known is not None and (unread := sorted(set(template_kwargs) - known[0])):
        raise _unread(unread[0], known)


def check_overwritten(template: Any, template_kwargs: dict[str, Any], render: Any, text: str) -> None:
    """Refuse an entry the template may set itself before reading it (Qwen3's `content`) where it does: `text` (the
    prompt with the client's value) is the same with the variable null or two other strings. One the template reads
    first (`{% if style %}{% set style = style | upper %}`, `{% set thinking = thinking or false %}`) changes the
    prompt with some value, and stays; so does one whose probe the template cannot render (it reads the value)."""
    known = template_variables(template) if isinstance(template, str) else None
    for name in sorted(set(template_kwargs) & known[1]) if known is not None else ():
        try:
            same = all(render({**template_kwargs, name: value}) == text
                       for value in (None, "\x00mstar-probe-1", "\x00mstar-probe-2"))
        except Exception:  # noqa: BLE001 - a filter that takes no string (dictsort): the template reads the value
            continue
        if same:
            raise _unread(name, known)


def chat_prompt_ids(tokenizer: Any, messages: Any, template_kwargs: dict[str, Any]) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages[{i}]: must be an object with a string 'role'")
        if msg["role"] not in ("system", "user", "assistant", "developer"):
            raise ValueError(f"messages[{i}].role: must be system, user, assistant or developer, got {msg['role']!r}")
        if extra := sorted(set(msg) - {"role", "content", "name"}):
            rule = "tool calling is not available" if extra[0] in ("tool_calls", "tool_call_id") else \
                "a message is its role, content and name only"
            raise ValueError(f"messages[{i}].{wire.loggable(extra[0], 100)}: not accepted ({rule})")
        if not isinstance(msg.get("content"), str):
            raise ValueError(f"messages[{i}].content: must be a string for a text-only model")
        for key in ("content", "name"):
            if isinstance(msg.get(key), str) and not wire.is_unicode_text(msg[key]):
                raise ValueError(f"messages[{i}].{key}: {wire.NOT_UNICODE_RULE}")
    if getattr(tokenizer, "chat_template", None) is None:
        # (named for every client: the proxy's `text_input` is `/v1/completions`' `prompt`, a Triton client's the
        # tensor; `/generate`'s `text` is always a chat message, so the route to name is /v1/completions)
        raise ValueError("messages: this checkpoint has no chat template, so it takes a raw prompt only: "
                         "/v1/completions' `prompt` (or the `text_input` tensor, sent to Triton directly)")
    check_template_variables(tokenizer.chat_template, template_kwargs)

    def render(conversation: list[dict], variables: dict[str, Any] = template_kwargs) -> str:
        try:
            return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                 **variables)
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError) as exc:
            # The checkpoint's template rejected this conversation or these variables (its raise_exception, a bad
            # operand from a client value): the request's fault, said in the template's own words.
            raise ValueError(f"messages: the checkpoint's chat template refused this request: {exc}") from None

    # OpenAI's `developer` is its `system` (the proxy maps it too): a template knows no `developer` role, and
    # Qwen3's drops a message of a role it does not know without a word
    messages = [{**msg, "role": "system"} if msg["role"] == "developer" else msg for msg in messages]
    text = render(messages)
    check_overwritten(tokenizer.chat_template, template_kwargs, lambda variables: render(messages, variables), text)
    named = [i for i, msg in enumerate(messages) if msg.get("name") is not None]
    if named and render([{k: v for k, v in msg.items() if k != "name"} for msg in messages]) == text:
        # a participant's name the template drops would be ignored without a word
        raise ValueError(f"messages[{named[0]}].name: this checkpoint's chat template does not use participant "
                         f"names (the prompt is the same without them); leave the field out")
    return list(tokenizer.encode(text, add_special_tokens=False))


def sampling_params_from_inputs(inputs: dict[str, np.ndarray], default_max_tokens: int,
                                defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The request's sampling knobs; one it leaves unset takes `defaults` (the checkpoint's), else the engine's."""
    values: dict[str, Any] = {"max_tokens": default_max_tokens, **(defaults or {})}
    for name in wire.SAMPLING_INPUTS:
        if name in inputs:
            arr = inputs[name].reshape(-1)
            if arr.size != 1:
                raise ValueError(f"{name}: expected one value, got {arr.size}")
            values[name] = arr[0].item()
    if wire.STOP_TOKEN_IDS in inputs:
        ids = [int(i) for i in inputs[wire.STOP_TOKEN_IDS].reshape(-1)]
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        values["stop_token_ids"] = ids
    if "ignore_eos" in values:
        values["ignore_eos"] = bool(values["ignore_eos"])
    return SamplingParams(**values)


def _decode(value: Any, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name}: must be UTF-8 text") from None
    return str(value)


def _scalar_text(inputs: dict[str, np.ndarray], name: str) -> str:
    arr = inputs[name].reshape(-1)
    if arr.size != 1:
        raise ValueError(f"{name}: expected one string, got {arr.size}")
    return _decode(arr[0], name)


def _json(inputs: dict[str, np.ndarray], name: str) -> Any:
    text = _scalar_text(inputs, name)  # outside the try: its "must be UTF-8 text" is no digit-limit ValueError
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg})") from None
    except ValueError:  # an int past Python's digit limit (proxy.errors.parse_json says the same)
        raise ValueError(f"{name}: holds a number of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # `[[[[...` past the parser's depth
        raise ValueError(f"{name}: nests arrays or objects too deeply to parse") from None
