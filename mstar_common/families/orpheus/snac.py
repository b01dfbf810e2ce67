"""SNAC 24 kHz decoder (codes -> waveform): the decoder half of `snac.SNAC`, weight norm folded at load.

    codes  level 0 [B, F] · level 1 [B, 2F] · level 2 [B, 4F]            (F frames of 7 codes)
      └─ per level: codebook row ▸ out_proj (1×1) ▸ repeat ×stride (4, 2, 1) ─ sum ─▶ z [B, 768, 4F]
    z ─ depthwise conv7 ▸ conv1×1 ─▶ [B, 1024, 4F]
      ─ 4 × DecoderBlock(snake ▸ transposed conv ↑8/8/4/2 ▸ noise ▸ 3 residual units, dilation 1/3/9)
      ─ snake ▸ conv7 ▸ tanh ─▶ audio [B, 1, 4F × 512]                    (24 kHz, 2048 samples per frame)

Module names mirror the `snac` package (`quantizer.quantizers.N.*`, `decoder.model.N.*`), so a SNAC checkpoint
(`config.json` + `pytorch_model.bin` or `*.safetensors`, weight-norm tensors in either the old `weight_g/_v`
or the parametrization naming) loads by name; its encoder is not read. Only the 24 kHz architecture (no local
attention) is served.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARCHITECTURE_KEYS = ("sampling_rate", "encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "decoder_rates",
                     "attn_window_size", "codebook_size", "codebook_dim", "vq_strides", "noise", "depthwise")
SNAC_24KHZ = {  # hubertsiuzdak/snac_24khz (19.8M parameters; the decoder alone is most of them)
    "sampling_rate": 24000, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "latent_dim": None,
    "decoder_dim": 1024, "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096,
    "codebook_dim": 8, "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}


class Snake1d(nn.Module):
    """`x + sin(alpha x)^2 / alpha`, per channel; `use_kernel` (set on a GPU) runs the fused mstar_kernels/snake.py."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.use_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from mstar_kernels.snake import snake

            return snake(x, self.alpha)
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class NoiseBlock(nn.Module):
    """Adds `randn(B, 1, T) * linear(x)`: the checkpoint's `noise=True` makes every decode draw fresh noise.
    `is_enabled=False` (a deployment's `codec_noise: false`) keeps the weights, so names still load, and adds
    nothing."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(dim, dim, kernel_size=1, bias=False)
        self.is_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_enabled:
            return x
        noise = torch.randn((x.shape[0], 1, x.shape[2]), device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


class ResidualUnit(nn.Module):
    """`x + conv1x1(snake(conv7_dilated(snake(x))))`; `use_kernel` (set on a GPU, depthwise only) runs the
    first three as one kernel (mstar_kernels/snake.py `snake_dwconv_snake`)."""

    def __init__(self, dim: int, dilation: int, groups: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation, groups=groups),
            Snake1d(dim),
            nn.Conv1d(dim, dim, kernel_size=1),
        )
        self.use_kernel = False
        self.use_cudnn_depthwise = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from mstar_kernels.snake import snake_dwconv_snake

            snake1, conv, snake2, pointwise = self.block
            head = snake_dwconv_snake(x, snake1.alpha, conv.weight, conv.bias, conv.dilation[0], snake2.alpha)
            return x + pointwise(head)
        if self.use_cudnn_depthwise:
            snake1, conv, snake2, pointwise = self.block
            return x + pointwise(snake2(_cudnn_depthwise(snake1(x), conv)))
        return x + self.block(x)  # "same" padding: no crop needed


def _cudnn_depthwise(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)` for a depthwise conv through cuDNN. PyTorch sends fp32 depthwise convs to its own CUDA kernel
    (cuDNN only for half types), which was the SNAC decoder's slowest kernel on the H200."""
    dilation, pad = conv.dilation[0], conv.padding[0]
    out = torch.cudnn_convolution(x.unsqueeze(2), conv.weight.unsqueeze(2), (0, pad), (1, 1), (1, dilation),
                                  conv.groups, False, False, torch.backends.cudnn.allow_tf32)
    return out.squeeze(2) + conv.bias[:, None]


