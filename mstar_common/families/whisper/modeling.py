"""Whisper's encoder (batched, fixed 30 s shape) and decoder (paged self-attention + write-once cross-attention).

    features [B, n_mels, 3000] ─ conv1 (k3) ─ GELU ─ conv2 (k3, stride 2) ─ GELU ─ + sinusoid positions
        ─ N × (LN ▸ self-attention ▸ residual ▸ LN ▸ fc1 ▸ GELU ▸ fc2 ▸ residual) ─ LN ─▶ encoder_output [B, 1500, d]

    admission (once per request): encoder_output ─ per layer k_proj / v_proj ─▶ this request's cross-KV slot
    input_ids [T] ─ embed_tokens + learned positions
        ─ N × (LN ▸ causal self-attention over the paged KV ▸ residual
               ▸ LN ▸ cross-attention over the request's slot ▸ residual ▸ LN ▸ MLP ▸ residual) ─ LN ─▶ hidden [T, d]
    hidden [B, d] ─ proj_out (tied to embed_tokens) ─▶ logits [B, V]

The decoder implements the engine's `CausalLM` contract plus its per-request hooks (engine/scheduler.py
`RequestHooks`: `can_admit_request`/`admit_request`/`release_request`, a cross-KV slot per request; and
`process_logits`/`logits_need_history`: Whisper's token rules, decoding.py).
The cross-KV pool is paged like the self-attention pool: slot `s` owns pages `s * P … s * P + P - 1`
(`P = ceil(1500 / page_size)`), so a decode step's cross-attention is the backend's paged decode over a
block table computed on the device from the rows' slots (no gather, graph safe); steps with multi-token
rows (prefill) attend per row. Module names mirror HF `WhisperForConditionalGeneration`, so checkpoint
tensors load by name (see `loader.py`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_common.engine.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from mstar_common.engine.kv_cache import KVCache, KVSpec
from mstar_common.layers.norm import ResidualLayerNorm

LAYER_NORM_EPS = 1e-5  # torch's default, which HF Whisper uses


@dataclass(frozen=True, slots=True)
class WhisperConfig:
    """The fields of an HF Whisper `config.json` this implementation reads."""

    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_source_positions: int
    max_target_positions: int
    # (scale_embedding is not read: transformers' Whisper computes embed_scale from it and never applies it, and
    # OpenAI's model has no such factor)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> WhisperConfig:
        """Read an HF config dict, refusing features this implementation would silently get wrong."""
        if config.get("model_type") != "whisper":
            raise ValueError(f"config.json model_type must be 'whisper', got {config.get('model_type')!r}")
        if config.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"activation_function={config['activation_function']!r} is not supported: only 'gelu'")
        if config.get("tie_word_embeddings", True) is False:
            raise ValueError("tie_word_embeddings=false is not supported: Whisper ties proj_out to embed_tokens")
        out = cls(**{name: config[name] for name in cls.__dataclass_fields__})
        for name, heads in (("encoder", out.encoder_attention_heads), ("decoder", out.decoder_attention_heads)):
            if out.d_model % heads:
                raise ValueError(f"d_model ({out.d_model}) must be a multiple of {name}_attention_heads ({heads})")
        from mstar_common.families.whisper.frontend import N_FRAMES

        if out.num_frames != N_FRAMES:  # accepted, every request then failed in the encoder's position add
            raise ValueError(f"max_source_positions={out.max_source_positions} is not supported: the front end makes "
                             f"{N_FRAMES} mel frames (30 s), which the encoder's convolutions take to "
                             f"{N_FRAMES // 2} positions")
        return out

    @property
    def num_frames(self) -> int:
        """Mel frames the encoder takes (two stride-1/stride-2 convolutions: 2 frames per position)."""
        return 2 * self.max_source_positions


# ---- encoder ------------------------------------------------------------------------------------------------


class EncoderAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape
        shape = (batch, length, self.num_heads, self.head_dim)
        query = self.q_proj(hidden).view(shape).transpose(1, 2)
        key = self.k_proj(hidden).view(shape).transpose(1, 2)
        value = self.v_proj(hidden).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class EncoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.self_attn = EncoderAttention(d, config.encoder_attention_heads)
        self.final_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden))
        return hidden + self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden))))


class WhisperEncoder(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """`features` `[B, n_mels, 2 * max_source_positions]` -> `[B, max_source_positions, d_model]`."""
        hidden = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        hidden = hidden + self.embed_positions.weight
        for layer in self.layers:
            hidden = layer(hidden)
        return self.layer_norm(hidden)


class WhisperEncoderModel(nn.Module):
    """The encoder component's weights, named as in the HF checkpoint (`model.encoder.*`)."""

    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.encoder = WhisperEncoder(config)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.encoder(features)


