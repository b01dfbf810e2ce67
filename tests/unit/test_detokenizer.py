"""Incremental detokenization on a byte-level BPE trained offline, where multi-byte chars split across tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mstar_common.engine.detokenizer import IncrementalDetokenizer

EOS = "<|endoftext|>"
CORPUS = [
    "Hello world, café naïve résumé déjà vu.",
    "中文字符测试，你好世界。",
    "Emoji 😀🎉👍🏽 party 🇫🇷!",
    "The quick brown fox jumps over the lazy dog.",
]
TEXT = "Bonjour café! 中文字符 😀👍🏽🇫🇷 fin. Naïve résumé: 你好世界。🎉 ok"


@pytest.fixture(scope="module")
def tokenizer():
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS]
    )
    model.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token=EOS)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def test_tokenizer_really_splits_characters(tokenizer):
    """Guards the test itself: some tokens decode alone to U+FFFD."""
    assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer.encode(TEXT))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 1000])
def test_deltas_concatenate_to_full_decode(tokenizer, chunk):
    ids = tokenizer.encode(TEXT)
    deltas = _stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("café ") + [eos] + tokenizer.encode("中文") + [eos, eos]
    deltas = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip), ids, 1)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (EOS in "".join(deltas)) is not skip


def test_flush_releases_incomplete_tail(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer)
    emitted = detok.push(ids[:-1])  # the emoji is missing its last byte
    assert "\ufffd" not in emitted
    assert emitted + detok.flush() == tokenizer.decode(ids[:-1])


def test_a_push_ending_mid_character_emits_the_text_before_it(tokenizer):
    """Several tokens in one push (a stream that fell behind) whose last character is not complete yet: the text
    before that character goes out now (it was all held back for it, a stop string in it too)."""
    head = tokenizer.encode("Bonjour café! ok ")
    emoji = tokenizer.encode("😀")
    assert len(emoji) > 1  # the emoji is split over tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(head + emoji[:-1]) == "Bonjour café! ok "
    assert detok.push(emoji[-1:]) == "😀"
    assert detok.push(tokenizer.encode(" fin")) == " fin"


def test_reloaded_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = reloaded.encode(TEXT)
    assert "".join(_stream(IncrementalDetokenizer(reloaded), ids, 1)) == TEXT


class _SpyTokenizer:
    """Records how many ids each decode call sees."""

    def __init__(self, tokenizer):
        self.tokenizer, self.max_decoded, self.num_calls = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.max_decoded = max(self.max_decoded, len(ids))
        self.num_calls += 1
        return self.tokenizer.decode(ids, **kwargs)


def test_window_stays_bounded(tokenizer):
    """A long stream never decodes more than a short window, so each push is O(new tokens)."""
    ids = tokenizer.encode(TEXT) * 50
    spy = _SpyTokenizer(tokenizer)
    assert "".join(_stream(IncrementalDetokenizer(spy), ids, 1)) == TEXT * 50
    assert spy.max_decoded <= 12


def test_the_prompt_primes_the_window_so_a_sentencepiece_first_word_keeps_its_space(tokenizer):
    """A SentencePiece decoder (Llama 2, Mistral) strips one leading space from a text's start: decoded alone, the
    first generated "▁Paris" lost its space, and a completion joined its prompt as "isParis". With the prompt's last
    ids as context the stream decodes as the whole sequence does after the prompt (as vLLM primes it)."""
    from tokenizers import normalizers

    model = Tokenizer(models.BPE(byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    corpus = ["The capital of France is Paris .", "Paris is nice", "hello world"] * 50
    model.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    sp = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")
    prompt = sp.encode("The capital of France is", add_special_tokens=False)
    output = sp.encode("Paris .", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(output)[0].startswith("▁")
    want = sp.decode(prompt + output)[len(sp.decode(prompt)):]
    assert want == " Paris ."
    for chunk in (1, 2, len(output)):
        assert "".join(_stream(IncrementalDetokenizer(sp, context=prompt), output, chunk)) == want
    assert "".join(_stream(IncrementalDetokenizer(sp), output, 1)) == "Paris ."  # without the prompt: no space
    # byte-level BPE: the same text with or without a context
    ids = tokenizer.encode(TEXT)
    assert "".join(_stream(IncrementalDetokenizer(tokenizer, context=ids[:5]), ids[5:], 1)) == tokenizer.decode(ids[5:])


def test_a_context_that_ends_inside_a_character_is_not_used(tokenizer):
    ids = tokenizer.encode("😀 ok")
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, context=ids[:split])
    assert detok._window == []  # not primed: the text after the split would not start where the context's ends
    assert "".join(_stream(detok, ids[split:], 1)) == tokenizer.decode(ids[split:])


@pytest.mark.parametrize("prompt_text", ["The answer 你好", "안녕하세요", "ok 🎉"])
def test_a_prompt_ending_in_a_byte_run_primes_the_window_from_its_characters_start(prompt_text):
    """The prompt's last 4 ids started inside a character: a byte-fallback decoder turned the whole cut run into
    U+FFFD, the context was dropped as if the prompt ended mid-character, and the first generated word lost its
    space ("ok", not " ok")."""
    tokenizer = _byte_fallback_tokenizer()
    prompt = tokenizer.encode(prompt_text)
    output = tokenizer.encode("ok ok", add_special_tokens=False)
    want = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
    assert want == " ok ok"
    for chunk in (1, 2, len(output)):
        assert "".join(_stream(IncrementalDetokenizer(tokenizer, context=prompt), output, chunk)) == want


def _byte_fallback_tokenizer():
    """transformers' own Llama (SentencePiece) pipeline over a vocabulary of the 256 byte tokens: every character
    outside it falls back to its UTF-8 bytes, one token each, decoded by ByteFallback."""
    from transformers.models.llama.tokenization_llama import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259, "▁ok": 260}
    return LlamaTokenizer(vocab=vocab, merges=[])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_sentencepiece_byte_fallback_runs_stream_whole_characters(chunk):
    """The kept context was cut 4 tokens back, inside a character: ByteFallback decodes a run of byte tokens as one,
    so every later window of the run ended in U+FFFD and '你好世界。🎉 ok' streamed as '你好' and 13 U+FFFD."""
    tokenizer = _byte_fallback_tokenizer()
    for text in ("你好世界。🎉 ok", "ok 🎉🎉 é 你"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > len(text)  # the characters really are byte runs
        pieces = _stream(IncrementalDetokenizer(tokenizer), ids, chunk)
        assert "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in piece for piece in pieces)


def test_an_output_of_real_replacement_characters_costs_a_few_decodes_a_push(tokenizer):
    """A model may write U+FFFD itself; such text is held back (it could be a character's first bytes) until another
    character comes, and each push decoded every held end again: 400 of them took 38 s of the pump's thread."""
    spy = _SpyTokenizer(tokenizer)
    ids = tokenizer.encode("ok " + "\ufffd" * 120 + " done", add_special_tokens=False)
    detok = IncrementalDetokenizer(spy)
    text = "".join(detok.push([token]) for token in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert spy.num_calls <= 4 * len(ids), spy.num_calls
