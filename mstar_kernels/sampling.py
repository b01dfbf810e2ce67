"""On-device sampling for captured steps: per-row parameters live in device buffers, no host reads.

`sample_on_device` applies temperature, top-k, top-p and min-p to every row (a row with them off passes through
unchanged), then draws by an exponential race whose noise comes from a counter-based RNG keyed by the row's
seed: `argmax(logits - log(-log(U)))`, `U = rand(seed_row, token)`. The host sets each row's seed to a mix of
the request's seed and the row's output index, so a token depends only on (seed, step, logits), never on the
batch or on whether the step was replayed from a graph. Greedy rows take the argmax of the raw logits.
Both argmaxes are mstar_kernels/argmax.py's; the draw adds the noise as it reads the filtered logits.
"""

from __future__ import annotations

import os

import torch

from mstar_common.engine.sampler import apply_min_p, apply_top_k_top_p
from mstar_kernels.argmax import gumbel_argmax, row_argmax
from mstar_kernels.top_k_top_p import MAX_VOCAB, top_k_top_p

_SORT_FREE_FILTER = os.environ.get("MSTAR_TOP_P_KERNEL", "1") != "0"  # docs/deployment.md "Kernel switches"


def sample_on_device(logits: torch.Tensor, is_greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row; every argument is a device tensor of `[B]` (logits `[B, V]` fp32). Graph safe."""
    greedy = row_argmax(logits.contiguous())
    scaled = logits / temperature[:, None]
    if _SORT_FREE_FILTER and logits.shape[1] <= MAX_VOCAB:
        filtered = top_k_top_p(scaled, top_k, top_p)  # mstar_kernels/top_k_top_p.py: no sort (off until timed)
    else:
        filtered = apply_top_k_top_p(scaled, top_k[:, None].long(), top_p[:, None])
    filtered = apply_min_p(filtered, min_p[:, None])
    sampled = gumbel_argmax(filtered.contiguous(), seeds)
    return torch.where(is_greedy, greedy, sampled)


def sample_on_device_ref(logits, is_greedy, temperature, top_k, top_p, min_p, seeds):
    """The same filters with torch's own RNG (statistically equal, not bit-equal, to `sample_on_device`)."""
    greedy = logits.argmax(dim=-1)
    filtered = apply_min_p(apply_top_k_top_p(logits / temperature[:, None], top_k[:, None].long(), top_p[:, None]),
                           min_p[:, None])
    noise = torch.empty_like(filtered).exponential_().clamp_min_(torch.finfo(torch.float32).tiny).log()
    return torch.where(is_greedy, greedy, (filtered - noise).argmax(dim=-1))