# ---- decoder ------------------------------------------------------------------------------------------------


class CrossKVPool:
    """Write-once cross-attention K/V: one slot per admitted request, paged like the self-attention pool.

    Per layer K and V are `[num_slots * pages_per_slot, page_size, heads, head_dim]`; slot `s` holds its
    `source_len` positions in pages `s * P …` (the tail of the last page is never read).
    """

    def __init__(self, num_layers: int, num_slots: int, source_len: int, page_size: int, num_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_slots, self.source_len, self.page_size = num_slots, source_len, page_size
        self.pages_per_slot = math.ceil(source_len / page_size)
        num_pages = num_slots * self.pages_per_slot
        self._pool = torch.zeros(num_layers, 2, num_pages, page_size, num_heads, head_dim, dtype=dtype, device=device)
        self._page_offsets = torch.arange(self.pages_per_slot, dtype=torch.int32, device=device)
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_bytes(self) -> int:
        return self._pool.numel() * self._pool.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pool[index, 0], self._pool[index, 1]

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free cross-attention slot (the engine admits at most num_slots requests)")
        return self._free.popleft()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """`key`/`value` `[source_len, heads, head_dim]` into the slot's pages of one layer."""
        first = slot * self.pages_per_slot
        pages = slice(first, first + self.pages_per_slot)
        for which, tensor in ((0, key), (1, value)):
            flat = self._pool[layer, which, pages].flatten(0, 1)
            flat[: self.source_len].copy_(tensor)

    def block_tables(self, slots: torch.Tensor) -> torch.Tensor:
        """`[B]` slots -> `[B, pages_per_slot]` int32 block table (device op: no host sync)."""
        return slots.to(torch.int32)[:, None] * self.pages_per_slot + self._page_offsets[None, :]


class _DecoderAttention(nn.Module):
    """Whisper's attention projections (HF names; k_proj has no bias)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)


class DecoderSelfAttention(_DecoderAttention):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__(d_model, num_heads)
        self.qkv_proj: nn.Linear | None = None  # set by `fuse_qkv`

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """One GEMM for q/k/v (k's missing bias is zeros). The three HF parameters become views of the packed
        weight and bias, so nothing is stored twice."""
        if self.qkv_proj is not None:
            return
        d = self.q_proj.in_features
        weight = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
        bias = torch.cat((self.q_proj.bias, torch.zeros_like(self.q_proj.bias), self.v_proj.bias))
        packed = nn.Linear(d, 3 * d, device="meta")
        packed.weight, packed.bias = (nn.Parameter(t, requires_grad=False) for t in (weight, bias))
        self.qkv_proj = packed
        for index, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            proj.weight = nn.Parameter(weight[index * d:(index + 1) * d], requires_grad=False)
        self.q_proj.bias = nn.Parameter(bias[:d], requires_grad=False)
        self.v_proj.bias = nn.Parameter(bias[2 * d:], requires_grad=False)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend) -> torch.Tensor:
        shape = (hidden.shape[0], self.num_heads, self.head_dim)
        if self.qkv_proj is not None:
            query, key, value = (part.view(shape) for part in self.qkv_proj(hidden).chunk(3, dim=-1))
        else:
            query, key, value = (self.q_proj(hidden).view(shape), self.k_proj(hidden).view(shape),
                                 self.v_proj(hidden).view(shape))
        backend.write_kv(key, value, kv[0], kv[1], metadata)
        out = backend.attend(query, kv[0], kv[1], metadata, self.scale)
        return self.out_proj(out.reshape(hidden.shape[0], -1))


class CrossAttention(_DecoderAttention):
    """Queries from the decoder, keys/values from the request's slot (written once by `project_source`)."""

    def project_source(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder output `[S, d]` -> K, V `[S, heads, head_dim]`."""
        shape = (source.shape[0], self.num_heads, self.head_dim)
        return self.k_proj(source).view(shape), self.v_proj(source).view(shape)

    def forward(self, hidden: torch.Tensor, cross: CrossStep, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        query = self.q_proj(hidden).view(hidden.shape[0], self.num_heads, self.head_dim)
        if cross.decode_metadata is not None:
            # one query per row, the row's whole source visible: the backend's paged decode over the slot's pages
            out = cross.backend.attend(query, kv[0], kv[1], cross.decode_metadata, self.scale)
        else:
            out = self._attend_rows(query, cross, kv)
        return self.out_proj(out.reshape(hidden.shape[0], -1))

    def _attend_rows(self, query: torch.Tensor, cross: CrossStep, kv: tuple[torch.Tensor, torch.Tensor]):
        out = torch.empty_like(query)
        starts = cross.query_start_loc_host
        for row, table in enumerate(cross.block_tables_host):
            if starts[row + 1] == starts[row]:
                continue
            key = kv[0][table].flatten(0, 1)[: cross.source_len].transpose(0, 1)
            value = kv[1][table].flatten(0, 1)[: cross.source_len].transpose(0, 1)
            q = query[starts[row]: starts[row + 1]].transpose(0, 1)
            out[starts[row]: starts[row + 1]] = F.scaled_dot_product_attention(
                q, key, value, scale=self.scale).transpose(0, 1)
        return out


@dataclass(slots=True)
class CrossStep:
    """How this step's rows reach their cross-KV slots."""

    backend: AttentionBackend
    source_len: int
    decode_metadata: AttentionMetadata | None  # set when every row has one query
    block_tables_host: list[torch.Tensor]  # per-row page indices (multi-query steps)
    query_start_loc_host: list[int]


class DecoderLayer(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn_layer_norm = ResidualLayerNorm(d, eps=LAYER_NORM_EPS)
        self.self_attn = DecoderSelfAttention(d, config.decoder_attention_heads)
        self.encoder_attn_layer_norm = ResidualLayerNorm(d, eps=LAYER_NORM_EPS)
        self.encoder_attn = CrossAttention(d, config.decoder_attention_heads)
        self.final_layer_norm = ResidualLayerNorm(d, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(d, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, d)

    def forward(self, delta, residual, metadata, kv, cross: CrossStep, cross_kv, backend):
        """The residual stream is carried as (`residual`, pending `delta`): each norm adds the pending delta
        first (`residual` None: `delta` is the stream), so an add and a norm are one kernel on the GPU.
        Returns this layer's MLP output (the next pending delta) and the stream."""
        x, residual = self.self_attn_layer_norm(delta, residual) if residual is not None else (
            self.self_attn_layer_norm(delta), delta)
        x, residual = self.encoder_attn_layer_norm(self.self_attn(x, metadata, kv, backend), residual)
        x, residual = self.final_layer_norm(self.encoder_attn(x, cross, cross_kv), residual)
        return self.fc2(F.gelu(self.fc1(x))), residual


class WhisperDecoder(nn.Module):
    def __init__(self, config: WhisperConfig) -> None:
        super().__init__()
        d = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.layer_norm = ResidualLayerNorm(d, eps=LAYER_NORM_EPS)


class WhisperDecoderLM(nn.Module):
    """The decoder component: the engine's `CausalLM` contract plus per-request cross-KV slots and token rules.

    `configure_slots` must be called once (after loading, before the engine runs) to size the cross-KV pool;
    `rules` (a `decoding.TokenRules`) supplies `process_logits`.
    """

    def __init__(self, config: WhisperConfig, attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        heads = config.decoder_attention_heads
        self.kv_spec = KVSpec(config.decoder_layers, heads, config.d_model // heads)
        self.max_position_embeddings = config.max_target_positions
        self.attn_backend = attn_backend or TorchPagedAttention()
        self.model = nn.Module()
        self.model.decoder = WhisperDecoder(config)
        self.proj_out = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.cross_kv: CrossKVPool | None = None
        self.rules = None

    def tie_weights(self) -> None:
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    def fuse_projections(self) -> None:
        """Pack each layer's self-attention q/k/v into one GEMM (after loading by HF names)."""
        for layer in self.model.decoder.layers:
            layer.self_attn.fuse_qkv()

    def enable_fused_ops(self, enabled: bool = True) -> None:
        """Run each residual add + LayerNorm as one Triton kernel on CUDA (the eager ops are the reference)."""
        for module in self.modules():
            if isinstance(module, ResidualLayerNorm):
                module.use_kernel = enabled

    def configure_slots(self, num_slots: int, page_size: int) -> None:
        weight = self.proj_out.weight
        self.cross_kv = CrossKVPool(self.config.decoder_layers, num_slots, self.config.max_source_positions,
                                    page_size, self.kv_spec.num_kv_heads, self.kv_spec.head_dim, weight.dtype,
                                    weight.device)

    # ---- per-request state hooks (called by the engine on its loop thread) ----------------------------------

    def can_admit_request(self) -> bool:
        return self.cross_kv is not None and self.cross_kv.can_allocate()

    @torch.inference_mode()
    def admit_request(self, state: Any) -> int:
        """Take a cross-KV slot and write the request's encoder output into it (once); returns the slot."""
        source = state.take_encoder_output()
        expected = (self.config.max_source_positions, self.config.d_model)
        if tuple(source.shape) != expected:
            raise ValueError(f"encoder_output must be {list(expected)}, got {list(source.shape)}")
        weight = self.proj_out.weight
        source = source.to(device=weight.device, dtype=weight.dtype)
        slot = self.cross_kv.allocate()
        try:
            for index, layer in enumerate(self.model.decoder.layers):
                key, value = layer.encoder_attn.project_source(source)
                self.cross_kv.write(slot, index, key, value)
        except BaseException:
            self.cross_kv.free(slot)  # the engine refuses the request and never sees this slot
            raise
        return slot

    def release_request(self, slot: int) -> None:
        self.cross_kv.free(slot)

    @property
    def num_used_request_slots(self) -> int:
        return 0 if self.cross_kv is None else self.cross_kv.num_slots - self.cross_kv.num_free_slots

    def process_logits(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        return logits if self.rules is None else self.rules.process(logits, seqs)

    # ---- per-token scores (engine/model_runner.py): each window's avg_logprob and no_speech_prob -------------

    token_logprobs = True  # the engine scores every sampled token under the token rules

    @property
    def probe_token_id(self) -> int | None:
        return None if self.rules is None else self.rules.tokens.sot

    def probe(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[k, d_model]` final hidden states at <|startoftranscript|> -> `[k]` the probability of <|nospeech|>
        there, from the raw logits (OpenAI Whisper's `no_speech_prob`, before any token rule)."""
        logits = self.compute_logits(hidden).float()
        return torch.softmax(logits, dim=-1)[:, self.rules.tokens.no_speech]

    def note_probe(self, seq, value: float) -> None:
        if seq.request_state is not None:
            seq.request_state.no_speech_prob = value

    def note_sampled(self, seq, index: int, token: int, logprob: float) -> None:
        if seq.request_state is not None:
            seq.request_state.note_sampled(index, token, logprob, self.rules.tokens.eot)

    def logits_need_history(self, seq) -> bool:
        """Only the timestamp rules read the previous tokens' values (the others count them)."""
        return seq.request_state is not None and seq.request_state.timestamps

    # ---- the step -------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """`input_ids`/`positions` `[T]` (packed rows) -> final-norm hidden states `[T, d_model]`.

        Reads `attn_metadata.request_slots` (`[B]`, each row's cross-KV slot)."""
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids) + decoder.embed_positions(positions)
        cross = self._cross_step(attn_metadata)
        residual = None
        for index, layer in enumerate(decoder.layers):
            hidden, residual = layer(hidden, residual, attn_metadata, kv_cache.layer(index), cross,
                                     self.cross_kv.layer(index), self.attn_backend)
        return decoder.layer_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)

    def _cross_step(self, metadata: AttentionMetadata) -> CrossStep:
        slots = getattr(metadata, "request_slots", None)
        if slots is None:
            raise ValueError("the Whisper decoder needs attn_metadata.request_slots (one cross-KV slot per row)")
        pool = self.cross_kv
        tables = pool.block_tables(slots)
        if getattr(metadata, "is_decode", metadata.max_query_len == 1):
            num_rows = tables.shape[0]
            source_lens = torch.full((num_rows,), pool.source_len, dtype=torch.int32, device=tables.device)
            decode = AttentionMetadata(
                query_start_loc=metadata.query_start_loc, context_lens=source_lens, block_tables=tables,
                slot_mapping=metadata.slot_mapping, max_query_len=1, max_context_len=pool.source_len,
                query_start_loc_host=metadata.query_start_loc_host,
                context_lens_host=[pool.source_len] * num_rows, is_decode=True,
            )
            return CrossStep(self.attn_backend, pool.source_len, decode, [], metadata.query_start_loc_host)
        tables_host = list(tables.long().unbind(0))
        return CrossStep(self.attn_backend, pool.source_len, None, tables_host, metadata.query_start_loc_host)
