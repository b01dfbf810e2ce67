"""A tiny random Qwen3 checkpoint with an offline byte-level BPE tokenizer, for tests and demos.

Built with transformers' own `Qwen3ForCausalLM` (so it is a real HF checkpoint) and a BPE tokenizer trained
here on a small built-in corpus, with a ChatML chat template like Qwen3's (`<|im_start|>`/`<|im_end|>`,
eos = `<|im_end|>`, and an `enable_thinking` switch). Deterministic for a given seed; builds in about a second.

Concurrent callers are safe: each builds into its own temporary directory beside `out_dir` and renames it
into place atomically; a caller that loses the race discards its copy and uses the winner's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from mstar_common.checkpoints import vary_norms_and_biases, write_once

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
BPE_VOCAB_SIZE = 400  # bytes (256) + merges + the special tokens
VOCAB_MULTIPLE = 64  # the model's vocab is the tokenizer's rounded up, as real checkpoints pad theirs
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a little robot who wanted to learn how to sing. Every morning it listened
to the birds in the garden, and every evening it tried to repeat their songs. The other machines
laughed at first, but the robot kept practising. One day a child stopped by the garden and heard the
robot singing, and she smiled. Hello, how are you today? I am fine, thank you, and you? The weather is
nice and the sun is shining. Please tell me a story about the sea, the mountains and the stars.
What is the capital of France? The capital of France is Paris. How many days are there in a week?
There are seven days in a week. Speech, images, text and video are all kinds of data that models read
and write. A server receives requests, schedules them in batches, and streams the answers back.
Numbers such as 1, 2, 3, 10, 42 and 2026 appear in text too. Good morning, good afternoon, good night.
"""


def build_tiny_checkpoint(out_dir: str | Path, seed: int = 0, tie_word_embeddings: bool = True) -> Path:
    """Write the tiny checkpoint + tokenizer to `out_dir` (if not already there) and return its path."""
    return write_once(out_dir, lambda tmp: _build(tmp, seed, tie_word_embeddings), _REQUIRED_FILES)


def _build(out: Path, seed: int, tie_word_embeddings: bool) -> None:
    tokenizer = build_tokenizer()
    model = _build_model(len(tokenizer), tokenizer, seed, tie_word_embeddings)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `CORPUS`, wrapped as a transformers fast tokenizer with the chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(tokenizer_size: int, tokenizer: PreTrainedTokenizerFast, seed: int,
                 tie_word_embeddings: bool) -> Qwen3ForCausalLM:
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3Config(
        vocab_size=-(-tokenizer_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
        # Wider than HF's 0.02 so the random logits are well separated and greedy decoding is stable
        # across implementations (near-ties would flip on float rounding).
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = vary_norms_and_biases(Qwen3ForCausalLM(config).eval())  # norm weights not all 1
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext, do_sample=False,
    )
    return model
