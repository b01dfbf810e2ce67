"""The Whisper encoder and decoder components as the Triton nodes run them.

`EncoderComponent` (stateless node): one window of 16 kHz PCM per request, batched across requests by a
`BatchingEngine`; each batch runs front end + encoder on the device (through a captured CUDA graph when a
bucket fits) and answers each request with its `encoder_output` `[1500, d_model]` (float32 on the wire).

`DecoderRuntime` (autoregressive node): parses a decoder request (encoder output, prompt, forced tokens,
knobs) into the engine's prompt, SamplingParams and a `WhisperDecodeState` the engine hands back to the model
at admission (cross-KV write) and every step (token rules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mstar_common.diffusion.batcher import BatchingEngine, OnDone
from mstar_common.engine.types import SamplingParams
from mstar_common.families.whisper import graph as g
from mstar_common.families.whisper.decoding import LANGUAGE, WhisperDecodeState, WhisperTokens
from mstar_common.families.whisper.encoder_graphs import EncoderGraphs, buckets_up_to
from mstar_common.families.whisper.frontend import LogMelFrontEnd, pad_or_trim
from mstar_common.families.whisper.modeling import WhisperEncoderModel

Inputs = dict[str, torch.Tensor]


class EncoderComponent:
    def __init__(self, model: WhisperEncoderModel, frontend: LogMelFrontEnd, device: str, max_batch: int,
                 cuda_graphs: bool = False) -> None:
        self.model, self.frontend, self.device = model, frontend, torch.device(device)
        self.num_samples = frontend.config.num_samples
        self.dtype = next(model.parameters()).dtype
        self.engine = BatchingEngine("whisper/encoder", self.run_batch, max_rows=max_batch)
        self.graphs = (EncoderGraphs(self.forward, (self.num_samples,), buckets_up_to(max_batch), self.device)
                       if cuda_graphs else None)
        self.engine.graph_replays = lambda: self.graphs.num_replays if self.graphs is not None else 0

    def parse(self, inputs: Inputs) -> torch.Tensor:
        pcm = inputs.get(g.AUDIO_PCM)
        if pcm is None or pcm.dim() != 1 or pcm.dtype != torch.float32:
            raise ValueError(f"{g.AUDIO_PCM}: expected one window of float32 mono PCM [samples]")
        if not 1 <= pcm.numel() <= self.num_samples:
            raise ValueError(f"{g.AUDIO_PCM}: a window holds 1 to {self.num_samples} samples (30 s at 16 kHz), "
                             f"got {pcm.numel()}")
        if not torch.isfinite(pcm).all():
            raise ValueError(f"{g.AUDIO_PCM}: NaN or infinite samples")
        return pad_or_trim(pcm, self.num_samples)

    def submit(self, request_id: str, inputs: Inputs, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        self.engine.submit(request_id, self.parse(inputs), on_done, is_cancelled)

    def forward(self, pcm: torch.Tensor) -> torch.Tensor:
        """`[B, num_samples]` float32 on the device -> `[B, 1500, d_model]` float32."""
        features = self.frontend(pcm).to(self.dtype)
        return self.model(features).float()

    @torch.inference_mode()
    def run_batch(self, payloads: list[torch.Tensor]) -> list[Inputs]:
        pcm = torch.stack(payloads).to(self.device, non_blocking=True)
        out = self.graphs.run(pcm) if self.graphs is not None else None
        if out is None:
            out = self.forward(pcm)
        out = out.cpu()
        return [{g.ENCODER_OUTPUT: row} for row in out]


@dataclass(slots=True)
class DecoderRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_state: WhisperDecodeState
    stops: list[str] = field(default_factory=list)


class TokenIdsOnly:
    """The decoder node's "tokenizer": the decoder streams token ids and the walk makes the text (it knows the
    windows, the forced tokens and the timestamps), so the node's per-token detokenizing is skipped; it would
    otherwise run beside the step loop on every token, under the same GIL."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


