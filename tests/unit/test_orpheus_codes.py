"""Orpheus token -> frame -> window rules: the strict frame check, resync, markers, edge padding, wrap."""

import numpy as np
import pytest

from mstar_common.families.orpheus.codes import SpeechChunker, window_indices
from mstar_common.families.orpheus.tokens import CODEBOOK_SIZE, TokenLayout

LAYOUT = TokenLayout(custom_start=1000, vocab_size=1000 + 10 + 7 * 4096, bos=1, eot=2)
START = LAYOUT.audio_start


def tokens_for(frames):
    return [START + pos * CODEBOOK_SIZE + code for frame in frames for pos, code in enumerate(frame)]


def frames(n, base=0):
    return [[(base + 7 * f + p) % CODEBOOK_SIZE for p in range(7)] for f in range(n)]


def test_window_indices_pad_edges_by_repeating_the_nearest_frame():
    assert window_indices(0, 10) == [0, 0, 1, 2]
    assert window_indices(5, 10) == [4, 5, 6, 7]
    assert window_indices(8, 10) == [7, 8, 9, 9]
    assert window_indices(0, 1) == [0, 0, 0, 0]


def test_windows_come_out_as_frames_complete_then_the_tail_at_close():
    chunker = SpeechChunker(LAYOUT)
    fs = frames(6)
    got = [chunker.push(tokens_for([f])) for f in fs]
    assert [len(w) for w in got] == [0, 0, 1, 1, 1, 1]  # frame f plays once frame f + 2 exists (21 tokens)
    np.testing.assert_array_equal(got[2][0], np.array([fs[0], fs[0], fs[1], fs[2]]))
    np.testing.assert_array_equal(got[5][0], np.array([fs[2], fs[3], fs[4], fs[5]]))
    tail = chunker.close()
    np.testing.assert_array_equal(tail, np.array([[fs[3], fs[4], fs[5], fs[5]], [fs[4], fs[5], fs[5], fs[5]]]))
    assert chunker.num_emitted == 6 and len(chunker.frames) <= 4  # only the frames later windows can read


def test_tokens_split_anywhere_give_the_same_windows():
    tokens = tokens_for(frames(9))
    whole = SpeechChunker(LAYOUT)
    expected = np.concatenate([whole.push(tokens), whole.close()])
    pieces = SpeechChunker(LAYOUT)
    got = [pieces.push(tokens[i:i + 5]) for i in range(0, len(tokens), 5)] + [pieces.close()]
    np.testing.assert_array_equal(np.concatenate(got), expected)
    assert len(expected) == 9


def test_a_short_stream_plays_every_frame():
    chunker = SpeechChunker(LAYOUT)
    assert len(chunker.push(tokens_for(frames(1)))) == 0
    tail = chunker.close()
    assert tail.shape == (1, 4, 7)
    assert len(SpeechChunker(LAYOUT).close()) == 0


def test_malformed_frame_is_dropped_and_the_stream_resyncs_on_band_zero():
    fs = frames(4)
    good = tokens_for(fs[:1])
    bad = tokens_for(fs[1:2])[:3] + [START + 5 * CODEBOOK_SIZE + 1]  # position 3 gets a band-5 token
    stray = [START + 2 * CODEBOOK_SIZE + 7, START + 6 * CODEBOOK_SIZE]  # skipped until a band-0 token
    chunker = SpeechChunker(LAYOUT)
    windows = chunker.push(good + bad + stray + tokens_for(fs[2:]))
    assert chunker.num_dropped_frames == 1 and chunker.num_frames == 3
    windows = np.concatenate([windows, chunker.close()])
    np.testing.assert_array_equal(windows[:, 1], np.array([fs[0], fs[2], fs[3]]))


def test_markers_are_skipped_and_the_partial_tail_is_dropped_at_close():
    chunker = SpeechChunker(LAYOUT)
    tokens = tokens_for(frames(2))
    tokens.insert(3, LAYOUT.marker(1))  # start_of_speech inside a frame: not audio, skipped
    assert len(chunker.push(tokens + tokens_for(frames(1))[:4])) == 0
    assert chunker.num_frames == 2
    assert len(chunker.close()) == 2 and chunker.num_dropped_frames == 1


def test_wrap_rule_keeps_every_audio_token():
    chunker = SpeechChunker(LAYOUT, rule="wrap")
    rng = np.random.default_rng(0)
    tokens = (START + rng.integers(0, 7 * CODEBOOK_SIZE, size=70)).tolist()
    windows = np.concatenate([chunker.push(tokens), chunker.close()])
    assert chunker.num_frames == 10 and chunker.num_dropped_frames == 0
    np.testing.assert_array_equal(windows[:, 1].reshape(-1), (np.array(tokens) - START) % CODEBOOK_SIZE)


def test_prompt_format_matches_the_reference():
    class Tok:
        def encode(self, text, add_special_tokens, split_special_tokens):
            assert not add_special_tokens and split_special_tokens
            return [ord(c) for c in text]

    ids = LAYOUT.prompt_ids(Tok(), "hi", "tara")
    assert ids == [1003, 1, *[ord(c) for c in "tara: hi"], 2, 1004, 1005, 1001]


@pytest.mark.parametrize("rule", ["strict", "wrap"])
def test_codes_are_in_range(rule):
    chunker = SpeechChunker(LAYOUT, rule=rule)
    windows = np.concatenate([chunker.push(tokens_for(frames(5, base=4090))), chunker.close()])
    assert windows.min() >= 0 and windows.max() < CODEBOOK_SIZE
