"""Tensor names and error conventions on the wire between clients (proxy, tritonclient) and entry models.

Every text-generating entry model (e.g. `qwen3_llm`) is a decoupled Triton model with these tensors.
Inputs (all optional, shape [1] unless noted; give exactly one of `text_input`, `messages`, `input_ids`):

  text_input          BYTES   raw prompt text (completion style; no chat template)
  messages            BYTES   JSON list of OpenAI-style chat messages; the checkpoint's chat template is applied
  input_ids           INT32   [-1] prompt token ids
  chat_template_kwargs BYTES  JSON object of chat template variables (e.g. {"enable_thinking": false}; rules in
                              check_chat_template_kwargs)
  max_tokens          INT32   default: the room the prompt leaves, capped by the deployment's default
  temperature         FP32    0 = greedy
  top_p               FP32
  top_k               INT32   0 or -1 = off
  min_p               FP32
  repetition_penalty  FP32
  seed                INT64
  ignore_eos          BOOL
  stop                BYTES   [-1] stop strings (excluded from the output)
  stop_token_ids      INT32   [-1]

Outputs, per streamed response (several tokens per response when a stream falls behind):

  text_output         BYTES   [1] new text since the previous response
  token_ids           INT32   [-1] new token ids since the previous response
  finish_reason       BYTES   [1] "" until the last response; then "stop" | "length"
  prompt_tokens       INT32   [1]
  completion_tokens   INT32   [1] tokens generated so far

Speech entry models (e.g. `orpheus_lm`, decoupled) take `text_input` (required), `voice` BYTES [1] (optional; the
deployment's default voice) and the sampling inputs above (`stop`/`stop_token_ids` are not accepted), and stream:

  audio_chunk         INT16   [-1] PCM, mono, little-endian: the audio decoded since the previous response
  sample_rate         INT32   [1]  Hz (24000 for SNAC 24 kHz)
  token_ids           INT32   [-1] LM tokens since the previous response
  finish_reason, prompt_tokens, completion_tokens   as above

A response is sent per codec step that played audio for the stream (several frames when it fell behind); the
last one (COMPLETE_FINAL) carries the finish reason and the audio still owed.

The last response carries the COMPLETE_FINAL flag. A request that fails gets one Triton error whose message
starts with a prefix naming the class of failure, which the proxy maps to an HTTP status:

  invalid_request:    the client's fault: a field broke a rule (400)
  overloaded:         the component's queue is full; retry later (429 with Retry-After)
  unavailable:        waited too long for admission, or the component is draining (503 with Retry-After)
  deadline_exceeded:  the request's server-side deadline passed (504)

Any other error is a server fault whose message carries an error id that is also in the server log (500).
"""

from __future__ import annotations

import math

TEXT_INPUT = "text_input"
MESSAGES = "messages"
INPUT_IDS = "input_ids"
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"
SAMPLING_INPUTS = {
    # name: (Triton dtype, numpy dtype string)
    "max_tokens": ("INT32", "int32"),
    "temperature": ("FP32", "float32"),
    "top_p": ("FP32", "float32"),
    "top_k": ("INT32", "int32"),
    "min_p": ("FP32", "float32"),
    "repetition_penalty": ("FP32", "float32"),
    "seed": ("INT64", "int64"),
    "ignore_eos": ("BOOL", "bool"),
}
STOP = "stop"
VOICE = "voice"
STOP_TOKEN_IDS = "stop_token_ids"

TEXT_OUTPUT = "text_output"
TOKEN_IDS = "token_ids"
FINISH_REASON = "finish_reason"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
AUDIO_CHUNK = "audio_chunk"
SAMPLE_RATE = "sample_rate"

# The codec component's BLS contract (LM node -> codec node, one request per step carrying a batch).
CODEC_WINDOWS = "codec_windows"  # INT32 [N, 4, 7]: N windows of 4 frames of 7 SNAC codes
CODEC_AUDIO = "codec_audio"  # FP32 [N, S]: each window's played frame, S samples

# Image entry models (an image family's walk router, decoupled: gRPC stream_infer; rules in
# mstar_common/images.py). Inputs, all optional
# but the prompt, shape [1]: prompt BYTES, width/height INT32 (pixels), num_images INT32 (OpenAI n), seed INT64,
# num_inference_steps INT32, output_format BYTES (png | jpeg | webp), png_compress_level INT32,
# output_compression INT32; reference_images BYTES [-1] (encoded uploads, in order: editing). One response:
# images BYTES [-1] (encoded, in output_format) and seed INT64 [1] (the seed used; drawn below 2**53 when none was
# given).
IMAGE_INPUTS = {  # name: (Triton dtype, numpy dtype string)
    "prompt": ("BYTES", "object"),
    "width": ("INT32", "int32"),
    "height": ("INT32", "int32"),
    "num_images": ("INT32", "int32"),
    "seed": ("INT64", "int64"),
    "num_inference_steps": ("INT32", "int32"),
    "output_format": ("BYTES", "object"),
    "png_compress_level": ("INT32", "int32"),
    "output_compression": ("INT32", "int32"),
}
REFERENCE_IMAGES = "reference_images"
IMAGES = "images"
IMAGE_SEED = "seed"
# Transcription entry models (e.g. `whisper_walk`; tensors in mstar_common/families/whisper/graph.py) stream
# text_output deltas; their last response adds these:
TRANSCRIPT_LANGUAGE = "language"  # BYTES [1] language code used
TRANSCRIPT_DURATION = "duration"  # FP32 [1] seconds of audio
TRANSCRIPT_SEGMENTS = "segments"  # BYTES [1] JSON list of segments

