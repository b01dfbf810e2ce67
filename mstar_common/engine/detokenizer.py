"""Incremental, byte-safe detokenization of a token stream (spec/ENGINE.md §3.1 "Output path").

Byte-level BPE can split one UTF-8 character across tokens, so decoding a token on its own may end in
U+FFFD. Each push decodes a short window: a few already-emitted tokens for context plus the unread ones,
and emits the text past what the context alone decodes to. A window whose text ends in U+FFFD holds back
the tokens of that incomplete character until it completes; the text before it goes out. Decoding the
context too (rather than only the new tokens) keeps start-of-text effects, such as a decoder stripping a
leading space, out of mid-stream deltas.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_NUM_CONTEXT_TOKENS = 4  # emitted tokens kept in the window; enough context for merges and space handling


class IncrementalDetokenizer:
    """Turns pushed token ids into newly completed text.

    `push(ids)` returns the text completed by these ids (possibly ""); `flush()` returns what is still held
    back at the end of the stream, U+FFFD included if the stream really ended mid-character. Each push
    costs O(window), not O(output): the window holds at most `_NUM_CONTEXT_TOKENS` emitted tokens plus the
    tokens not yet emitted.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, context: list[int] | None = None):
        """`context`: the ids before the stream (the prompt's), whose last few prime the window as already emitted,
        so that the first tokens decode as they do after the prompt: a SentencePiece decoder (Llama 2, Mistral)
        strips one leading space from a text's start, which would take the space off the first word. A context
        that ends inside a character is not used (its text would not be a prefix of the text after it); one whose
        last few ids start inside a character is widened to the character's start, as `_advance` widens its own."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._num_read = 0  # leading window tokens whose text was already emitted
        self._read_text = ""  # their text (the context's), decoded once when the window is cut
        self._num_scanned = 0  # window ends up to here decode to an incomplete character (_push_complete_head)
        if context:
            start, text = self._context(list(context), len(context))
            if not text.endswith(_REPLACEMENT):
                self._window, self._num_read, self._read_text = list(context[start:]), len(context) - start, text

    def push(self, token_ids: list[int]) -> str:
        self._window.extend(token_ids)
        prefix_text, text = self._decode_window()
        if text.endswith(_REPLACEMENT):
            return self._push_complete_head(prefix_text)
        # Advance even when nothing new decoded (e.g. skipped special tokens), so such runs never pile up.
        self._advance(len(self._window))
        return text[len(prefix_text) :]

    def _push_complete_head(self, prefix_text: str) -> str:
        """The window ends in an incomplete character: emit the text of the unread tokens before it and wait for
        the bytes that finish it. (A push of several tokens, as a stream that fell behind gets, would otherwise
        hold back all of their text, a stop string in it too, for one character.)"""
        # A head's text does not change as tokens arrive, so the ends scanned by earlier pushes are not decoded
        # again: an output of many real U+FFFD characters (held back until another character comes) cost each
        # push a decode of every held end, O(n^2) decodes on the pump thread.
        for end in range(len(self._window) - 1, max(self._num_read, self._num_scanned), -1):
            head = self._decode(self._window[:end])
            if not head.endswith(_REPLACEMENT):
                self._advance(end)
                return head[len(prefix_text) :]
        self._num_scanned = len(self._window)  # the whole window's text ends in U+FFFD too (push checked it)
        return ""

    def flush(self) -> str:
        prefix_text, text = self._decode_window()
        self._window, self._num_read, self._read_text, self._num_scanned = [], 0, "", 0
        return text[len(prefix_text) :]

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy of the stream's state: pushes to it leave this one as it is."""
        twin = IncrementalDetokenizer(self._tokenizer, self._skip_special_tokens)
        twin._window, twin._num_read = list(self._window), self._num_read
        twin._read_text, twin._num_scanned = self._read_text, self._num_scanned
        return twin

    def _decode_window(self) -> tuple[str, str]:
        return self._read_text, self._decode(self._window)

    def _advance(self, end: int) -> None:
        """The window's first `end` tokens are emitted; keep the last few of them as context for the next push.
        The context starts on a character's first token: one cut inside a character decodes to U+FFFD there, and a
        SentencePiece byte-fallback decoder (Llama 2, TinyLlama) then turns its whole run of byte tokens into
        U+FFFD, in every later window of the run (held back, then flushed as U+FFFD). A character is at most 4
        bytes, so at most 3 tokens more are kept."""
        start, context = self._context(self._window, end)
        self._window = self._window[start:]
        self._num_read, self._read_text, self._num_scanned = end - start, context, 0

    def _context(self, token_ids: list[int], end: int) -> tuple[int, str]:
        """Where the context before `end` starts, and its text: `_NUM_CONTEXT_TOKENS` back, or up to 3 further
        while that cut falls inside a character (`_advance`)."""
        start = max(0, end - _NUM_CONTEXT_TOKENS)
        text = self._decode(token_ids[start:end])
        while start > 0 and text.startswith(_REPLACEMENT) and end - start < _NUM_CONTEXT_TOKENS + 3:
            start -= 1
            text = self._decode(token_ids[start:end])
        return start, text

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
