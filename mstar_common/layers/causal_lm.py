"""The decoder-only causal LM shared by the Qwen3 and Llama families (module names mirror HF's).

    input_ids [T] ─ embed_tokens ─▶ N × DecoderLayer ─ norm ─▶ hidden [T, H]
    hidden [B, H] (one row per sampled sequence) ─ lm_head (tied to embed_tokens when configured) ─▶ logits [B, V]

`fuse_projections()` packs q/k/v and gate/up into single GEMMs after loading; `enable_fused_ops()` switches the
norms and the activation to their Triton kernels (CUDA only). Both keep the eager torch ops as the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.layers.attention import AttentionContext
from mstar_common.layers.decoder import DecoderLayer, DecoderLayerConfig
from mstar_common.layers.mlp import GatedMLP
from mstar_common.layers.norm import RMSNorm
from mstar_common.layers.rotary import RotaryEmbedding


class DecoderModel(nn.Module):
    def __init__(self, layer: DecoderLayerConfig, num_layers: int, vocab_size: int, rope_theta: float,
                 rope_scaling: dict[str, float] | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, layer.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(layer) for _ in range(num_layers))
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.rotary = RotaryEmbedding(layer.head_dim, rope_theta, rope_scaling)

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, kv_cache: KVCache) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, ctx, kv_cache.layer(index))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderOnlyLM(nn.Module):
    """Implements the engine's `CausalLM` contract (`mstar_common/engine/model_runner.py`)."""

    def __init__(self, layer: DecoderLayerConfig, num_layers: int, vocab_size: int, rope_theta: float,
                 max_position_embeddings: int, tie_word_embeddings: bool,
                 attn_backend: AttentionBackend | None = None, rope_scaling: dict[str, float] | None = None) -> None:
        super().__init__()
        self.kv_spec = KVSpec(num_layers, layer.num_kv_heads, layer.head_dim)
        self.max_position_embeddings = max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_backend = attn_backend or TorchPagedAttention()
        self.model = DecoderModel(layer, num_layers, vocab_size, rope_theta, rope_scaling)
        self.lm_head = nn.Linear(layer.hidden_size, vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share `lm_head.weight` with the input embedding when the config ties them (call again after
        `to_empty`, which gives every module its own new tensor)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Pack each layer's q/k/v and gate/up projections into one GEMM each (after loading by HF names)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse_gate_up()

    def enable_fused_ops(self, enabled: bool = True) -> None:
        """Run the residual-add+RMSNorm and SiLU*up as Triton kernels on CUDA (the q/k prologue is the
        attention backend's choice)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP)):
                module.use_kernel = enabled

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` (packed rows) -> final-norm hidden states `[T, hidden_size]`."""
        dtype = self.model.embed_tokens.weight.dtype
        cos, sin = self.model.rotary(positions, dtype)
        ctx = AttentionContext(cos=cos, sin=sin, metadata=attn_metadata, backend=self.attn_backend)
        return self.model(input_ids, ctx, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden_size]` -> `[B, vocab_size]` in the model dtype (the runner upcasts to fp32)."""
        return self.lm_head(hidden)
