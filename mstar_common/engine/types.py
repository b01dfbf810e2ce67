"""Types shared by the autoregressive runtime, the Triton node and the proxy.

The contract: a request is `prompt_ids` plus `SamplingParams`; the engine reports new tokens through a
callback `on_output(request_id, new_token_ids, finish_reason, error)` where `finish_reason` is set on
the last call only (and `error` only when the request failed inside the engine).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import Enum

from mstar_common.config import is_finite_number

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# temperatures below this sample greedily: 1e-5 as the FP32 wire carries it (9.99999975e-06), so a request's 1e-5
# samples whether it came as a Python float or through a Triton tensor
GREEDY_TEMPERATURE = float(struct.unpack("f", struct.pack("f", 1e-5))[0])
# Limits past which the samplers' FP32 arithmetic breaks, refused rather than served wrong. A temperature above
# MAX_TEMPERATURE made distinct logits' exp(gap / T) round to 1.0 in the GPU top-k filter, which then kept ties it
# should have cut (top_k 1 at 1e8 kept 8 tokens); a repetition penalty below MIN_REPETITION_PENALTY sent a seen
# token's logit / penalty to +inf, and the GPU sampler then drew id 0 at every step (2e-38 passed "> 0").
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 1e-3


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the client went away or cancelled
    ERROR = "error"


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling knobs (spec/ENGINE.md §9). `None` means "unset" where a field allows it.

    Order applied by the sampler: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw.
    """

    max_tokens: int = 256
    temperature: float = 1.0  # < GREEDY_TEMPERATURE means greedy
    top_k: int = 0  # 0, -1 or >= vocab: no filter
    top_p: float = 1.0  # (0, 1]
    min_p: float = 0.0  # [0, 1)
    repetition_penalty: float = 1.0  # >= MIN_REPETITION_PENALTY; 1.0 is off; HF semantics over prompt + output tokens
    seed: int | None = None  # per-request generator; None draws from the engine's generator
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and the rule; call before scheduling."""
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, -1, INT32_MAX)  # -1 (vLLM's "off") and 0 both leave the filter off
        # one message per rule, whichever side the value misses it on
        _check_float("top_p", self.top_p, None, None)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _check_float("min_p", self.min_p, None, None)
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p: must be in [0, 1), got {self.min_p}")
        _check_float("repetition_penalty", self.repetition_penalty, None, None)
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty: must be >= {MIN_REPETITION_PENALTY:g} (1.0 is off), got "
                             f"{self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, INT64_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, (vocab_size - 1) if vocab_size else INT32_MAX)


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}], got {value}")


def _check_float(name: str, value, lo: float | None, hi: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if not is_finite_number(value):  # NaN, infinity, or an integer past any float
        raise ValueError(f"{name}: must be finite, got {value}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")


@dataclass(slots=True)
class EngineConfig:
    """Resources and batching limits of one autoregressive component instance."""

    # pages in the paged KV pool (one extra sink page is added internally), or "auto": what `gpu_memory_share` of the
    # GPU leaves after the weights and the steps' buffers (engine/kv_sizing.py; CUDA only)
    num_kv_pages: int | str = 512
    page_size: int = 16  # tokens per page
    max_num_seqs: int = 64  # requests running at once (the deployment's max_concurrent_requests)
    max_batch_tokens: int = 2048  # packed tokens per step (decode rows + prefill chunks)
    max_model_len: int | None = None  # prompt + output cap; None: the checkpoint's max_position_embeddings
    dtype: str = "float32"  # float32 | bfloat16 | float16
    kv_dtype: str = "auto"  # the KV pool's element type: auto (= dtype) | fp8_e4m3 (stored rounded, scale 1)
    # reuse the KV pages of earlier prompts' common starts: None (default) where the model allows it, True the same
    # and refused (ValueError) for a model that does not, False off
    prefix_caching: bool | None = None
    device: str = "cpu"
    max_queue: int | None = None  # requests waiting beyond max_num_seqs before new ones are refused; None: no cap
    queue_timeout_s: float | None = None  # the longest a request waits for admission; None: no limit
    request_timeout_s: float | None = None  # default (and ceiling) of a request's deadline; None: no limit
    gpu_memory_share: float = 0.9  # the share of its GPU's total memory this instance may hold (auto pools)


class AdmissionError(ValueError):
    """A request that can never be served with this engine's resources (a 400, named field and rule)."""
