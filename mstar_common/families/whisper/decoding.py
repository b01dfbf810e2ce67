"""Whisper's decoding rules: the decoder prompt, forced tokens, and the logits rules of the checkpoint's
generation config, applied per row inside the engine step (`TokenRules.process`, the decoder's
`process_logits` hook), in transformers' order:

    forced step (n < len(forced))  only the forced token, or only language tokens (language detection)
    first free step                begin_suppress_tokens (blank and <|endoftext|>)
    every free step                suppress_tokens
    timestamp mode                 no <|notimestamps|>; timestamps in pairs (a lone timestamp is followed by another
                                   or <|endoftext|>, a pair by text); timestamps never decrease; the first token is a
                                   timestamp <= max_initial_timestamp_index; when the timestamps' total probability
                                   beats every text token, a timestamp is taken

A request's decoder sequence is `prompt + forced + free tokens`, where prompt is
`[<|startofprev|> prompt tokens…] <|startoftranscript|> [<|lang|> <|task|> [<|notimestamps|>]]`: with a
known language the whole prefix is prompt (prefilled at once); with language detection the prompt ends at
<|startoftranscript|> and `forced = [LANGUAGE, <|task|>, [<|notimestamps|>]]`, so the first step picks the
language (argmax over language tokens, as transformers' `detect_language`) and two forced steps follow.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_common.families.whisper.languages import LANGUAGE_NAMES

LANGUAGE = -1  # a forced slot filled by the model's choice among language tokens
TASKS = ("transcribe", "translate")
TIME_PRECISION = 0.02  # seconds per timestamp step
_NEG_INF = float("-inf")



@dataclass(frozen=True, slots=True)
class WhisperTokens:
    """The special token ids and rules a checkpoint's generation_config.json declares."""

    vocab_size: int
    eot: int
    sot: int
    prev: int | None  # <|startofprev|>
    no_timestamps: int
    lang_to_id: dict[str, int]  # code -> id
    task_to_id: dict[str, int]
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: int | None
    max_length: int  # decoder positions (prompt + output)
    # the checkpoint's own language and task (`defaults`): the generation config's `language` and `task` fields,
    # and the legacy forced_decoder_ids' (read only where the generation config sets neither)
    config_language: str | None = None
    config_task: str | None = None
    legacy_language: str | None = None
    legacy_task: str | None = None

    def defaults(self, language: str | None, task: str | None) -> tuple[str | None, str]:
        """A request's language (None: detected) and task, with what it leaves out filled as transformers' generate
        fills it: from the generation config's `language` and `task`, each alone; from the legacy
        forced_decoder_ids only for a request that names neither (generate reads them only when both are unset).
        Else the language is detected and the task is transcribe."""
        legacy = language is None and task is None
        language = language or self.config_language or (self.legacy_language if legacy else None)
        return language, task or self.config_task or (self.legacy_task if legacy else None) or "transcribe"

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def no_speech(self) -> int:
        """<|nospeech|> (<|nocaptions|> before large-v3): the token just below <|notimestamps|>, in every checkpoint."""
        return self.no_timestamps - 1

    @property
    def is_multilingual(self) -> bool:
        return bool(self.lang_to_id)

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any], vocab_size: int, max_target_positions: int,
                               config_forced: list | None = None) -> WhisperTokens:
        """Refuses generation configs without the fields Whisper decoding needs, naming the key. `config_forced`:
        config.json's forced_decoder_ids, which transformers reads where the generation config has none."""
        for key in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id"):
            if gen.get(key) is None:
                raise ValueError(f"generation_config.json: {key} is required for Whisper decoding")
        eos = gen["eos_token_id"]
        lang_to_id = {token.strip("<|>"): int(i) for token, i in (gen.get("lang_to_id") or {}).items()}
        task_to_id = {k: int(v) for k, v in (gen.get("task_to_id") or {}).items()}
        if gen.get("is_multilingual", bool(lang_to_id)) and not (lang_to_id and set(task_to_id) == set(TASKS)):
            raise ValueError("generation_config.json: a multilingual checkpoint needs lang_to_id and task_to_id "
                             f"({list(TASKS)})")
        defaults = _checkpoint_defaults(gen, lang_to_id, task_to_id, config_forced)
        tokens = cls(
            vocab_size=vocab_size,
            eot=int(eos[0] if isinstance(eos, list) else eos),
            sot=int(gen["decoder_start_token_id"]),
            prev=gen.get("prev_sot_token_id"),
            no_timestamps=int(gen["no_timestamps_token_id"]),
            lang_to_id=lang_to_id if gen.get("is_multilingual", bool(lang_to_id)) else {},
            task_to_id=task_to_id,
            suppress=tuple(int(t) for t in gen.get("suppress_tokens") or ()),
            begin_suppress=tuple(int(t) for t in gen.get("begin_suppress_tokens") or ()),
            max_initial_timestamp_index=gen.get("max_initial_timestamp_index"),
            max_length=min(int(gen.get("max_length") or max_target_positions), max_target_positions),
        )
        try:
            return dataclasses.replace(tokens, **{key: tokens.language_code(value) if value and "language" in key
                                                  else value for key, value in defaults.items()})
        except ValueError as exc:
            raise ValueError(f"generation_config.json: {exc}") from None

    def language_code(self, value: str) -> str:
        """A language code, name or <|code|> token -> the checkpoint's code; ValueError naming `language`."""
        key = value.strip().lower().strip("<|>")
        code = LANGUAGE_NAMES.get(key, key)
        if not self.is_multilingual:
            if code != "en":
                raise ValueError(f"language: this checkpoint is English-only; got {value!r}")
            return code
        if code not in self.lang_to_id:
            raise ValueError(f"language: {value!r} is not a language this checkpoint knows; use an ISO-639-1 code "
                             f"such as {', '.join(sorted(self.lang_to_id)[:8])}, ... ({len(self.lang_to_id)} in all)")
        return code

    def code_of(self, token_id: int) -> str | None:
        for code, tid in self.lang_to_id.items():
            if tid == token_id:
                return code
        return None

    def is_timestamp(self, token_id: int) -> bool:
        return token_id >= self.timestamp_begin

    def text_ids(self, token_ids: list[int]) -> list[int]:
        """The tokens that carry text (below <|endoftext|>)."""
        return [t for t in token_ids if t < self.eot]


