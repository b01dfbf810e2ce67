"""Helpers for packed projections (several HF linears served as one GEMM)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def concat_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `linears`' outputs (same input, same dtype/device)."""
    first = linears[0]
    has_bias = first.bias is not None
    weight = torch.cat([lin.weight for lin in linears], dim=0)
    packed = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, device="meta")
    packed.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        packed.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return packed


class GemvLinear(nn.Linear):
    """An `nn.Linear` that runs steps of at most `gemv_max_rows` rows through the skinny-GEMM kernel
    (kernels/gemv.py) on CUDA and everything else through `F.linear`. `use_gemv` turns a model's linears into
    these in place (same parameters and names)."""

    gemv_max_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= self.gemv_max_rows and x.stride(1) == 1:
            from kernels.gemv import gemv

            return gemv(x, self.weight, self.bias)
        return super().forward(x)


GEMV_MAX_OUT = 32768  # wider heads (the vocabulary) keep cuBLAS's GEMV, already at bandwidth
GEMV_MAX_ROWS = 8  # kernels/gemv.py's MAX_ROWS


def use_gemv(model: nn.Module, max_rows: int) -> int:
    """Route `model`'s projections (not its vocabulary heads) through `GemvLinear` for steps of <= `max_rows`
    rows (0: undo); returns how many linears were switched."""
    if not 0 <= max_rows <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv rows must be in [0, {GEMV_MAX_ROWS}], got {max_rows}")
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features <= GEMV_MAX_OUT:
            module.__class__ = GemvLinear
            module.gemv_max_rows = max_rows
            count += 1
    return count


def use_gemv_from_env(model: nn.Module) -> None:
    """`use_gemv` with `MSTAR_GEMV_MAX_ROWS` rows (default 0: left alone, until the H200 sweep says where the
    kernel wins)."""
    import os

    rows = int(os.environ.get("MSTAR_GEMV_MAX_ROWS", "0") or 0)
    if rows:
        use_gemv(model, rows)