def _decoder_block(in_dim: int, out_dim: int, stride: int, noise: bool, groups: int) -> nn.Sequential:
    layers: list[nn.Module] = [
        Snake1d(in_dim),
        nn.ConvTranspose1d(in_dim, out_dim, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2),
                           output_padding=stride % 2),
    ]
    if noise:
        layers.append(NoiseBlock(out_dim))
    layers += [ResidualUnit(out_dim, d, groups) for d in (1, 3, 9)]
    block = nn.Sequential()
    block.block = nn.Sequential(*layers)  # the package nests each DecoderBlock's layers under `.block`
    return block


class SnacQuantizer(nn.Module):
    """`ResidualVectorQuantize.from_codes`: sum over levels of the projected codebook rows."""

    def __init__(self, latent_dim: int, codebook_size: int, codebook_dim: int, strides: list[int]) -> None:
        super().__init__()
        self.strides = list(strides)
        self.quantizers = nn.ModuleList()
        for _ in strides:
            level = nn.Module()
            level.codebook = nn.Embedding(codebook_size, codebook_dim)
            level.out_proj = nn.Conv1d(codebook_dim, latent_dim, kernel_size=1)
            self.quantizers.append(level)

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        z = None
        for level, stride, code in zip(self.quantizers, self.strides, codes, strict=True):
            z_i = level.out_proj(level.codebook(code).transpose(1, 2)).repeat_interleave(stride, dim=-1)
            z = z_i if z is None else z + z_i
        return z


