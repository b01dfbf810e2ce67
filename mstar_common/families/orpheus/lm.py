"""The Orpheus LM component: the Llama backbone with an audio-token head, and request parsing.

The head multiplies only the `<custom_token_*>` rows of the (tied) output embedding, about 18 % of
Llama-3's 156,940 rows, and the engine samples over that window (`logits_offset`): every text token has
probability zero, and temperature, top-p and the repetition penalty renormalise over the custom tokens
only, as the reference's -inf mask on the text rows does, at a fifth of the sampling work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mstar_common import wire
from mstar_common.engine.types import SamplingParams
from mstar_common.families.orpheus.codes import FrameRule
from mstar_common.families.orpheus.tokens import TokenLayout
from mstar_common.families.text import _scalar_text, check_text_fits, max_token_bytes, sampling_params_from_inputs
from mstar_common.graph import TensorSpec

# The reference's generation defaults (orpheus-tts `generate_speech`).
DEFAULT_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}

SPEECH_INPUTS = (
    TensorSpec(wire.TEXT_INPUT, "BYTES"),
    TensorSpec(wire.VOICE, "BYTES"),
    *(TensorSpec(name, dtype) for name, (dtype, _) in wire.SAMPLING_INPUTS.items()),
)
SPEECH_OUTPUTS = (
    TensorSpec(wire.AUDIO_CHUNK, "INT16", (-1,)),
    TensorSpec(wire.SAMPLE_RATE, "INT32"),
    TensorSpec(wire.TOKEN_IDS, "INT32", (-1,)),
    TensorSpec(wire.FINISH_REASON, "BYTES"),
    TensorSpec(wire.PROMPT_TOKENS, "INT32"),
    TensorSpec(wire.COMPLETION_TOKENS, "INT32"),
)


class AudioTokenLM(nn.Module):
    """Wraps a causal LM (`CausalLM` contract) so its head computes only the custom-token rows."""

    def __init__(self, lm: nn.Module, custom_start: int, vocab_size: int) -> None:
        super().__init__()
        self.lm = lm
        self.custom_start, self.vocab_size = custom_start, vocab_size
        self.logits_offset = custom_start  # compute_logits covers ids [custom_start, vocab_size)
        self.kv_spec = lm.kv_spec
        self.supports_prefix_caching = getattr(lm, "supports_prefix_caching", False)
        self.max_position_embeddings = lm.max_position_embeddings

    @property
    def attn_backend(self):
        return self.lm.attn_backend

    @attn_backend.setter
    def attn_backend(self, backend) -> None:
        self.lm.attn_backend = backend

    @property
    def gathers_input_ids(self) -> bool:  # forward passes `gather` through
        return getattr(self.lm, "gathers_input_ids", False)

    def enable_fused_ops(self, enabled: bool = True) -> None:
        self.lm.enable_fused_ops(enabled)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.lm(*args, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden]` -> `[B, vocab_size - custom_start]`: the custom-token rows only."""
        return torch.nn.functional.linear(hidden, self.lm.lm_head.weight[self.custom_start:self.vocab_size])


@dataclass(slots=True)
class SpeechRequest:
    prompt_ids: list[int]
    params: SamplingParams
    voice: str


@dataclass(slots=True)
class OrpheusLMRuntime:
    """What the speech LM Triton instance runs: engine, tokenizer, token layout and request rules."""

    engine: Any  # AREngine
    tokenizer: Any
    layout: TokenLayout
    voices: tuple[str, ...]
    default_voice: str
    max_input_tokens: int  # cap on the tokenized input text
    default_max_tokens: int
    frame_rule: FrameRule
    codec_model: str  # the Triton model of the SNAC component
    sample_rate: int
    # frames in each stream's first audio response (None: auto; AudioStream); the family passes its deployment's,
    # DEFAULT_FIRST_CHUNK_FRAMES (3) unless set
    first_chunk_frames: int | None = 1
    local_codec: Any = None  # a SnacCodec when `codec_in_process` (no BLS hop), else None
    max_input_bytes: int = 0  # a text longer than this cannot fit max_input_tokens; 0: from the tokenizer

    def __post_init__(self) -> None:
        if not self.max_input_bytes:
            self.max_input_bytes = self.max_input_tokens * max_token_bytes(self.tokenizer)

    def parse_request(self, inputs: dict[str, np.ndarray]) -> SpeechRequest:
        if wire.TEXT_INPUT not in inputs:
            raise ValueError("text_input: required (the text to speak)")
        text = _scalar_text(inputs, wire.TEXT_INPUT)
        if not text.strip():
            raise ValueError("text_input: must not be empty")
        voice = _scalar_text(inputs, wire.VOICE) if wire.VOICE in inputs else self.default_voice
        if voice not in self.voices:
            raise ValueError(f"voice: unknown voice {voice!r}; available voices: {list(self.voices)}")
        check_text_fits(text, wire.TEXT_INPUT, self.max_input_tokens, self.max_input_bytes)
        num_words = len(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        if num_words > self.max_input_tokens:
            raise ValueError(f"text_input: {num_words} tokens exceeds the limit of {self.max_input_tokens} tokens")
        prompt = self.layout.prompt_ids(self.tokenizer, text, voice)
        room = self.engine.max_model_len - len(prompt)
        if room < 1:  # the text's own field, not a max_tokens the client may never have sent
            raise ValueError(f"text_input: its {len(prompt)}-token prompt (the text, the voice and the framing) "
                             f"leaves no room for audio within max_model_len={self.engine.max_model_len}")
        values = {name: inputs[name] for name in wire.SAMPLING_INPUTS if name in inputs}
        for name, default in DEFAULT_SAMPLING.items():
            values.setdefault(name, np.asarray([default], dtype=np.float32))
        params = sampling_params_from_inputs(values, default_max_tokens=min(self.default_max_tokens, room))
        if params.max_tokens > room:
            raise ValueError(f"max_tokens: {params.max_tokens} plus the prompt's {len(prompt)} tokens exceeds "
                             f"max_model_len={self.engine.max_model_len} (at most {room})")
        params.validate(self.layout.vocab_size)
        return SpeechRequest(prompt, params, voice)
