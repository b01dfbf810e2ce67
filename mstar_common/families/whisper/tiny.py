"""Random Whisper checkpoints with an offline byte-level BPE tokenizer: a tiny one for tests and demos, and one
at Whisper large-v3's shapes (random weights, the real vocabulary layout) for benchmarks.

Built with transformers' own `WhisperForConditionalGeneration`, so it is a real HF checkpoint
(config.json, generation_config.json, model.safetensors, preprocessor_config.json, tokenizer files).
The vocabulary is laid out like OpenAI's, text first and every special token above it:

    [ BPE text tokens | <|endoftext|> <|startoftranscript|> <|en|> … <|yue|> (100 languages)
      <|translate|> <|transcribe|> <|startoflm|> <|startofprev|> <|nospeech|> <|notimestamps|>
      <|0.00|> … <|30.00|> (1501 timestamps) ]

so transformers' Whisper `generate` (language detection, forced task, timestamp rules) behaves as with a
real checkpoint. The tiny one's `max_target_positions` is small (128) to bound decode time in tests; it builds
in a second or two. The large-v3 one pads the BPE vocabulary with unreachable filler tokens (" x123") to
OpenAI's 50,257 text tokens, so every id sits where large-v3 has it (51,866 in all); it takes a minute or two
and ~3 GB (bfloat16). Deterministic for a seed. Concurrent callers are safe (build in a temp dir, rename).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from mstar_common.checkpoints import vary_norms_and_biases, write_once
from mstar_common.families.qwen3.tiny import CORPUS

# The 100 language codes of Whisper large-v3, in token order (the language token of code i is sot + 1 + i).
LANGUAGE_CODES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()
TASK_TOKENS = ("<|translate|>", "<|transcribe|>")
TAIL_TOKENS = ("<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>")
NUM_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in 20 ms steps
BPE_VOCAB_SIZE = 600
# Symbols Whisper never transcribes from speech (a subset of OpenAI's non-speech list), suppressed always.
NON_SPEECH_SYMBOLS = '"#()*+/:;<=>@[\\]^_`{|}~'

TINY_SHAPE = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=1500, max_target_positions=128,
)
LARGE_V3_SHAPE = dict(
    d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
    encoder_ffn_dim=5120, decoder_ffn_dim=5120, max_source_positions=1500, max_target_positions=448,
)
OPENAI_TEXT_TOKENS = 50_257  # text ids below <|endoftext|> in OpenAI's multilingual vocabulary
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "preprocessor_config.json")


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, num_mel_bins: int = 80, varied: bool = False) -> Path:
    """Write the tiny checkpoint + tokenizer to `out_dir` (if not already there) and return its path. `varied`:
    with its norm weights and zero biases drawn at random too (`vary_norms_and_biases`), for parity tests that
    must notice a norm or a bias ignored; the default keeps transformers' init there, whose decoder emits the
    timestamps the segment tests need."""
    return write_once(out_dir, lambda tmp: _build(tmp, seed, num_mel_bins, TINY_SHAPE, None, True, varied),
                      _REQUIRED_FILES)


def build_large_v3_random(out_dir: str | Path, seed: int = 0) -> Path:
    """Whisper large-v3's shapes (128 mel bins, 32 + 32 layers, d_model 1280, vocab 51,866), random bf16 weights."""
    return write_once(out_dir, lambda tmp: _build(tmp, seed, 128, LARGE_V3_SHAPE, OPENAI_TEXT_TOKENS, False),
                      _REQUIRED_FILES)


def special_tokens() -> list[str]:
    """Every special token in id order (they follow the text tokens)."""
    languages = [f"<|{code}|>" for code in LANGUAGE_CODES]
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(NUM_TIMESTAMPS)]
    return ["<|endoftext|>", "<|startoftranscript|>", *languages, *TASK_TOKENS, *TAIL_TOKENS, *timestamps]


def build_tokenizer(num_text_tokens: int | None = None):
    """Byte-level BPE on a small corpus (padded with unreachable filler tokens to `num_text_tokens`), Whisper's
    special tokens appended, as a transformers WhisperTokenizer."""
    from transformers import WhisperTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    vocab = bpe.get_vocab()
    for i in range(len(vocab), num_text_tokens or 0):
        vocab[f"Ġx{i}"] = i  # byte-level text " x<i>" that no merge produces
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in _merges(bpe)]
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    # Timestamps are plain added tokens in OpenAI's tokenizer (decode filters them); the rest are special.
    specials = special_tokens()
    tokenizer.add_tokens([AddedToken(t, special=not t[2].isdigit(), normalized=False) for t in specials])
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in specials if not t[2].isdigit()]})
    return tokenizer


def _merges(bpe: Tokenizer) -> list:
    import json

    return json.loads(bpe.to_str())["model"]["merges"]


def _build(out: Path, seed: int, num_mel_bins: int, shape: dict, num_text_tokens: int | None,
           is_tiny: bool, varied: bool = False) -> None:
    from transformers import WhisperFeatureExtractor

    tokenizer = build_tokenizer(num_text_tokens)
    model = _build_model(tokenizer, seed, num_mel_bins, shape, is_tiny, varied)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=num_mel_bins).save_pretrained(out)


def _build_model(tokenizer, seed: int, num_mel_bins: int, shape: dict, is_tiny: bool, varied: bool = False):
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special_tokens()[: 2 + len(LANGUAGE_CODES) + 6]}
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    vocab_size = len(tokenizer)
    assert vocab_size == sot + 1 + len(LANGUAGE_CODES) + len(TASK_TOKENS) + len(TAIL_TOKENS) + NUM_TIMESTAMPS
    space = tokenizer.convert_tokens_to_ids("Ġ")
    symbols = sorted({tokenizer.convert_tokens_to_ids(c) for c in NON_SPEECH_SYMBOLS} - {tokenizer.unk_token_id})
    suppress = symbols + [ids[t] for t in (*TASK_TOKENS, "<|startoflm|>", "<|startofprev|>", "<|nospeech|>")]
    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=num_mel_bins, **shape,
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        begin_suppress_tokens=[space, eot], suppress_tokens=suppress,
        # Tiny: wider than HF's 0.02 so random logits are well separated and greedy decoding is stable across
        # implementations (near-ties would flip on float rounding).
        init_std=0.25 if is_tiny else 0.02,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        device = "cpu" if is_tiny or not torch.cuda.is_available() else "cuda"  # a large init is faster there
        with torch.device(device):
            model = WhisperForConditionalGeneration(config).eval()
        if varied:
            vary_norms_and_biases(model)
    if is_tiny:
        with torch.no_grad():
            # Random weights make a decoder that barely listens and mostly emits timestamps (1501 of ~2200 ids):
            # a louder encoder output makes tokens depend on the audio (so a test notices cross-attention mixed
            # up between requests), and quieter timestamp rows leave room for text tokens.
            model.model.encoder.layer_norm.weight.mul_(8.0)
            model.model.decoder.embed_tokens.weight[ids["<|notimestamps|>"] + 1:].mul_(0.5)
    else:
        model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        max_length=shape["max_target_positions"],
        begin_suppress_tokens=[space, eot], suppress_tokens=suppress,
        no_timestamps_token_id=ids["<|notimestamps|>"], prev_sot_token_id=ids["<|startofprev|>"],
        is_multilingual=True, return_timestamps=False, max_initial_timestamp_index=50,
        lang_to_id={f"<|{c}|>": ids[f"<|{c}|>"] for c in LANGUAGE_CODES},
        task_to_id={"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        forced_decoder_ids=[[1, None], [2, ids["<|transcribe|>"]]],
    )
    return model
