"""The FLUX.2 rectified-flow transformer (MMDiT): double-stream blocks, then single-stream blocks.

    latent tokens [B, N_img (+ N_ref), C]  ─ x_embedder ───────┐
    prompt_embeds [B, 512, J]              ─ context_embedder ─┤  4-axis RoPE from (t, h, w, l) ids
    timestep [B] ─ sinusoid ─ MLP ─ temb ─ shared AdaLN modulations (img / txt / single)
        ─▶ num_layers × double block (separate img/txt weights, joint attention)
        ─▶ num_single_layers × single block (fused QKV+MLP over [txt, img])
        ─▶ AdaLN out ─ proj_out ─▶ velocity [B, N_img (+ N_ref), C]

Every row of the batch carries its own timestep (rows at different denoise steps batch together); the
position ids are shared, so one batch holds rows of one token layout. Module names and the arithmetic
order mirror diffusers' `Flux2Transformer2DModel`, so checkpoints load by name and fp32 output is
bit-identical.

On a GPU, `use_fused_kernels()` (the loader turns it on; `MSTAR_DIFFUSION_KERNELS=0` keeps eager) routes the
elementwise glue through mstar_kernels/dit.py and mstar_kernels/silu_mul.py: AdaLN modulation, gated residuals,
q/k RMSNorm + RoPE written straight into the joint sequence, SwiGLU written into the output projection's input.
The GEMMs and the attention are unchanged; the kernels round where the eager ops round. SDPA runs cuDNN's fused
attention on a GPU by default (`MSTAR_DIT_ATTENTION`), for captured steps and a thread's first 64 uncaptured
shapes; newer shapes go to FlashAttention (`diffusion/attention.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar_common.diffusion.attention import attention


@dataclass(frozen=True, slots=True)
class Flux2TransformerConfig:
    in_channels: int
    num_layers: int
    num_single_layers: int
    attention_head_dim: int
    num_attention_heads: int
    joint_attention_dim: int
    timestep_guidance_channels: int
    mlp_ratio: float
    axes_dims_rope: tuple[int, ...]
    rope_theta: float
    eps: float

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> Flux2TransformerConfig:
        """Read `transformer/config.json`, refusing variants this port would silently get wrong."""
        if config.get("patch_size", 1) != 1:
            raise ValueError(f"transformer patch_size={config['patch_size']} is not supported: only 1 is")
        out = config.get("out_channels")
        if out is not None and out != config["in_channels"]:
            raise ValueError(f"transformer out_channels={out} must equal in_channels={config['in_channels']}")
        if config.get("guidance_embeds", True):
            raise ValueError("transformer guidance_embeds=true (a guidance-distilled FLUX.2) is not served by "
                             "flux2_klein: klein checkpoints have guidance_embeds=false")
        axes = tuple(config.get("axes_dims_rope", (32, 32, 32, 32)))
        head_dim = config.get("attention_head_dim", 128)
        if sum(axes) != head_dim:
            raise ValueError(f"transformer axes_dims_rope {list(axes)} must sum to attention_head_dim={head_dim}")
        return cls(
            in_channels=config["in_channels"],
            num_layers=config.get("num_layers", 8),
            num_single_layers=config.get("num_single_layers", 48),
            attention_head_dim=head_dim,
            num_attention_heads=config.get("num_attention_heads", 48),
            joint_attention_dim=config.get("joint_attention_dim", 15360),
            timestep_guidance_channels=config.get("timestep_guidance_channels", 256),
            mlp_ratio=float(config.get("mlp_ratio", 3.0)),
            axes_dims_rope=axes,
            rope_theta=float(config.get("rope_theta", 2000)),
            eps=float(config.get("eps", 1e-6)),
        )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


# attention pieces


def rope_tables(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) `[S, head_dim]` fp32 for position ids `[S, 4]` (interleaved pairs; angles in fp64)."""
    pos = ids.float()
    cos_out, sin_out = [], []
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim))
        angles = torch.outer(pos[:, axis], freqs)
        cos_out.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin_out.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[B, S, heads, D]`; rotates interleaved (real, imag) pairs, in fp32."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class SwiGLUFeedForward(nn.Module):
    def __init__(self, dim: int, mult: float) -> None:
        super().__init__()
        inner = int(dim * mult)
        self.linear_in = nn.Linear(dim, inner * 2, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from mstar_kernels.silu_mul import silu_mul

            hidden = self.linear_in(x)
            return self.linear_out(silu_mul(hidden.reshape(-1, hidden.shape[-1])).unflatten(0, hidden.shape[:-1]))
        return self.linear_out(swiglu(self.linear_in(x)))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


class JointAttention(nn.Module):
    """Double-block attention: image and text streams projected separately, attended jointly [txt, img]."""

    fused = False

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False)])
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_add_out = nn.Linear(inner, dim, bias=False)

    def forward(self, img: torch.Tensor, txt: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        split = (-1, self.head_dim)
        if self.fused:
            return self._fused_forward(img, txt, rope, split)
        query = self.norm_q(self.to_q(img).unflatten(-1, split))
        key = self.norm_k(self.to_k(img).unflatten(-1, split))
        value = self.to_v(img).unflatten(-1, split)
        txt_query = self.norm_added_q(self.add_q_proj(txt).unflatten(-1, split))
        txt_key = self.norm_added_k(self.add_k_proj(txt).unflatten(-1, split))
        txt_value = self.add_v_proj(txt).unflatten(-1, split)
        query = apply_rope(torch.cat([txt_query, query], dim=1), *rope)
        key = apply_rope(torch.cat([txt_key, key], dim=1), *rope)
        value = torch.cat([txt_value, value], dim=1)
        out = attention(query, key, value)
        txt_out, img_out = out.split_with_sizes([txt.shape[1], out.shape[1] - txt.shape[1]], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)

    def _fused_forward(self, img, txt, rope, split):
        from mstar_kernels.dit import qk_norm_rope

        num_txt = txt.shape[1]
        joint = (img.shape[0], num_txt + img.shape[1], img.shape[-1] // self.head_dim, self.head_dim)
        query = torch.empty(joint, dtype=img.dtype, device=img.device)
        key = torch.empty_like(query)
        for proj, norm, out, offset, x in ((self.add_q_proj, self.norm_added_q, query, 0, txt),
                                           (self.to_q, self.norm_q, query, num_txt, img),
                                           (self.add_k_proj, self.norm_added_k, key, 0, txt),
                                           (self.to_k, self.norm_k, key, num_txt, img)):
            qk_norm_rope(proj(x).unflatten(-1, split), norm.weight, norm.eps, *rope, out=out, seq_offset=offset)
        value = torch.cat([self.add_v_proj(txt).unflatten(-1, split), self.to_v(img).unflatten(-1, split)], dim=1)
        out = attention(query, key, value)
        txt_out, img_out = out.split_with_sizes([num_txt, out.shape[1] - num_txt], dim=1)
        return self.to_out[0](img_out), self.to_add_out(txt_out)


class ParallelSelfAttention(nn.Module):
    """Single-block attention: one fused projection feeds QKV and the MLP; one fused output projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inner_dim = heads * head_dim
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, self.inner_dim * 3 + self.mlp_hidden_dim * 2, bias=False)
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(self.inner_dim + self.mlp_hidden_dim, dim, bias=False)

    fused = False

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden = self.to_qkv_mlp_proj(hidden)
        qkv, mlp = torch.split(hidden, [3 * self.inner_dim, 2 * self.mlp_hidden_dim], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        if self.fused:
            return self._fused_tail(query, key, value, mlp, rope)
        query = apply_rope(self.norm_q(query), *rope)
        key = apply_rope(self.norm_k(key), *rope)
        out = attention(query, key, value)
        return self.to_out(torch.cat([out, swiglu(mlp)], dim=-1))

    def _fused_tail(self, query, key, value, mlp, rope):
        """The attention output and the SwiGLU written side by side into the output projection's input."""
        from mstar_kernels.dit import qk_norm_rope
        from mstar_kernels.silu_mul import silu_mul

        query = qk_norm_rope(query, self.norm_q.weight, self.norm_q.eps, *rope)
        key = qk_norm_rope(key, self.norm_k.weight, self.norm_k.eps, *rope)
        rows = mlp.shape[:-1]
        both = torch.empty((*rows, self.inner_dim + self.mlp_hidden_dim), dtype=mlp.dtype, device=mlp.device)
        both[..., : self.inner_dim].copy_(attention(query, key, value))
        silu_mul(mlp.reshape(-1, mlp.shape[-1]), out=both.view(-1, both.shape[-1])[:, self.inner_dim:])
        return self.to_out(both)


# blocks


def _modulations(mod: torch.Tensor, sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`[B, 3 * sets * D]` -> `sets` × (shift, scale, gate), each `[B, 1, D]`."""
    chunks = torch.chunk(mod.unsqueeze(1), 3 * sets, dim=-1)
    return [tuple(chunks[3 * i: 3 * i + 3]) for i in range(sets)]


class DoubleStreamBlock(nn.Module):
    fused = False

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.ff = SwiGLUFeedForward(dim, mlp_ratio)
        self.ff_context = SwiGLUFeedForward(dim, mlp_ratio)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, mod_img: torch.Tensor, mod_txt: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        (shift, scale, gate), (shift_mlp, scale_mlp, gate_mlp) = _modulations(mod_img, 2)
        (c_shift, c_scale, c_gate), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = _modulations(mod_txt, 2)
        if self.fused:
            from mstar_kernels.dit import ada_layer_norm, gated_residual

            img_attn, txt_attn = self.attn(ada_layer_norm(img, shift, scale, self.eps),
                                           ada_layer_norm(txt, c_shift, c_scale, self.eps), rope)
            img, ff_in = ada_layer_norm(img, shift_mlp, scale_mlp, self.eps, gate=gate, y=img_attn)
            img = gated_residual(img, gate_mlp, self.ff(ff_in))
            txt, ff_in = ada_layer_norm(txt, c_shift_mlp, c_scale_mlp, self.eps, gate=c_gate, y=txt_attn)
            txt = gated_residual(txt, c_gate_mlp, self.ff_context(ff_in))
            if txt.dtype == torch.float16:
                txt = txt.clip(-65504, 65504)
            return img, txt
        img_in = (1 + scale) * self._norm(img) + shift
        txt_in = (1 + c_scale) * self._norm(txt) + c_shift
        img_attn, txt_attn = self.attn(img_in, txt_in, rope)
        img = img + gate * img_attn
        img = img + gate_mlp * self.ff(self._norm(img) * (1 + scale_mlp) + shift_mlp)
        txt = txt + c_gate * txt_attn
        txt = txt + c_gate_mlp * self.ff_context(self._norm(txt) * (1 + c_scale_mlp) + c_shift_mlp)
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        return img, txt


class SingleStreamBlock(nn.Module):
    fused = False

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.attn = ParallelSelfAttention(dim, heads, head_dim, mlp_ratio, eps)

    def forward(self, hidden: torch.Tensor, mod: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ((shift, scale, gate),) = _modulations(mod, 1)
        if self.fused:
            from mstar_kernels.dit import ada_layer_norm, gated_residual

            hidden = gated_residual(hidden, gate, self.attn(ada_layer_norm(hidden, shift, scale, self.eps), rope))
        else:
            normed = (1 + scale) * F.layer_norm(hidden, (hidden.shape[-1],), eps=self.eps) + shift
            hidden = hidden + gate * self.attn(normed, rope)
        if hidden.dtype == torch.float16:
            hidden = hidden.clip(-65504, 65504)
        return hidden


# embeddings and heads


class TimestepEmbedder(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeGuidanceEmbed(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.timestep_embedder = TimestepEmbedder(in_channels, dim)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        return self.timestep_embedder(sinusoid(timestep, self.in_channels).to(timestep.dtype))


def sinusoid(timesteps: torch.Tensor, channels: int, max_period: int = 10000) -> torch.Tensor:
    """`[B]` -> `[B, channels]` (cos first), fp32."""
    half = channels // 2
    exponent = -math.log(max_period) * torch.arange(0, half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(exponent / half)
    angles = timesteps[:, None].float() * freqs[None, :]
    emb = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


class Modulation(nn.Module):
    def __init__(self, dim: int, sets: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 3 * sets, bias=False)

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        return self.linear(F.silu(temb))


class AdaNormOut(nn.Module):
    fused = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, dim * 2, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = torch.chunk(self.linear(F.silu(temb).to(x.dtype)), 2, dim=1)
        if self.fused:
            from mstar_kernels.dit import ada_layer_norm

            return ada_layer_norm(x, shift[:, None, :], scale[:, None, :], self.eps)
        return F.layer_norm(x, (x.shape[-1],), eps=self.eps) * (1 + scale)[:, None, :] + shift[:, None, :]


class Flux2Transformer(nn.Module):
    def __init__(self, config: Flux2TransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        block_args = (dim, heads, head_dim, config.mlp_ratio, config.eps)
        self.time_guidance_embed = TimeGuidanceEmbed(config.timestep_guidance_channels, dim)
        self.double_stream_modulation_img = Modulation(dim, 2)
        self.double_stream_modulation_txt = Modulation(dim, 2)
        self.single_stream_modulation = Modulation(dim, 1)
        self.x_embedder = nn.Linear(config.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(config.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(DoubleStreamBlock(*block_args) for _ in range(config.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            SingleStreamBlock(*block_args) for _ in range(config.num_single_layers)
        )
        self.norm_out = AdaNormOut(dim, config.eps)
        self.proj_out = nn.Linear(dim, config.in_channels, bias=False)

    def use_fused_kernels(self, enabled: bool = True) -> None:
        """Route the elementwise glue through the Triton kernels (CUDA only; see the module's docstring)."""
        for module in self.modules():
            if isinstance(module, (SwiGLUFeedForward, JointAttention, ParallelSelfAttention, DoubleStreamBlock,
                                   SingleStreamBlock, AdaNormOut)):
                module.fused = enabled

    def lora_aliases(self) -> dict[str, tuple[tuple[str, int, tuple[int, ...]], ...]]:
        """The original (BFL) module names a LoRA file may use (ai-toolkit and Kohya write them) -> the weights each
        covers, as (weight, chunks of lora_B's rows, the chunks it takes in order; `dit_lora.Layout`). A fused qkv
        covers our three projections, a third of the rows each; the final adaLN modulation's two halves are swapped,
        as diffusers' checkpoint conversion swaps its shift and scale rows."""

        def one(module: str) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
            return ((f"{module}.weight", 1, (0,)),)

        def thirds(*modules: str) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
            return tuple((f"{module}.weight", 3, (i,)) for i, module in enumerate(modules))

        aliases = {
            "img_in": one("x_embedder"), "txt_in": one("context_embedder"),
            "time_in.in_layer": one("time_guidance_embed.timestep_embedder.linear_1"),
            "time_in.out_layer": one("time_guidance_embed.timestep_embedder.linear_2"),
            "double_stream_modulation_img.lin": one("double_stream_modulation_img.linear"),
            "double_stream_modulation_txt.lin": one("double_stream_modulation_txt.linear"),
            "single_stream_modulation.lin": one("single_stream_modulation.linear"),
            "final_layer.linear": one("proj_out"),
            "final_layer.adaLN_modulation.1": (("norm_out.linear.weight", 2, (1, 0)),),
        }
        for i in range(len(self.transformer_blocks)):
            bfl, ours = f"double_blocks.{i}", f"transformer_blocks.{i}"
            aliases[f"{bfl}.img_attn.qkv"] = thirds(*(f"{ours}.attn.to_{x}" for x in "qkv"))
            aliases[f"{bfl}.txt_attn.qkv"] = thirds(*(f"{ours}.attn.add_{x}_proj" for x in "qkv"))
            aliases[f"{bfl}.img_attn.proj"] = one(f"{ours}.attn.to_out.0")
            aliases[f"{bfl}.txt_attn.proj"] = one(f"{ours}.attn.to_add_out")
            for stream, ff in (("img", "ff"), ("txt", "ff_context")):
                aliases[f"{bfl}.{stream}_mlp.0"] = one(f"{ours}.{ff}.linear_in")
                aliases[f"{bfl}.{stream}_mlp.2"] = one(f"{ours}.{ff}.linear_out")
        for i in range(len(self.single_transformer_blocks)):
            aliases[f"single_blocks.{i}.linear1"] = one(f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj")
            aliases[f"single_blocks.{i}.linear2"] = one(f"single_transformer_blocks.{i}.attn.to_out")
        return aliases

    def rope(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for the joint [txt, img] sequence (depends only on the token layout: cache per shape)."""
        txt_cos, txt_sin = rope_tables(txt_ids, self.config.axes_dims_rope, self.config.rope_theta)
        img_cos, img_sin = rope_tables(img_ids, self.config.axes_dims_rope, self.config.rope_theta)
        return torch.cat([txt_cos, img_cos], dim=0), torch.cat([txt_sin, img_sin], dim=0)

    def forward(self, hidden: torch.Tensor, prompt_embeds: torch.Tensor, timestep: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`hidden` `[B, N, C]`, `prompt_embeds` `[B, T, J]`, `timestep` `[B]` in [0, 1] (the reference's t/1000),
        `rope` from `rope()` -> velocity `[B, N, C]`."""
        temb = self.time_guidance_embed(timestep.to(hidden.dtype) * 1000)
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        img = self.x_embedder(hidden)
        txt = self.context_embedder(prompt_embeds)
        for block in self.transformer_blocks:
            img, txt = block(img, txt, mod_img, mod_txt, rope)
        num_txt = txt.shape[1]
        joint = torch.cat([txt, img], dim=1)
        for block in self.single_transformer_blocks:
            joint = block(joint, mod_single, rope)
        return self.proj_out(self.norm_out(joint[:, num_txt:, ...], temb))