@dataclass(slots=True)
class DecoderRuntime:
    """What the decoder's Triton instance runs: the engine and the parser of decoder requests (its
    `text_output` stays empty: see TokenIdsOnly)."""

    engine: Any  # AREngine over WhisperDecoderLM
    tokens: WhisperTokens
    max_model_len: int
    source_shape: tuple[int, int]  # (max_source_positions, d_model)
    tokenizer: Any = field(default_factory=TokenIdsOnly)

    def parse_request(self, inputs: dict[str, np.ndarray]) -> DecoderRequest:
        source = _encoder_output(inputs, self.source_shape)
        prompt = _ids(inputs, g.INPUT_IDS, self.tokens.vocab_size, required=True)
        forced = _ids(inputs, g.FORCED_IDS, self.tokens.vocab_size, allow_language=True)
        if LANGUAGE in forced[1:] or (forced and forced[0] == LANGUAGE and not self.tokens.is_multilingual):
            raise ValueError(f"{g.FORCED_IDS}: -1 (the model's language choice) may only come first, and only for "
                             "a multilingual checkpoint")
        room = self.max_model_len - len(prompt) - len(forced)
        if room < 1:
            raise ValueError(f"{g.INPUT_IDS}: {len(prompt)} prompt and {len(forced)} forced tokens leave no room "
                             f"within the decoder's {self.max_model_len} positions")
        max_tokens = _scalar(inputs, g.MAX_TOKENS, room)
        least = 0 if forced else 1  # forced tokens alone (e.g. language detection) are a whole request
        if isinstance(max_tokens, bool) or not least <= int(max_tokens) <= room:
            raise ValueError(f"{g.MAX_TOKENS}: must be in [{least}, {room}] (the decoder's positions left after the "
                             f"prompt and forced tokens), got {max_tokens}")
        params = SamplingParams(max_tokens=int(max_tokens) + len(forced),
                                temperature=float(_scalar(inputs, g.TEMPERATURE, 0.0)))
        seed = _scalar(inputs, g.SEED, None)
        params.seed = None if seed is None else int(seed)
        params.validate(self.tokens.vocab_size)
        state = WhisperDecodeState(
            encoder_output=source, forced=forced, timestamps=bool(_scalar(inputs, g.TIMESTAMPS, False)),
            num_prompt_tokens=len(prompt),
        )
        return DecoderRequest(prompt, params, state)

    def final_outputs(self, state: WhisperDecodeState) -> dict[str, np.ndarray]:
        """The last response's window scores (read after the engine's last call for the request)."""
        return {g.AVG_LOGPROB: _score(state.avg_logprob), g.NO_SPEECH_PROB: _score(state.no_speech_prob)}


def _score(value: float | None) -> np.ndarray:
    return np.array([np.nan if value is None else value], np.float32)


def _encoder_output(inputs: dict[str, np.ndarray], shape: tuple[int, int]) -> torch.Tensor:
    value = inputs.get(g.ENCODER_OUTPUT)
    if value is None:
        raise ValueError(f"{g.ENCODER_OUTPUT}: required (the encoder component's output for this window)")
    if tuple(value.shape) != shape or value.dtype != np.float32:
        raise ValueError(f"{g.ENCODER_OUTPUT}: expected float32 {list(shape)}, got {value.dtype} {list(value.shape)}")
    if not np.isfinite(value).all():
        raise ValueError(f"{g.ENCODER_OUTPUT}: NaN or infinite values")
    return torch.from_numpy(np.array(value))  # owns its memory past the Triton request


def _ids(inputs: dict[str, np.ndarray], name: str, vocab_size: int, required: bool = False,
         allow_language: bool = False) -> list[int]:
    if name not in inputs:
        if required:
            raise ValueError(f"{name}: required")
        return []
    ids = [int(i) for i in np.asarray(inputs[name]).reshape(-1)]
    if required and not ids:
        raise ValueError(f"{name}: must not be empty")
    low = LANGUAGE if allow_language else 0
    if bad := [i for i in ids if not low <= i < vocab_size]:
        raise ValueError(f"{name}: ids must be in [{low}, {vocab_size}), got {bad[:5]}")
    return ids


def _scalar(inputs: dict[str, np.ndarray], name: str, default: Any) -> Any:
    if name not in inputs:
        return default
    arr = np.asarray(inputs[name]).reshape(-1)
    if arr.size != 1:
        raise ValueError(f"{name}: expected one value, got {arr.size}")
    return arr[0].item()