def _checkpoint_defaults(gen: dict[str, Any], lang_to_id: dict[str, int], task_to_id: dict[str, int],
                         config_forced: list | None) -> dict[str, str | None]:
    """WhisperTokens' config_language, config_task, legacy_language and legacy_task (`WhisperTokens.defaults`):
    the generation config's `language` and `task`; where it sets neither, its legacy forced_decoder_ids (else
    config.json's): a language token at position 1 and a task token anywhere. ValueError naming the key."""
    language, task = gen.get("language"), gen.get("task")
    if language is not None and not isinstance(language, str):
        raise ValueError(f"generation_config.json: language must be one language (a string), got {language!r}")
    if task is not None and task not in TASKS:
        raise ValueError(f"generation_config.json: task must be one of {list(TASKS)}, got {task!r}")
    legacy_language = legacy_task = None
    if language is None and task is None:
        languages = {tid: code for code, tid in lang_to_id.items()}
        tasks = {tid: name for name, tid in task_to_id.items()}
        for position, token in gen.get("forced_decoder_ids") or config_forced or ():
            if position == 1 and token in languages:
                legacy_language = languages[token]
            legacy_task = tasks.get(token, legacy_task)
    return {"config_language": language, "config_task": task, "legacy_language": legacy_language,
            "legacy_task": legacy_task}


@dataclass(slots=True)
class DecoderPrompt:
    prompt: list[int]
    forced: list[int]  # LANGUAGE for the model's language choice

    @property
    def begin_index(self) -> int:
        return len(self.prompt) + len(self.forced)


def build_prompt(tokens: WhisperTokens, *, language: str | None, task: str, timestamps: bool,
                 prompt_ids: list[int]) -> DecoderPrompt:
    """The decoder prompt and forced tokens for one window (`prompt_ids`: the initial prompt's text ids)."""
    prefix = [tokens.prev, *prompt_ids] if prompt_ids else []
    tail = [] if timestamps else [tokens.no_timestamps]
    if not tokens.is_multilingual:
        return DecoderPrompt([*prefix, tokens.sot, *tail], [])
    task_id = tokens.task_to_id[task]
    if language is None:
        return DecoderPrompt([*prefix, tokens.sot], [LANGUAGE, task_id, *tail])
    return DecoderPrompt([*prefix, tokens.sot, tokens.lang_to_id[language], task_id, *tail], [])


