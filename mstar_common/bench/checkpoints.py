"""Random-weight checkpoints at real shapes (for GPU performance runs; weights cost the same as real ones).

Built with transformers' own classes on the GPU in bf16, saved as HF safetensors, with a tokenizer that covers
the model's whole vocabulary (`build_bench_tokenizer`), so every random output id decodes to text and the OpenAI
proxy streams a chunk for it, as it would for a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    "qwen3-0.6b": dict(family="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960),
    # Llama-3.2-3B uses llama3 RoPE scaling; plain RoPE at theta 5e5 costs the same per step.
    "llama-3.2-3b": dict(family="llama", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500_000.0, max_position_embeddings=131072),
}


FAMILY_SHAPES = {"llama": "llama-3.2-3b", "qwen3": "qwen3-0.6b"}  # the real shape the device scripts build


def add_step_args(parser, family: str, rows: str) -> None:
    """The arguments the decode-step scripts share (scripts/ab_decode_step.py, scripts/profile_decode_step.py);
    `rows_list(args)` reads `--rows`."""
    parser.add_argument("--family", choices=sorted(FAMILY_SHAPES), default=family)
    parser.add_argument("--checkpoint", type=Path, help="default: a random one at the real shape under /tmp")
    parser.add_argument("--rows", default=rows, help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=640, help="tokens of context per row")
    parser.add_argument("--kv-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                        help="the KV pool's element type (resources.kv_cache.dtype): auto = bf16")


def rows_list(args) -> list[int]:
    return [int(r) for r in args.rows.split(",")]


def family_checkpoint(family: str, given: str | Path | None = None) -> Path:
    """`given`, else the family's random checkpoint at its real shape, built once under /tmp/mstar-profile."""
    if given:
        return Path(given)
    name = FAMILY_SHAPES[family]
    return build_random_checkpoint(name, f"/tmp/mstar-profile/{name}")


def build_bench_tokenizer(vocab_size: int):
    """The tiny BPE tokenizer (mstar_common/families/qwen3/tiny.py) with every id below `vocab_size` decodable.

    Its merges, special tokens and chat template are kept, so prompts encode as with the tiny tokenizer (" the"
    is one token); each id it does not know becomes a vocabulary entry " w<id>" that no merge produces. Without
    them a random model's output ids decode to nothing, and the proxy sends no chunk until the end.
    """
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mstar_common.families.qwen3.tiny import build_tokenizer

    tiny = build_tokenizer()
    spec = json.loads(tiny.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for added in spec["added_tokens"]:  # in the vocabulary too, so loading keeps their ids
        vocab[added["content"]] = added["id"]
    assert len(vocab) <= vocab_size, f"vocab_size {vocab_size} is smaller than the tiny tokenizer's {len(vocab)}"
    taken = set(vocab.values())
    vocab.update({f"\u0120w{i}": i for i in range(vocab_size) if i not in taken})  # \u0120: a byte-level space
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                        eos_token=tiny.eos_token, pad_token=tiny.pad_token, unk_token=None)
    tokenizer.chat_template = tiny.chat_template
    return tokenizer


def build_random_checkpoint(name: str, out_dir: str | Path, device: str = "cuda") -> Path:
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(SHAPES[name])
    family = shape.pop("family")
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(**shape, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(torch.bfloat16).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=2, pad_token_id=0, do_sample=False)
    model.save_pretrained(out)
    build_bench_tokenizer(config.vocab_size).save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out
