"""The token embedding of the dense decoder LMs, with an optional gather of the previous step's tokens.

`TokenEmbedding` is `nn.Embedding` (same parameter and name, so HF checkpoints load unchanged). `forward(ids,
gather)` first sets `ids[dst[i]] = previous[src[i]]` for `i < count[0]` when `gather = (dst, src, count,
previous)` is given: the overlapped step's decode rows take the tokens the step before sampled, still on the
device (mstar_common/engine/cuda_graph.py). With `use_kernel` set (CUDA, `enable_fused_ops`) the gather and the
lookup are one Triton launch (mstar_kernels/embedding.py); the torch ops are the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_common.layers.linear import INTERPRETED


def gather_ids(input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, count: torch.Tensor,
               previous: torch.Tensor) -> None:
    """`input_ids[dst[i]] = previous[src[i]]` for `i < count[0]`, as torch ops (reads `count` on the host: not graph
    safe; the kernels that replace it in a graph are mstar_kernels/gather_tokens.py and mstar_kernels/embedding.py)."""
    n = int(count.reshape(-1)[0])
    input_ids[dst[:n].long()] = previous[src[:n].long()].to(input_ids.dtype)


class TokenEmbedding(nn.Embedding):
    use_kernel = False

    def forward(self, input_ids: torch.Tensor,
                gather: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.use_kernel and (input_ids.is_cuda or INTERPRETED) and input_ids.dim() == 1 and \
                input_ids.is_contiguous():  # on the CPU only in Triton's interpreter (the kernel tests)
            from mstar_kernels.embedding import embed_tokens

            return embed_tokens(self.weight, input_ids, gather)
        if gather is not None:
            gather_ids(input_ids, *gather)
        return super().forward(input_ids)
