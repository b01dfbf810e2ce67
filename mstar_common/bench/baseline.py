"""The yardsticks measured in the same run: HF `generate` on the same checkpoint and lengths, the GPU's read
bandwidth, and the weight-streaming floor (weight bytes / read bandwidth: no decode step can be faster).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def read_bandwidth(device: str = "cuda", gib: int = 4, repeats: int = 20) -> dict:
    """Device read bandwidth (a sum over `gib` GiB of bf16, bytes read / time) and copy bandwidth (r + w)."""
    x = torch.randn(gib * 2**30 // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return sorted(times)[len(times) // 2]

    nbytes = x.numel() * x.element_size()
    read_s = timed(lambda: x.sum(dtype=torch.float32))
    copy_s = timed(lambda: y.copy_(x))
    return {"read_tb_per_s": nbytes / read_s / 1e12, "copy_rw_tb_per_s": 2 * nbytes / copy_s / 1e12}


STORED_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I16": 2,
                "I32": 4, "I64": 8, "BOOL": 1}
DERIVED_SUFFIXES = (".inv_freq", ".cos_cached", ".sin_cached")  # RoPE's tables: computed at load, not weights


def weight_bytes(checkpoint: str | Path, dtype: str | None = None) -> int:
    """Bytes a decode step must read: every weight once, at the served `dtype` (torch's name, e.g. bfloat16; None:
    as stored). The vocabulary head is read whole; a tied head is the embedding (counted once, whether or not the
    file also stores `lm_head.weight`), and an untied model's input embedding is not counted (a step gathers a row
    a token). RoPE's stored tables are not weights."""
    import json

    from safetensors import safe_open

    folder = Path(checkpoint)
    config = folder / "config.json"
    tied = bool(json.loads(config.read_text()).get("tie_word_embeddings", False)) if config.is_file() else False
    served = getattr(torch, dtype).itemsize if dtype else None
    sizes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - not a mapping
                if name.endswith(DERIVED_SUFFIXES):
                    continue
                info = reader.get_slice(name)
                numel = 1
                for d in info.get_shape():
                    numel *= d
                stored = info.get_dtype()
                if stored not in STORED_BYTES:
                    raise ValueError(f"{file.name}: {name}: a tensor of type {stored} (not one weight_bytes knows)")
                floating = stored.startswith(("F", "BF"))
                sizes[name] = numel * (served if served and floating else STORED_BYTES[stored])
    embeds = [name for name in sizes if name.endswith("embed_tokens.weight")]
    heads = [name for name in sizes if name.endswith("lm_head.weight")]
    if tied and embeds:
        for name in heads:  # the embedding is the head
            del sizes[name]
    elif heads:
        for name in embeds:  # a row a token
            del sizes[name]
    return sum(sizes.values())


@torch.inference_mode()
def hf_generate(checkpoint: str | Path, prompt_len: int, output_len: int, batch_sizes: list[int],
                device: str = "cuda", repeats: int = 3, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """HF `generate` (greedy, exactly `output_len` tokens) per batch size, timed `repeats` times after a warm-up:
    the fastest run's wall time and output tok/s (so a ratio against it is the conservative one), and every
    run's tok/s, and the mean time per decode step after the first token (`itl_ms`; None for one output token).
    HF's speed is set by the host's Python; on the lent H200s it moved 2x between machines."""
    from transformers import AutoModelForCausalLM

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).to(device).eval()
    vocab = model.config.vocab_size

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()

    results = []
    for batch in batch_sizes:
        ids = torch.randint(3, min(400, vocab), (batch, prompt_len), device=device, generator=None)
        mask = torch.ones_like(ids)

        def gen(n: int, ids=ids, mask=mask):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)

        gen(4)
        sync()
        walls, firsts = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            gen(1)  # the prompt and the first token: what the whole run spends before its decode steps
            sync()
            firsts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = gen(output_len)
            sync()
            walls.append(time.perf_counter() - t0)
            assert out.shape == (batch, prompt_len + output_len)
        wall = min(walls)
        # the mean time per decode step: the fastest run less the fastest prompt-and-first-token, over the steps
        # after the first token (both fastest-of-N, so a slow first run cannot make it negative unnoticed)
        itl_ms = max(wall - min(firsts), 0.0) / (output_len - 1) * 1e3 if output_len > 1 else None
        results.append({"batch": batch, "prompt_len": prompt_len, "output_len": output_len, "wall_s": wall,
                        "output_tok_per_s": batch * output_len / wall,
                        "itl_ms": itl_ms, "runs_tok_per_s": [batch * output_len / w for w in walls]})
    return results
