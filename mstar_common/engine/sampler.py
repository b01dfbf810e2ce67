"""Batched token sampler (spec/ENGINE.md §9).

Order per row: repetition penalty -> greedy argmax (greedy rows) -> temperature -> top-k -> top-p -> min-p -> draw.
Every filter runs on the whole batch with per-row parameters held as tensors, so the step stays free of
per-row Python and can move into a captured CUDA graph later. A filter that is off for every row is skipped.

The draw is an exponential race (Gumbel-max): `argmax(logits - log(E))` with `E ~ Exp(1)` per token picks
token `i` with probability `softmax(logits)[i]`. Each seeded row draws its noise from its own generator,
so its token depends only on its seed, its step and its own logits, never on its batch-mates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_common.engine.types import SamplingParams

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny  # floor for the exponential noise, keeps log() finite


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator | None:
    """A generator seeded for one request, or None to draw from the engine's default RNG."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns one step's logits into one token per row.

    Contract of `sample`: `logits` is `[B, V]` float32 and is not modified; `params`, `generators` and
    `history` have one entry per row (`history` = prompt + output ids so far, read only where the row's
    repetition penalty is not 1.0). Returns a LongTensor `[B]` on `logits.device`.

    top-p boundary: over the tempered, top-k-renormalised probabilities sorted high to low, a token is kept
    when the probability mass strictly above it is `< top_p`. So the token whose running total reaches or
    crosses `top_p` is kept (FlashInfer and HF `TopPLogitsWarper` behave the same), and the most likely token
    always survives. `top_p >= 1` keeps everything.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        history: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        logits = apply_repetition_penalty(logits, [p.repetition_penalty for p in params], history)
        is_greedy = [p.is_greedy for p in params]
        greedy_tokens = logits.argmax(dim=-1)
        if all(is_greedy):
            return greedy_tokens
        filtered = self.filter(logits, params)
        sampled = _draw(filtered, generators)
        if not any(is_greedy):
            return sampled
        greedy_mask = torch.tensor(is_greedy, dtype=torch.bool).to(logits.device, non_blocking=True)
        return torch.where(greedy_mask, greedy_tokens, sampled)

    def filter(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Tempered logits with filtered tokens set to -inf (penalty already applied).

        Greedy rows pass through unfiltered at T=1, so they never force a filter on for the whole batch.
        """
        device, vocab_size = logits.device, logits.shape[-1]
        sampled = [p for p in params if not p.is_greedy]
        temperatures = [1.0 if p.is_greedy else p.temperature for p in params]
        if any(p.temperature != 1.0 for p in sampled):
            logits = logits / _column(temperatures, torch.float32, device)
        if any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in sampled):
            top_ks = [p.top_k if 0 < p.top_k < vocab_size and not p.is_greedy else vocab_size for p in params]
            top_ps = [1.0 if p.is_greedy else p.top_p for p in params]
            top_k, top_p = _column(top_ks, torch.int64, device), _column(top_ps, torch.float32, device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0.0 for p in sampled):
            min_ps = [0.0 if p.is_greedy else p.min_p for p in params]
            logits = apply_min_p(logits, _column(min_ps, torch.float32, device))
        return logits


def apply_repetition_penalty(
    logits: torch.Tensor, penalties: Sequence[float], history: Sequence[Sequence[int]]
) -> torch.Tensor:
    """HF semantics: for each id seen in the row, logit > 0 -> logit / penalty, else logit * penalty."""
    rows = [r for r, penalty in enumerate(penalties) if penalty != 1.0 and len(history[r]) > 0]
    if not rows:
        return logits
    row_ids = [r for r in rows for _ in history[r]]
    token_ids = [t for r in rows for t in history[r]]
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    seen[torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device)] = True
    penalty = _column(penalties, logits.dtype, logits.device)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but the top-k logits (ties with the k-th kept), then apply top-p to what is left.

    `top_k` is `[B, 1]` int64 with `V` meaning off; `top_p` is `[B, 1]` float with 1.0 meaning off.
    One descending sort serves both filters.
    """
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    kth_logit = sorted_logits.gather(1, top_k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything: rounding can push the mass above a tail token to 1.0.
    sorted_remove = (mass_above >= top_p) & (top_p < 1.0)
    sorted_remove |= sorted_logits == _NEG_INF  # carries the top-k cut through the scatter below
    remove = sorted_remove.scatter(1, sorted_ids, sorted_remove)
    return logits.masked_fill(remove, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p). `min_p` is `[B, 1]`."""
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log()
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _draw(logits: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from softmax(logits) by exponential race; -inf logits are never drawn."""
    noise = torch.empty_like(logits)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        # Unseeded rows share the default RNG, so one draw covers them all.
        index = torch.tensor(unseeded, device=logits.device)
        noise[index] = torch.empty((len(unseeded), logits.shape[1]), device=logits.device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (logits - noise.clamp_min_(_TINY).log()).argmax(dim=-1)


def _column(values: Sequence[float | int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row values as a `[B, 1]` tensor, built on the host and copied once."""
    return torch.tensor(values, dtype=dtype).unsqueeze(1).to(device, non_blocking=True)


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (the lowest index of its maximum): on CUDA mstar_kernels/argmax.py's two short launches
    (torch reduces a 128k-logit row in one thread block, 28 us on the H200), elsewhere torch's argmax. On CUDA the
    kernel stores the tokens into `out` where given (int32 or int64) and returns it; elsewhere `out` is not used."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1:
        from mstar_kernels.argmax import row_argmax

        return row_argmax(logits, out)
    return logits.argmax(dim=-1)