@dataclass(slots=True)
class WhisperDecodeState:
    """One decoder request's state on the engine (its `request_state`)."""

    encoder_output: torch.Tensor | None  # [source_len, d_model]; dropped once its cross-KV is written
    forced: list[int]
    timestamps: bool
    num_prompt_tokens: int
    timestamp_last: int | None = None  # scan state of the timestamp rule (see TokenRules._timestamp_floor)
    num_scanned: int = 0
    last_timestamps: list[bool] = field(default_factory=list)
    # OpenAI Whisper's window scores, filled by the engine as it collects steps (WhisperDecoderLM's note_* hooks)
    sum_logprob: float = 0.0  # log-probabilities of the free tokens, <|endoftext|> included, under the token rules
    num_free_text: int = 0  # free tokens other than <|endoftext|> that were scored
    is_scored: bool = False  # any free token scored
    no_speech_prob: float | None = None  # softmax of the raw logits at <|startoftranscript|>, at <|nospeech|>

    def note_sampled(self, index: int, token: int, logprob: float, eot: int) -> None:
        """A sampled token at position `index` of the sequence; forced positions do not count."""
        if index - self.num_prompt_tokens < len(self.forced):
            return
        self.sum_logprob += logprob
        self.num_free_text += token != eot
        self.is_scored = True

    @property
    def avg_logprob(self) -> float | None:
        """OpenAI Whisper's `avg_logprob`: the free tokens' summed log-probability over their count plus one (the
        <|endoftext|> a finished window ends with; a window cut at its length is divided the same way)."""
        return self.sum_logprob / (self.num_free_text + 1) if self.is_scored else None

    def take_encoder_output(self) -> torch.Tensor:
        if self.encoder_output is None:
            raise RuntimeError("the encoder output was already written to a cross-KV slot")
        source, self.encoder_output = self.encoder_output, None
        return source


