"""What a component does when one of its CUDA-graph buckets cannot be captured for lack of GPU memory.

Every captured component (the AR engine's decode and prefill/mixed buckets, the denoise steps, the text and audio
encoders, the SNAC codec) captures its buckets at startup, largest first, into one memory pool. A bucket whose
warm-up or capture runs out of GPU memory is dropped by default, with a warning that names it: steps of that size
take the next larger captured bucket, or run eager where none is left. That is slower for those steps but
correct, and the console says so. `MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1` refuses to start instead, naming the
bucket, for deployments whose latency depends on every bucket being captured.

Only out-of-memory is a capacity problem. Any other capture failure is a bug and stops the start-up as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from mstar_common.config import env_switch

logger = logging.getLogger(__name__)

T = TypeVar("T")


def require_graphs() -> bool:
    """`MSTAR_REQUIRE_ACCELERATOR_GRAPHS` (default 0): 1 refuses to start when a bucket cannot be captured."""
    return env_switch("MSTAR_REQUIRE_ACCELERATOR_GRAPHS", False)


class GraphCaptureError(RuntimeError):
    """A bucket could not be captured and `MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1` requires every bucket."""


def capture_or_skip(what: str, capture: Callable[[], T], kept: str | None = None) -> T | None:
    """`capture()`, or None (after a warning naming `what`) where it ran out of GPU memory; with
    `MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1` a `GraphCaptureError` instead. `kept`: `what` is an optional copy of a
    bucket whose graph `kept` names was captured already (a faster form to time against it): its loss warns that
    the bucket keeps that graph, and never stops a start."""
    try:
        return capture()
    except torch.OutOfMemoryError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # what the failed capture held goes back before the next (smaller) bucket
    if kept is not None:
        logger.warning("%s not captured: out of GPU memory (%s); the bucket keeps its %s graph", what, reason, kept)
        return None
    if require_graphs():
        raise GraphCaptureError(
            f"{what}: CUDA graph capture ran out of GPU memory ({reason}), and MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1 "
            f"requires every configured bucket; configure fewer or smaller buckets (decode_buckets, "
            f"prefill_token_buckets, or the component's own), or leave more GPU memory (fewer "
            f"resources.kv_cache.num_pages, fewer components on that GPU)")
    logger.warning("%s not captured: out of GPU memory (%s); steps of that size take a larger "
                   "captured bucket or run eager (MSTAR_REQUIRE_ACCELERATOR_GRAPHS=1 refuses to start instead)",
                   what, reason)
    return None
