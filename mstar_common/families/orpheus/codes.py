"""From LM tokens to SNAC windows: the frame rule and the sliding-window chunk policy.

Frame rule (`strict`, the default). A 7-code frame is assembled from audio tokens at positions 0..6, and a
token is accepted at position k only if it comes from band k. A token from another band ends the partial
frame, which is dropped (counted in `num_dropped_frames`, never decoded); a band-0 token then starts the
next frame, any other band is skipped until one does. Marker tokens (start_of_speech, pad, ...) are
skipped. The stream itself never fails on a bad token: it ends on its stop token or its token cap.
`wrap` accepts every audio token at the next position as `(id - audio_start) % 4096`; it exists for
random-weight demos and benchmarks, whose tokens almost never fall in the right band.

Windows (spec/ENGINE.md §4.1 chunk policy). Frame f is decoded in the window of frames
[f-1, f, f+1, f+2] (28 tokens, stride 7) and its audio is the window's second frame, exactly as the
reference decodes once 28 tokens are buffered and then every 7th. Frames missing at the edges are padded
by repeating the nearest frame: frame 0's left context is frame 0 itself, so frame 0 is heard and the
first audio needs 21 tokens, not 28; when the stream ends, its last two frames are decoded with the last
frame repeated (the reference never plays them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from mstar_common.families.orpheus.tokens import CODEBOOK_SIZE, CODES_PER_FRAME, NUM_AUDIO_TOKENS, TokenLayout

WINDOW_FRAMES = 4  # frames per decoded window (28 tokens)
LOOKBACK_FRAMES = 1  # the window's frames before the one it plays
LOOKAHEAD_FRAMES = WINDOW_FRAMES - LOOKBACK_FRAMES - 1
FrameRule = Literal["strict", "wrap"]
FRAME_RULES = ("strict", "wrap")


def window_indices(frame: int, num_frames: int) -> list[int]:
    """The frames of the window that plays `frame`, edges padded by repeating the nearest frame."""
    first = frame - LOOKBACK_FRAMES
    return [min(max(i, 0), num_frames - 1) for i in range(first, first + WINDOW_FRAMES)]


@dataclass(slots=True)
class SpeechChunker:
    """One stream's codec state: tokens in, windows `[N, 4, 7]` of SNAC codes out, in play order."""

    layout: TokenLayout
    rule: FrameRule = "strict"
    partial: list[int] = field(default_factory=list)
    frames: list[list[int]] = field(default_factory=list)  # frames[i] is stream frame `frames_offset + i`
    frames_offset: int = 0
    num_frames: int = 0
    num_emitted: int = 0  # frames whose window was handed out
    num_dropped_frames: int = 0
    is_skipping: bool = False  # after a malformed frame: waiting for a band-0 token

    def push(self, token_ids: list[int]) -> np.ndarray:
        for token in token_ids:
            self._accept(token)
        return self._windows(self.num_frames - 1 - LOOKAHEAD_FRAMES)

    def close(self) -> np.ndarray:
        """Windows for every frame not yet played (a trailing partial frame is dropped)."""
        if self.partial:
            self.num_dropped_frames += 1
            self.partial = []
        return self._windows(self.num_frames - 1)

    def _accept(self, token: int) -> None:
        index = token - self.layout.audio_start
        if not 0 <= index < NUM_AUDIO_TOKENS:
            return  # a marker: not audio
        if self.rule == "wrap":
            self._append(index % CODEBOOK_SIZE)
            return
        band, code = divmod(index, CODEBOOK_SIZE)
        if band == len(self.partial) and not (self.is_skipping and band):
            self.is_skipping = False
            self._append(code)
            return
        if self.partial:
            self.num_dropped_frames += 1
            self.partial = []
        self.is_skipping = band != 0
        if band == 0:
            self._append(code)

    def _append(self, code: int) -> None:
        self.partial.append(code)
        if len(self.partial) == CODES_PER_FRAME:
            self.frames.append(self.partial)
            self.num_frames += 1
            self.partial = []

    def _windows(self, last_ready: int) -> np.ndarray:
        ready = range(self.num_emitted, last_ready + 1)
        windows = np.empty((len(ready), WINDOW_FRAMES, CODES_PER_FRAME), dtype=np.int32)
        for row, frame in enumerate(ready):
            for col, index in enumerate(window_indices(frame, self.num_frames)):
                windows[row, col] = self.frames[index - self.frames_offset]
        if len(ready):
            self.num_emitted = last_ready + 1
            self._trim()
        return windows

    def _trim(self) -> None:
        """Keep only the frames a later window can still read (from the next frame's left context on)."""
        keep_from = max(self.num_emitted - LOOKBACK_FRAMES, 0)
        if keep_from > self.frames_offset:
            del self.frames[: keep_from - self.frames_offset]
            self.frames_offset = keep_from