INVALID_REQUEST_PREFIX = "invalid_request: "
OVERLOADED_PREFIX = "overloaded: "
UNAVAILABLE_PREFIX = "unavailable: "
DEADLINE_PREFIX = "deadline_exceeded: "
SERVER_ERROR_PREFIX = "internal error (error id "
CLIENT_FACING_PREFIXES = (INVALID_REQUEST_PREFIX, OVERLOADED_PREFIX, UNAVAILABLE_PREFIX, DEADLINE_PREFIX)
# a request a component was still working on when it stopped (a text engine's, a denoise or batched component's,
# the codec's): a retryable 503, not a normal end, so the client sends it again
SERVER_STOPPED = f"{UNAVAILABLE_PREFIX}the server stopped before the request finished; send it again"


# What of a client's text an error message or a log line carries: an error that quoted a value in full (a voice, a
# model name, an unknown key) echoed up to the body cap (16 MB) into the response, and into a component's log on
# every refused request; a percent-decoded path or a direct client's request id wrote a newline into a log line
MAX_MESSAGE_CHARS = 2000  # an error's message (the rule is kept: its start and end)
MAX_LOGGED_CHARS = 500  # a client's text in a log line


def clipped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` if it has at most `limit` characters, else its start and end with how much was left out between."""
    if len(text) <= limit:
        return text
    keep = max(limit // 2 - 20, 1)
    return f"{text[:keep]} ...[{len(text) - 2 * keep:,} characters]... {text[-keep:]}"


def loggable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """A client's text for a log line: clipped, its control characters (newlines, ESC ...) escaped, so it cannot
    start a line of its own or move a terminal's cursor."""
    if text.isprintable():
        return clipped(text, limit)
    if len(text) <= limit:
        return clipped(_escaped(text), limit)  # (an escape lengthens it)
    keep = max(limit // 2 - 20, 1)  # as `clipped`, each end escaped and cut back to its share
    head, tail = _escaped(text[:keep])[:keep], _escaped(text[-keep:])[-keep:]
    return f"{head} ...[{len(text) - 2 * keep:,} characters]... {tail}"


def _escaped(text: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def invalid_request_message(detail: str) -> str:
    return INVALID_REQUEST_PREFIX + clipped(detail)


def is_invalid_request(message: str) -> bool:
    return INVALID_REQUEST_PREFIX in message


def strip_invalid_prefix(message: str) -> str:
    return strip_prefix(message, INVALID_REQUEST_PREFIX)


def error_class(message: str) -> str | None:
    """The prefix a (possibly wrapped) error message carries, or None for a server fault."""
    found = [(message.find(p), p) for p in CLIENT_FACING_PREFIXES if p in message]
    return min(found)[1] if found else None


def strip_prefix(message: str, prefix: str) -> str:
    idx = message.find(prefix)
    return message[idx + len(prefix):] if idx >= 0 else message


# chat_template_kwargs: variables for the checkpoint's own chat template, never a way to change how it is applied
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024
RESERVED_TEMPLATE_KWARGS = frozenset({
    # apply_chat_template's own arguments: a client template runs arbitrary Jinja on the server (unbounded time and
    # memory), and the rest change what the call returns or duplicate what the server passes
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


def check_chat_template_kwargs(kwargs: object, field: str = CHAT_TEMPLATE_KWARGS) -> dict:
    """Refuse (ValueError naming `field.key` and the rule) template variables that are not plain named values:
    apply_chat_template's own arguments, non-identifier names, nested values, long strings, a non-boolean
    `enable_thinking`. Returns the kwargs, less a null `enable_thinking` (unset, as null is everywhere: passed on,
    a template's `{% if enable_thinking %}` would read it as false)."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{field}: must be a JSON object")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"{field}: at most {MAX_TEMPLATE_KWARGS} entries, got {len(kwargs)}")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_") or len(key) > 64:
            raise ValueError(f"{field}: keys must be identifiers of at most 64 characters not starting with '_', "
                             f"got {str(key)[:64]!r}")
        where = f"{field}.{key}"
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{where}: not accepted: the server applies the checkpoint's own chat template, and "
                             f"'{key}' is an argument of that call, not a template variable")
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"{where}: must be a string, number, boolean or null, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):  # JSON has no NaN or Infinity to carry it in
            raise ValueError(f"{where}: must be a finite number, got {value!r}")
        if isinstance(value, str) and not is_unicode_text(value):
            raise ValueError(f"{where}: {NOT_UNICODE_RULE}")
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            raise ValueError(f"{where}: at most {MAX_TEMPLATE_KWARG_CHARS} characters, got {len(value)}")
        if key == "enable_thinking" and value is not None and not isinstance(value, bool):
            raise ValueError(f"{where}: must be a boolean or null, got {value!r}")
    return {key: value for key, value in kwargs.items() if key != "enable_thinking" or value is not None}


NOT_UNICODE_RULE = "not Unicode text: it holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair)"


def encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate, which a client's JSON \\ud800 escape or a form in an
    odd charset brings) written as its backslash escape: an error that quotes a client's text must still be sent."""
    return text if is_unicode_text(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_unicode_text(value: str) -> bool:
    """Whether `value` can be encoded (JSON's \\ud800 escape decodes to a lone surrogate, which cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