class TokenRules:
    """Applies the rules in the module docstring to one step's logits `[B, V]` (float32, modified in place)."""

    def __init__(self, tokens: WhisperTokens, device: torch.device | str) -> None:
        self.tokens = tokens
        vocab = tokens.vocab_size
        self._suppress = _mask(vocab, tokens.suppress, device)
        self._begin_suppress = _mask(vocab, tokens.begin_suppress, device)
        self._languages = _mask(vocab, tokens.lang_to_id.values(), device)

    def process(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        free_rows, begin_rows, timestamp_rows = [], [], []
        for row, seq in enumerate(seqs):
            state: WhisperDecodeState | None = seq.request_state
            if state is None:
                continue
            generated = len(seq.token_ids) - state.num_prompt_tokens
            if generated < len(state.forced):
                self._force(logits[row], state.forced[generated])
                continue
            free_rows.append(row)
            if generated == len(state.forced):
                begin_rows.append(row)
            if state.timestamps:
                timestamp_rows.append((row, seq, state))
        if begin_rows:
            _mask_rows(logits, begin_rows, self._begin_suppress)
        if free_rows:
            _mask_rows(logits, free_rows, self._suppress)
        if timestamp_rows:
            self._timestamp_rules(logits, timestamp_rows)
        return logits

    def _force(self, row_logits: torch.Tensor, token: int) -> None:
        if token == LANGUAGE:
            row_logits.masked_fill_(~self._languages, _NEG_INF)
        else:
            keep = row_logits[token].clone()
            row_logits.fill_(_NEG_INF)
            row_logits[token] = keep

    def _timestamp_rules(self, logits: torch.Tensor, rows: list) -> None:
        t = self.tokens
        begin = t.timestamp_begin
        rows_idx = [row for row, _, _ in rows]
        logits[rows_idx, t.no_timestamps] = _NEG_INF
        for row, seq, state in rows:
            free = seq.token_ids[state.num_prompt_tokens + len(state.forced):]
            last_is_ts = len(free) >= 1 and free[-1] >= begin
            penultimate_is_ts = len(free) < 2 or free[-2] >= begin
            if last_is_ts:
                if penultimate_is_ts:
                    logits[row, begin:] = _NEG_INF  # a pair ends here: text next
                else:
                    logits[row, : t.eot] = _NEG_INF  # a lone timestamp: its pair or the end
            floor = self._timestamp_floor(free, state, last_is_ts, penultimate_is_ts)
            logits[row, begin:floor] = _NEG_INF
            if not free:
                logits[row, :begin] = _NEG_INF
                if t.max_initial_timestamp_index is not None:
                    logits[row, begin + t.max_initial_timestamp_index + 1:] = _NEG_INF
        sub = logits[rows_idx]
        logprobs = torch.log_softmax(sub, dim=-1)
        timestamp_mass = logprobs[:, begin:].logsumexp(dim=-1)
        best_text = logprobs[:, :begin].max(dim=-1).values
        take_timestamp = (timestamp_mass > best_text).unsqueeze(-1)
        sub[:, :begin] = sub[:, :begin].masked_fill(take_timestamp, _NEG_INF)
        logits[rows_idx] = sub

    def _timestamp_floor(self, free: list[int], state: WhisperDecodeState, last_is_ts: bool,
                         penultimate_is_ts: bool) -> int:
        """Lowest timestamp id allowed next: the last one again only to close a pair, else strictly later."""
        begin = self.tokens.timestamp_begin
        for token in free[state.num_scanned:]:  # incremental: O(new tokens) per step
            if token >= begin:
                state.timestamp_last = token
        state.num_scanned = len(free)
        if state.timestamp_last is None:
            return begin
        return state.timestamp_last if (last_is_ts and not penultimate_is_ts) else state.timestamp_last + 1


def _mask_rows(logits: torch.Tensor, rows: list[int], vocab_mask: torch.Tensor) -> None:
    """`logits[rows] = -inf where vocab_mask`, in place, without a blocking host-to-device copy.

    Indexing a CUDA tensor with a Python list copies the indices to the device and waits for the stream (a
    sync per step, which cost the decoder its overlap of host work and GPU step). Every row: one masked fill
    with no index; some rows: a row mask sent from pinned memory without blocking.
    """
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(vocab_mask, _NEG_INF)
        return
    on_cuda = logits.device.type == "cuda"
    flags = torch.zeros(logits.shape[0], dtype=torch.bool, pin_memory=on_cuda)
    flags[rows] = True
    row_mask = flags.to(logits.device, non_blocking=on_cuda)
    logits.masked_fill_(row_mask[:, None] & vocab_mask, _NEG_INF)


def _mask(vocab_size: int, ids, device) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    ids = [i for i in ids if 0 <= i < vocab_size]
    if ids:
        mask[torch.tensor(ids)] = True
    return mask.to(device)


# ---- reading a window's tokens back -------------------------------------------------------------------------


@dataclass(slots=True)
class Segment:
    start: float  # seconds from the start of the upload
    end: float
    token_ids: list[int]


def split_segments(tokens: WhisperTokens, free: list[int], offset: float, duration: float) -> list[Segment]:
    """A timestamped window's free tokens -> segments, as transformers' `_retrieve_segment` cuts them.

    Consecutive timestamps close a segment; a trailing single timestamp closes the last one. Without any
    pair the whole window is one segment ending at its last timestamp (or the window's end)."""
    free = [t for t in free if t != tokens.eot]
    is_ts = [tokens.is_timestamp(t) for t in free]
    cuts = [i + 1 for i in range(len(free) - 1) if is_ts[i] and is_ts[i + 1]]
    at = _timestamp_seconds(tokens)
    if not cuts:
        stamps = [t for t in free if tokens.is_timestamp(t)]
        end = at(stamps[-1]) if stamps and stamps[-1] != tokens.timestamp_begin else duration
        return [Segment(offset, offset + end, free)] if free else []
    single_ending = is_ts[-2:] == [False, True]
    if single_ending:
        cuts.append(len(free))
    else:
        cuts[-1] += 1
    segments, last = [], 0
    for i, cut in enumerate(cuts):
        piece = free[last:cut]
        end_index = -1 if i < len(cuts) - 1 or single_ending else -2
        segments.append(Segment(offset + at(piece[0]), offset + at(piece[end_index]), piece))
        last = cut
    if last < len(free):  # text after the last closed segment (the window hit its token cap)
        end = offset + duration
        segments.append(Segment(min(segments[-1].end, end), end, free[last:]))
    return segments


def _timestamp_seconds(tokens: WhisperTokens):
    return lambda token: (token - tokens.timestamp_begin) * TIME_PRECISION if tokens.is_timestamp(token) else 0.0


def compression_ratio(text: str) -> float:
    """OpenAI Whisper's repetition measure: bytes of the text over bytes of its zlib compression."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0
