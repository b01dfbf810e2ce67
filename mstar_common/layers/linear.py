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
