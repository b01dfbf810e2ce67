"""The decoder-only causal LM shared by the Qwen3 and Llama families (module names mirror HF's).

    input_ids [T] ─ embed_tokens ─▶ N × DecoderLayer ─ norm ─▶ hidden [T, H]
    hidden [B, H] (one row per sampled sequence) ─ lm_head (tied to embed_tokens when configured) ─▶ logits [B, V]

`fuse_projections()` packs q/k/v and gate/up into single GEMMs after loading; `enable_fused_ops()` switches the
embedding, the norms and the activation to their Triton kernels (CUDA only). Both keep the eager torch ops as the
reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mstar_common.config import env_switch
from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.layers.attention import AttentionContext
from mstar_common.layers.decoder import (
    DecoderLayer,
    DecoderLayerConfig,
    fused_mlp_options,
    fused_mlp_rows,
    norm_gemv_enabled,
)
from mstar_common.layers.embedding import TokenEmbedding
from mstar_common.layers.mlp import GatedMLP
from mstar_common.layers.norm import RMSNorm
from mstar_common.layers.rotary import (
    RopeInputs,
    RotaryEmbedding,
    attention_factor,
    position_limit,
    rope_from_config,
    rope_theta_from_config,
)


@dataclass(frozen=True, slots=True)
class DenseLMConfig:
    """The fields of an HF dense decoder `config.json` (Qwen3, Llama) this implementation reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # Llama-3, linear or YaRN (rotary.rope_from_config), or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3)

    @classmethod
    def read_hf(cls, config: Mapping[str, Any], *, qk_norm: bool, scaled_rope: bool) -> DenseLMConfig:
        """Read an HF config dict, refusing features this implementation would silently get wrong.
        `scaled_rope`: accept the RoPE scalings `rotary.rope_from_config` reads (else only unscaled RoPE)."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config['hidden_act']!r} is not supported: only 'silu' is")
        heads = config["num_attention_heads"]
        theta, scaling = rope_from_config(config) if scaled_rope else (rope_theta_from_config(config), None)
        limit = position_limit(config)  # max_position_embeddings checked there; YaRN's context may stand in for it
        if limit is None:
            raise ValueError("max_position_embeddings: missing (the longest context the checkpoint's positions "
                             "serve)")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=limit,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=qk_norm,
        )

    def decoder_layer(self) -> DecoderLayerConfig:
        return DecoderLayerConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=self.qk_norm,
            qkv_bias=self.attention_bias,
            o_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )


class DecoderModel(nn.Module):
    def __init__(self, layer: DecoderLayerConfig, num_layers: int, vocab_size: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.embed_tokens = TokenEmbedding(vocab_size, layer.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(layer) for _ in range(num_layers))
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.rotary = RotaryEmbedding(layer.head_dim, rope_theta, rope_scaling)
        if (factor := attention_factor(rope_scaling)) != 1.0:
            # transformers multiplies cos and sin by it, so q.k by its square: the softmax scale takes that instead
            for decoder_layer in self.layers:
                decoder_layer.self_attn.scale *= factor * factor

    def forward(self, input_ids: torch.Tensor, ctx: AttentionContext, kv_cache: KVCache,
                gather: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids, gather)
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, ctx, kv_cache.layer(index))
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderOnlyLM(nn.Module):
    """Implements the engine's `CausalLM` contract (`mstar_common/engine/model_runner.py`)."""

    supports_prefix_caching = True  # the KV of a position depends only on the token ids up to it

    def __init__(self, layer: DecoderLayerConfig, num_layers: int, vocab_size: int, rope_theta: float,
                 max_position_embeddings: int, tie_word_embeddings: bool,
                 attn_backend: AttentionBackend | None = None, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.kv_spec = KVSpec(num_layers, layer.num_kv_heads, layer.head_dim)
        self.max_position_embeddings = max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings
        self.attn_backend = attn_backend or TorchPagedAttention()
        self.model = DecoderModel(layer, num_layers, vocab_size, rope_theta, rope_scaling)
        self.lm_head = nn.Linear(layer.hidden_size, vocab_size, bias=False)
        self.tie_weights()

    @property
    def gathers_input_ids(self) -> bool:
        """Whether a captured step should pass its overlap gather to `forward` (the embedding kernel does it in its
        launch) rather than run it first (the engine's `CausalLM` contract)."""
        return self.model.embed_tokens.use_kernel

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
        attention backend's choice); with `MSTAR_NORM_GEMV` not 0 a norm before a projection that runs on the
        skinny GEMM may go into that GEMM's launch (`auto`, the default: where the tuning timed it faster); with
        `MSTAR_FUSED_MLP_ROWS` steps of that many rows run each MLP half as one persistent launch; with
        `MSTAR_EMBED_KERNEL` not 0 (default 1) the embedding lookup, with a captured step's overlap gather inside,
        is one Triton launch (mstar_kernels/embedding.py)."""
        fold_norms = enabled and norm_gemv_enabled()
        self.model.embed_tokens.use_kernel = enabled and env_switch("MSTAR_EMBED_KERNEL", True)
        mlp_rows = fused_mlp_rows() if enabled else 0
        mlp_options = fused_mlp_options() if mlp_rows else {}
        for module in self.modules():
            if isinstance(module, (RMSNorm, GatedMLP)):
                module.use_kernel = enabled
            if isinstance(module, DecoderLayer):
                module.norm_gemv = fold_norms
                module.fused_mlp_rows = mlp_rows
                module.fused_mlp_options = mlp_options

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache, gather: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` (packed rows) -> final-norm hidden states `[T, hidden_size]`. `gather`
        (`(dst, src, count, previous)`): first `input_ids[dst[i]] = previous[src[i]]` for `i < count[0]`, inside
        the embedding's launch on CUDA (mstar_common/layers/embedding.py)."""
        rope = RopeInputs(positions, self.model.rotary, self.model.embed_tokens.weight.dtype)
        ctx = AttentionContext(rope=rope, metadata=attn_metadata, backend=self.attn_backend)
        return self.model(input_ids, ctx, kv_cache, gather)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, hidden_size]` -> `[B, vocab_size]` in the model dtype (the runner upcasts to fp32)."""
        return self.lm_head(hidden)


class DenseCausalLM(DecoderOnlyLM):
    """A `DecoderOnlyLM` built from a `DenseLMConfig` (the Qwen3 and Llama families' model)."""

    def __init__(self, config: DenseLMConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__(config.decoder_layer(), config.num_hidden_layers, config.vocab_size, config.rope_theta,
                         config.max_position_embeddings, config.tie_word_embeddings, attn_backend,
                         rope_scaling=config.rope_scaling)
        self.config = config
