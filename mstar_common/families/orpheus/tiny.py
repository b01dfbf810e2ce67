"""Random-weight Orpheus checkpoints built locally: `orpheus-tiny` (tests, CPU demo) and `orpheus-3b-random`
(Llama-3.2-3B + SNAC 24 kHz at the real shapes, for GPU benchmarks). Nothing is downloaded.

Layout of the directory (what a real deployment assembles from canopylabs/orpheus-3b-0.1-ft and
hubertsiuzdak/snac_24khz):
    config.json, generation_config.json, model.safetensors, tokenizer.json   the Llama LM (transformers' own class)
    snac/config.json, snac/pytorch_model.bin                                  SNAC 24 kHz (the `snac` package's class)

The tokenizer mirrors the Llama-3 layout: a byte-level BPE trained here, filler tokens up to the special
range, `<|begin_of_text|>` … `<|eot_id|>` at +0 … +9 of it, then the `<custom_token_N>` range. Builds are
atomic (a temporary directory renamed into place), so concurrent callers are safe.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mstar_common.checkpoints import vary_norms_and_biases, write_once
from mstar_common.families.orpheus.snac import SNAC_24KHZ
from mstar_common.families.orpheus.tokens import CUSTOM_TOKEN, END_OF_SPEECH, NUM_AUDIO_TOKENS, NUM_MARKERS
from mstar_common.families.qwen3.tiny import CORPUS

logger = logging.getLogger(__name__)

NUM_SPECIAL = 256  # Llama-3 keeps 256 special tokens below the custom range
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(7)),
            "<|eot_id|>"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "snac/config.json", "snac/pytorch_model.bin")


@dataclass(frozen=True, slots=True)
class Preset:
    text_vocab: int  # ids below the custom range (Llama-3: 128256)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    initializer_range: float
    snac: dict


TINY_SNAC = {**SNAC_24KHZ, "encoder_dim": 8, "decoder_dim": 64, "noise": False}  # 24 kHz geometry, 0.1M params
PRESETS = {
    # Wider init than HF's 0.02 so greedy decoding is stable across implementations (no near-ties).
    "tiny": Preset(1024, 64, 128, 2, 4, 2, 16, 131072, 0.2, TINY_SNAC),
    "3b": Preset(128256, 3072, 8192, 28, 24, 8, 128, 131072, 0.02, SNAC_24KHZ),
}


def build_orpheus_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    return write_once(out_dir, lambda tmp: _build(tmp, PRESETS[preset], seed), _REQUIRED)

def _build(out: Path, preset: Preset, seed: int) -> None:
    tokenizer = build_tokenizer(preset.text_vocab)
    tokenizer.save_pretrained(out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _build_lm(preset, len(tokenizer)).save_pretrained(out)
        save_snac_checkpoint(out / "snac", preset.snac)
    logger.info("built Orpheus checkpoint at %s", out)


def build_tokenizer(text_vocab: int) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS.splitlines(), trainer)
    vocab = dict(bpe.get_vocab())
    special_start = text_vocab - NUM_SPECIAL
    vocab |= {f"<|filler_{i}|>": i for i in range(len(vocab), special_start)}
    names = SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(len(SPECIALS) - 3, NUM_SPECIAL - 3)]
    vocab |= {name: special_start + i for i, name in enumerate(names)}
    vocab |= {CUSTOM_TOKEN.format(i): text_vocab + i for i in range(NUM_MARKERS + NUM_AUDIO_TOKENS)}
    trained = json.loads(bpe.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained]
    full = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    full.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    full.decoder = decoders.ByteLevel()
    full.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=full, bos_token=SPECIALS[0], eos_token="<|eot_id|>")


def _build_lm(preset: Preset, tokenizer_size: int) -> LlamaForCausalLM:
    text = preset.text_vocab
    config = LlamaConfig(
        vocab_size=-(-tokenizer_size // 4) * 4, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads, num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim,
        max_position_embeddings=preset.max_positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE},
        bos_token_id=text - NUM_SPECIAL, eos_token_id=text - NUM_SPECIAL + 9,
        initializer_range=preset.initializer_range,
    )
    device = "cuda" if preset.hidden_size > 1024 and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = vary_norms_and_biases(LlamaForCausalLM(config)).to(
            torch.bfloat16 if device == "cuda" else torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=text + END_OF_SPEECH, do_sample=False)
    return model


def save_snac_checkpoint(out: Path, config: dict) -> Path:
    """A random SNAC in the published layout (config.json + pytorch_model.bin), built with the `snac` package, its
    Snake alphas and zero conv biases drawn at random (`vary_norms_and_biases`: as initialised they are 1 and 0, so a
    decoder that ignored or swapped them passed the parity checks)."""
    from snac import SNAC

    out.mkdir(parents=True, exist_ok=True)
    model = vary_norms_and_biases(SNAC(**config).eval())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out
