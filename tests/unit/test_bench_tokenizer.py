"""The random-weight benchmark checkpoints' tokenizer: every id decodes to text, prompts encode as before."""

from mstar_common.bench.checkpoints import build_bench_tokenizer
from mstar_common.families.qwen3.tiny import build_tokenizer


def test_every_id_decodes_to_text_and_prompts_encode_as_the_tiny_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    vocab_size = 5000
    build_bench_tokenizer(vocab_size).save_pretrained(tmp_path)
    bench, tiny = AutoTokenizer.from_pretrained(str(tmp_path)), build_tokenizer()
    assert len(bench) == vocab_size
    # The tiny tokenizer's ids, special and added tokens keep their ids and their text.
    assert bench.get_added_vocab() == tiny.get_added_vocab()
    for text in (" the" * 7, "<|im_start|>user\nhello<|im_end|>", "<think>x</think>"):
        assert bench.encode(text, add_special_tokens=False) == tiny.encode(text, add_special_tokens=False)
    assert bench.decode(list(range(3, len(tiny)))) == tiny.decode(list(range(3, len(tiny))))
    # Ids the tiny tokenizer does not know (a random model's output) each decode to their own text.
    assert bench.decode([len(tiny)]) == f" w{len(tiny)}"
    assert bench.decode([vocab_size - 1, 1234]) == f" w{vocab_size - 1} w1234"
    assert all(bench.decode([i]) for i in range(vocab_size))
    assert bench.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        tiny.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