class SnacDecoder(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        config = check_config(config)
        latent = config["latent_dim"] or config["encoder_dim"] * 2 ** len(config["encoder_rates"])
        channels, rates, depthwise = config["decoder_dim"], config["decoder_rates"], config["depthwise"]
        self.sampling_rate = config["sampling_rate"]
        self.vq_strides = list(config["vq_strides"])
        self.hop_length = math.prod(rates)
        self.quantizer = SnacQuantizer(latent, config["codebook_size"], config["codebook_dim"], self.vq_strides)
        if depthwise:
            layers: list[nn.Module] = [nn.Conv1d(latent, latent, kernel_size=7, padding=3, groups=latent),
                                       nn.Conv1d(latent, channels, kernel_size=1)]
        else:
            layers = [nn.Conv1d(latent, channels, kernel_size=7, padding=3)]
        for i, stride in enumerate(rates):
            out_dim = channels // 2 ** (i + 1)
            layers.append(_decoder_block(channels // 2**i, out_dim, stride, config["noise"],
                                         out_dim if depthwise else 1))
        layers += [Snake1d(out_dim), nn.Conv1d(out_dim, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.decoder = nn.Module()
        self.decoder.model = nn.Sequential(*layers)

    @property
    def samples_per_code(self) -> int:
        """Samples per code of the finest level (level 2 of 24 kHz SNAC: 512)."""
        return self.hop_length * self.vq_strides[-1]

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        """`snac.SNAC.decode`: codes per level `[B, T_i]` (int64) -> audio `[B, 1, T_0 * stride_0 * hop]`."""
        return self.decoder.model(self.quantizer(codes))

    def use_fused_kernels(self, enabled: bool = True, residual: bool = False, cudnn_depthwise: bool = False) -> None:
        """Snake in one Triton kernel; with `residual`, each residual unit's snake -> depthwise conv -> snake
        too (measured slower on an H200 than cuDNN's conv between two Snake kernels: off by default); with
        `cudnn_depthwise`, the depthwise convs through cuDNN whatever the dtype."""
        for module in self.modules():
            if isinstance(module, Snake1d):
                module.use_kernel = enabled
            elif isinstance(module, ResidualUnit):
                conv = module.block[1]
                depthwise = conv.groups == conv.in_channels == conv.out_channels
                module.use_kernel = enabled and residual and depthwise
                module.use_cudnn_depthwise = enabled and cudnn_depthwise and depthwise and not module.use_kernel

    def decode_range(self, codes: list[torch.Tensor], start: int, stop: int) -> torch.Tensor:
        """`forward(codes)[:, :, start:stop]`, computing only what those samples depend on.

        Every layer after the latent is "same"-padded or a transposed conv, so each output range depends on
        a known input range (its receptive field). Walking back from `[start, stop)` gives the range each
        stage needs; the forward pass then crops every stage to it (clipped to the real signal, whose edges
        keep their true zero padding). Values next to a crop are wrong (they see zeros where the full
        signal has data) but lie outside what the next stage needs. For a 4-frame window that plays its
        second frame, the three fast stages compute about a third of their samples: the codec's work
        halves, the result is the full decode's (tests/unit/test_orpheus_snac.py).
        """
        layers = list(self.decoder.model)
        blocks = [layer for layer in layers if isinstance(layer, nn.Sequential) and hasattr(layer, "block")]
        first = layers.index(blocks[0])
        snake, conv, tanh = layers[-3:]
        x = self.decoder.model[:first](self.quantizer(codes))  # the latent rate: cheap, computed whole
        lengths = [x.shape[-1]]
        for block in blocks:
            transposed = block.block[1]
            stride, pad, out_pad = transposed.stride[0], transposed.padding[0], transposed.output_padding[0]
            lengths.append((lengths[-1] - 1) * stride - 2 * pad + transposed.kernel_size[0] + out_pad)
        if not 0 <= start < stop <= lengths[-1]:
            raise ValueError(f"decode_range: [{start}, {stop}) outside the decode's {lengths[-1]} samples")
        # Backward: per block, the range its input, its residual units' input and its output must cover.
        halo = (conv.kernel_size[0] - 1) // 2 * conv.dilation[0]
        plan: list[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]] = [None] * len(blocks)
        lo, hi = start - halo, stop + halo
        for k in range(len(blocks) - 1, -1, -1):
            out_range = (max(lo, 0), min(hi, lengths[k + 1]))
            reach = sum((m.block[1].kernel_size[0] - 1) // 2 * m.block[1].dilation[0]
                        for m in blocks[k].block if isinstance(m, ResidualUnit))
            mid_range = (max(out_range[0] - reach, 0), min(out_range[1] + reach, lengths[k + 1]))
            transposed = blocks[k].block[1]
            stride, pad, width = transposed.stride[0], transposed.padding[0], transposed.kernel_size[0]
            lo, hi = -((width - 1 - pad - mid_range[0]) // stride), (mid_range[1] - 1 + pad) // stride + 1
            in_range = (max(lo, 0), min(hi, lengths[k]))  # the inputs feeding mid_range
            plan[k] = (in_range, mid_range, out_range)
        # Forward, cropping: `offset` is the full-signal position of x[..., 0].
        offset = 0
        for block, (in_range, mid_range, out_range) in zip(blocks, plan, strict=True):
            x = x[..., in_range[0] - offset:in_range[1] - offset]
            snake_in, transposed, *rest = block.block
            x = transposed(snake_in(x))
            offset = in_range[0] * transposed.stride[0]  # the transposed conv's output 0 sits there
            x, offset = x[..., mid_range[0] - offset:mid_range[1] - offset], mid_range[0]
            for layer in rest:  # noise (pointwise), then the residual units
                x = layer(x)
            x, offset = x[..., out_range[0] - offset:out_range[1] - offset], out_range[0]
        x = tanh(conv(snake(x)))
        return x[..., start - offset:stop - offset]


def check_config(config: dict[str, Any]) -> dict[str, Any]:
    merged = {**SNAC_24KHZ, **{k: v for k, v in config.items() if k in ARCHITECTURE_KEYS}}
    if unknown := sorted(set(config) - set(ARCHITECTURE_KEYS)):
        raise ValueError(f"SNAC config.json: unknown key(s) {unknown}")
    if merged["attn_window_size"] is not None:
        raise ValueError(f"SNAC config.json attn_window_size={merged['attn_window_size']}: only the 24 kHz "
                         "architecture (no local attention) is served")
    return merged


def load_snac_decoder(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                      noise: bool | None = None) -> SnacDecoder:
    """Build the decoder from a SNAC checkpoint directory; `noise=False` turns the checkpoint's NoiseBlocks off."""
    path = Path(path)
    model = SnacDecoder(json.loads((path / "config.json").read_text()))
    if noise is not None:
        for module in model.modules():
            if isinstance(module, NoiseBlock):
                module.is_enabled = noise
    params = dict(model.named_parameters())
    state = dict(_fold_weight_norm(_read_state(path)))
    decoder_state = {k: v for k, v in state.items() if not k.startswith("encoder.") and "in_proj" not in k}
    missing, unused = sorted(set(params) - set(decoder_state)), sorted(set(decoder_state) - set(params))
    if missing or unused:
        raise ValueError(f"SNAC checkpoint {path.name}: missing {missing[:8]}, unused {unused[:8]}")
    with torch.no_grad():
        for name, tensor in decoder_state.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"SNAC checkpoint tensor {name}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
    return model.to(device=device, dtype=dtype).eval()


def codec_weight_files(path: Path) -> list[Path]:
    """The SNAC checkpoint's weight files: its `*.safetensors`, else its `pytorch_model.bin` (the published
    hubertsiuzdak/snac_24khz ships the latter)."""
    if files := sorted(path.glob("*.safetensors")):
        return files
    bin_path = path / "pytorch_model.bin"
    if not bin_path.is_file():
        raise FileNotFoundError(f"SNAC checkpoint {path.name}: no *.safetensors or pytorch_model.bin")
    return [bin_path]


def check_codec_readable(path: Path) -> None:
    """A ValueError naming the first weight file that is not what it says (a Git LFS pointer, a cut download),
    from its first bytes: torch's own refusal of such a .bin names no file and advises turning its safe loader
    off."""
    from mstar_common.safetensors_io import check_readable

    files = codec_weight_files(path)
    if files[0].suffix == ".safetensors":
        check_readable(files)
    else:
        _check_torch_file(files[0])


def _check_torch_file(file: Path) -> None:
    with open(file, "rb") as f:
        head = f.read(4)
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch's zip format, or a legacy pickle
        raise ValueError(f"{file} is not a readable PyTorch checkpoint (it starts {head!r}); a Git LFS pointer or "
                         "an unfinished download?")


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    from mstar_common.safetensors_io import open_safetensors

    files = codec_weight_files(path)
    if files[0].suffix == ".safetensors":
        state = {}
        for file in files:
            with open_safetensors(file) as reader:
                state.update({key: reader.get_tensor(key) for key in reader.keys()})  # noqa: SIM118
        return state
    _check_torch_file(files[0])
    try:
        return torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a cut zip, a pickle of something else: the file's fault
        raise ValueError(f"{files[0]} is not a readable PyTorch checkpoint ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None


def _fold_weight_norm(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`g * v / ||v||` (norm over every dim but 0, as `weight_norm(dim=0)`) -> plain `.weight` tensors."""
    pairs = {".weight_g": ".weight_v", ".parametrizations.weight.original0": ".parametrizations.weight.original1"}
    for name, tensor in state.items():
        for g_suffix, v_suffix in pairs.items():
            if name.endswith(v_suffix):
                break
            if name.endswith(g_suffix):
                base = name[: -len(g_suffix)]
                yield base + ".weight", torch._weight_norm(state[base + v_suffix], tensor, 0)
                break
        else:
            yield name, tensor
