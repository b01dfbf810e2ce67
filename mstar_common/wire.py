"""Tensor names and error conventions on the wire between clients (proxy, tritonclient) and entry models.

Every text-generating entry model (e.g. `qwen3_llm`) is a decoupled Triton model with these tensors.
Inputs (all optional, shape [1] unless noted; give exactly one of `text_input`, `messages`, `input_ids`):

  text_input          BYTES   raw prompt text (completion style; no chat template)
  messages            BYTES   JSON list of OpenAI-style chat messages; the checkpoint's chat template is applied
  input_ids           INT32   [-1] prompt token ids
  chat_template_kwargs BYTES  JSON object passed to the chat template (e.g. {"enable_thinking": false})
  max_tokens          INT32   default: the room the prompt leaves, capped by the deployment's default
  temperature         FP32    0 = greedy
  top_p               FP32
  top_k               INT32   0 = off
  min_p               FP32
  repetition_penalty  FP32
  seed                INT64
  ignore_eos          BOOL
  stop                BYTES   [-1] stop strings (excluded from the output)
  stop_token_ids      INT32   [-1]

Outputs, per streamed response (several tokens per response when a stream falls behind):

  text_output         BYTES   [1] new text since the previous response
  token_ids           INT32   [-1] new token ids since the previous response
  finish_reason       BYTES   [1] "" until the last response; then "stop" | "length" | "cancelled"
  prompt_tokens       INT32   [1]
  completion_tokens   INT32   [1] tokens generated so far

The last response carries the COMPLETE_FINAL flag. A refused request fails with a Triton error whose
message starts with INVALID_REQUEST_PREFIX (the proxy maps it to HTTP 400); any other error is a server
fault whose message carries an error id that is also in the server log (HTTP 500).
"""

from __future__ import annotations

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
STOP_TOKEN_IDS = "stop_token_ids"

TEXT_OUTPUT = "text_output"
TOKEN_IDS = "token_ids"
FINISH_REASON = "finish_reason"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"

INVALID_REQUEST_PREFIX = "invalid_request: "
SERVER_ERROR_PREFIX = "internal error (error id "


def invalid_request_message(detail: str) -> str:
    return INVALID_REQUEST_PREFIX + detail


def is_invalid_request(message: str) -> bool:
    return INVALID_REQUEST_PREFIX in message


def strip_invalid_prefix(message: str) -> str:
    idx = message.find(INVALID_REQUEST_PREFIX)
    return message[idx + len(INVALID_REQUEST_PREFIX):] if idx >= 0 else message
