"""Gated SiLU MLP (SwiGLU): `down(silu(gate(x)) * up(x))`, as in Llama and Qwen.

Loaded with HF's separate `gate_proj`/`up_proj`; `fuse_gate_up()` packs them into one `gate_up_proj` GEMM
(one weight read, one launch), and `use_kernel` runs the activation as one Triton launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_common.layers.linear import concat_linears, mid_gemm_counters


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Linear | None = None
        self.use_kernel = False

    def fuse_gate_up(self) -> None:
        if self.gate_up_proj is None:
            self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor | None, gate_up: torch.Tensor | None = None) -> torch.Tensor:
        """`gate_up` (with `x` None): the packed gate/up projection already taken (the decoder layer's norm +
        gate_up launch)."""
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if gate_up is None:
            gate_up = self.gate_up_proj(x)
        down = self.down_proj
        blocks = down.gemv_blocks_for(gate_up) if self.use_kernel and hasattr(down, "gemv_blocks_for") else None
        if blocks is not None:
            from mstar_kernels.gemv import gemv_with  # a few rows: the activation runs inside the down projection

            return gemv_with(gate_up, down.weight, down.bias, blocks, swiglu=True, kind=down.pdl_kind)
        setting = None
        if self.use_kernel and hasattr(down, "mid_folds") and down.mid_folds(gate_up):
            setting = down.mid_gemm_setting_for(gate_up)
        if setting is not None:
            from mstar_kernels.mid_gemm import mid_gemm  # the activation in the down projection's loads

            mid_gemm_counters(gate_up)
            return mid_gemm(gate_up, down.weight, down.bias, *setting, swiglu=True, kind=f"mid:{down.pdl_kind}")
        if self.use_kernel and gate_up.is_cuda:
            from mstar_kernels.silu_mul import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
