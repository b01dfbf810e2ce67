"""Pre-norm transformer decoder layer, shared by Qwen3 and Llama.

The residual stream is carried beside the hidden states (`(hidden, residual)` in and out), so each norm can
fold in the preceding residual add: `residual += x; x = norm(residual)` is one op (one kernel on CUDA).

With `norm_gemv` set (`enable_fused_ops` on CUDA, `MSTAR_NORM_GEMV` not 0), a step whose qkv or gate_up
projection runs on the skinny GEMM (mstar_kernels/gemv.py, a few rows) takes the add and the norm in that GEMM's load
(`norm_gemv`): one launch instead of two, twice per layer. By default (`auto`) only at the row counts where
`tune_gemv` timed that faster than the norm kernel followed by the plain GEMM (the projection's `norm_apart`).

With `fused_mlp_rows` set (`enable_fused_ops` on CUDA, `MSTAR_FUSED_MLP_ROWS`), a step of at most that many rows runs
the MLP half (residual add + RMSNorm, gate/up, SwiGLU, down) as one persistent launch with a grid barrier between
the projections (mstar_kernels/fused_mlp.py): one launch instead of three.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from mstar_common.layers.attention import AttentionContext, SelfAttention
from mstar_common.layers.mlp import GatedMLP
from mstar_common.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class DecoderLayerConfig:
    """The shape of one decoder layer; families fill it from their HF config."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderLayerConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            qk_norm=config.qk_norm, rms_norm_eps=config.rms_norm_eps,
            qkv_bias=config.qkv_bias, o_bias=config.o_bias,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_gemv = False
        self.fused_mlp_rows = 0
        # mstar_kernels/fused_mlp.py launch settings (MSTAR_FUSED_MLP_OPTIONS)
        self.fused_mlp_options: dict[str, int] = {}
        self._mlp_sync: torch.Tensor | None = None  # the persistent MLP kernel's barrier counters

    def norm_gemv_pairs(self) -> list[tuple[RMSNorm, nn.Linear]]:
        """The (norm, projection) pairs that run as one launch where the projection's GEMV plan takes the step
        (`tune_gemv` times them so)."""
        if not self.norm_gemv:
            return []
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm,
                                                                  self.mlp.gate_up_proj)]
        return [(norm, linear) for norm, linear in pairs if linear is not None]

    def _norm_project(self, norm: RMSNorm, linear: nn.Linear | None, hidden: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(linear(norm(hidden + residual)), hidden + residual)` as one skinny-GEMM launch, or None where the
        projection's plan does not take this step (or the fusion is off). In steps whose projections run on the
        tens-of-rows GEMM, the same as one mstar_kernels/mid_gemm.py launch where the projection takes its fold
        (`MSTAR_MID_GEMM_FOLD`: `norm`, or `auto`'s choice)."""
        if not self.norm_gemv or linear is None or not hasattr(linear, "gemv_blocks_for"):
            return None
        setting = linear.gemv_blocks_for(hidden)
        if setting is None:
            return linear.mid_gemm_normed(hidden, norm.weight, norm.eps, residual)
        if hidden.shape[0] in linear.norm_apart:  # the plain kernel timed faster
            return None
        from mstar_kernels.gemv import norm_gemv_with

        return norm_gemv_with(hidden, norm.weight, norm.eps, linear.weight, linear.bias, residual, setting,
                              kind=getattr(linear, "pdl_kind", None))

    def _fused_mlp(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(mlp(norm(hidden + residual)), hidden + residual)` as one persistent launch, or None where it does not
        apply (more rows than `fused_mlp_rows`, biases, quantised or unfused projections, not CUDA)."""
        gate_up, down = self.mlp.gate_up_proj, self.mlp.down_proj
        if not 0 < hidden.shape[0] <= self.fused_mlp_rows or gate_up is None or not hidden.is_cuda:
            return None
        linears = (gate_up, down)
        if not all(isinstance(lin, nn.Linear) and lin.bias is None and lin.weight.dtype == hidden.dtype
                   for lin in linears):
            return None
        from mstar_kernels.fused_mlp import fused_mlp, new_sync

        if self._mlp_sync is None or self._mlp_sync.device != hidden.device:
            self._mlp_sync = new_sync(hidden.device)
        norm = self.post_attention_layernorm
        return fused_mlp(hidden, residual, norm.weight, norm.eps, gate_up.weight, down.weight, self._mlp_sync,
                         **self.fused_mlp_options)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: AttentionContext,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` None on the first layer. Returns the MLP output and the residual stream before it."""
        fused = self._norm_project(self.input_layernorm, self.self_attn.qkv_proj, hidden, residual)
        if fused is not None:
            qkv, residual = fused
            hidden = self.self_attn(None, ctx, kv, qkv=qkv)
        else:
            if residual is None:
                residual, hidden = hidden, self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = self.self_attn(hidden, ctx, kv)
        fused = self._fused_mlp(hidden, residual)
        if fused is not None:
            return fused
        fused = self._norm_project(self.post_attention_layernorm, self.mlp.gate_up_proj, hidden, residual)
        if fused is not None:
            gate_up, residual = fused
            return self.mlp(None, gate_up=gate_up), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def fused_mlp_rows() -> int:
    """`MSTAR_FUSED_MLP_ROWS` (default 0: off): steps of at most this many rows (<= 8) take the persistent MLP
    kernel."""
    raw = os.environ.get("MSTAR_FUSED_MLP_ROWS", "0") or "0"
    if not raw.isdigit() or int(raw) > 8:
        raise ValueError(f"MSTAR_FUSED_MLP_ROWS={raw!r}: expected an integer in [0, 8]")
    return int(raw)


FUSED_MLP_OPTIONS = ("programs", "num_warps", "tile")


def fused_mlp_options() -> dict[str, int]:
    """`MSTAR_FUSED_MLP_OPTIONS` (e.g. `num_warps=16+tile=8192`; `,` also separates): the persistent MLP
    kernel's launch settings, for A/Bs (scripts/ab_decode_step.py); unset, the kernel's defaults."""
    raw = os.environ.get("MSTAR_FUSED_MLP_OPTIONS", "")
    options = {}
    for item in filter(None, raw.replace("+", ",").split(",")):
        key, _, value = item.partition("=")
        if key not in FUSED_MLP_OPTIONS or not value.isdigit() or int(value) == 0:
            raise ValueError(f"MSTAR_FUSED_MLP_OPTIONS: {item!r} is not KEY=positive integer with KEY one of "
                             f"{list(FUSED_MLP_OPTIONS)}")
        options[key] = int(value)
    return options


NORM_GEMV_MODES = ("auto", "1", "0")


def norm_gemv_mode() -> str:
    """`MSTAR_NORM_GEMV`: `auto` (default) folds a pre-norm into its projection's skinny GEMM where `tune_gemv`
    timed that faster than the norm kernel before it; `1` folds it wherever the projection runs on the kernel;
    `0` never does."""
    mode = os.environ.get("MSTAR_NORM_GEMV", "") or "auto"
    if mode not in NORM_GEMV_MODES:
        raise ValueError(f"MSTAR_NORM_GEMV={mode!r}: expected one of {', '.join(NORM_GEMV_MODES)}")
    return mode


def norm_gemv_enabled() -> bool:
    return norm_gemv_mode() != "0"
