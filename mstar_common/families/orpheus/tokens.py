"""Orpheus token layout, voices and the prompt format, read from the checkpoint's tokenizer.

The Llama text vocabulary is followed by `<custom_token_N>` tokens: ten markers, then 7 bands of 4096 audio
codes. Band `k` holds the code for position `k` of a 7-code SNAC frame, so audio token
`<custom_token_{10 + k*4096 + code}>` is code `code` at frame position `k` (what the reference decoder
undoes with `int(N) - 10 - (index % 7) * 4096`).

    marker               custom index   Llama-3 id (orpheus-3b-0.1-ft)
    start_of_speech      1              128257
    end_of_speech        2              128258   (the model's stop token)
    start_of_human       3              128259
    end_of_human         4              128260
    start_of_ai          5              128261
    end_of_ai            6              128262

Prompt (the reference's `_format_prompt` for the fine-tuned checkpoints, built as ids, never re-tokenized):
    start_of_human, <|begin_of_text|>, tokens("{voice}: {text}"), <|eot_id|>, end_of_human, start_of_ai, start_of_speech
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CUSTOM_TOKEN = "<custom_token_{}>"
NUM_MARKERS = 10  # custom tokens before the first audio band
CODEBOOK_SIZE = 4096  # codes per SNAC codebook
CODES_PER_FRAME = 7  # 1 coarse + 2 medium + 4 fine codes
NUM_AUDIO_TOKENS = CODES_PER_FRAME * CODEBOOK_SIZE
PROMPT_FRAMING_IDS = 6  # the start-of-human marker and BOS before the text, EOT and three markers after it
START_OF_SPEECH, END_OF_SPEECH, START_OF_HUMAN, END_OF_HUMAN, START_OF_AI, END_OF_AI = 1, 2, 3, 4, 5, 6
EOT = "<|eot_id|>"

# The fine-tuned checkpoints' speakers, in the order the model card lists them.
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_VOICE = "tara"


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """Where the custom tokens sit in one checkpoint's vocabulary."""

    custom_start: int  # id of <custom_token_0>
    vocab_size: int  # the model's (padded) vocabulary; the LM head's rows
    bos: int  # <|begin_of_text|>
    eot: int  # <|eot_id|>

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> TokenLayout:
        """Read and check the layout; a checkpoint without the full contiguous custom range is refused."""
        num_custom = NUM_MARKERS + NUM_AUDIO_TOKENS
        first, last = tokenizer.convert_tokens_to_ids([CUSTOM_TOKEN.format(0), CUSTOM_TOKEN.format(num_custom - 1)])
        unk = tokenizer.unk_token_id
        if first in (None, unk) or last in (None, unk) or last - first != num_custom - 1:
            raise ValueError(f"tokenizer: expected {num_custom} contiguous <custom_token_N> tokens "
                             f"(an Orpheus checkpoint), got <custom_token_0>={first}, last={last}")
        if last >= vocab_size:
            raise ValueError(f"config.json vocab_size={vocab_size} does not cover the custom tokens (last id {last})")
        bos, eot = tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids(EOT)
        if bos is None or eot in (None, unk):
            raise ValueError(f"tokenizer: needs a bos token and {EOT}")
        return cls(custom_start=first, vocab_size=vocab_size, bos=bos, eot=eot)

    def marker(self, index: int) -> int:
        return self.custom_start + index

    @property
    def audio_start(self) -> int:
        return self.custom_start + NUM_MARKERS

    @property
    def stop_token_ids(self) -> list[int]:
        """The speech stops here (end_of_speech; end_of_ai as a fallback the fine-tuned model also emits)."""
        return [self.marker(END_OF_SPEECH), self.marker(END_OF_AI)]

    def prompt_ids(self, tokenizer: Any, text: str, voice: str) -> list[int]:
        """The prompt: PROMPT_FRAMING_IDS ids around `voice: text`, tokenized as one string."""
        words = tokenizer.encode(f"{voice}: {text}", add_special_tokens=False, split_special_tokens=True)
        head = [self.marker(START_OF_HUMAN), self.bos]
        tail = [self.eot, self.marker(END_OF_HUMAN), self.marker(START_OF_AI), self.marker(START_OF_SPEECH)]
        assert len(head) + len(tail) == PROMPT_FRAMING_IDS
        return head + list(words) + tail
