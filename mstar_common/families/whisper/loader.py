"""Loads an HF Whisper checkpoint (config.json + safetensors, single file or sharded) into our two components.

The encoder component takes `model.encoder.*`, the decoder `model.decoder.*` (and `proj_out.weight`, which
must equal the tied embedding when present). Coverage is checked both ways per component: a parameter the
checkpoint does not fill, or a tensor in the component's part of the checkpoint that nothing reads, fails the
load with the names; so does a tensor that belongs to neither component.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from mstar_common.engine.attention import AttentionBackend
from mstar_common.families.whisper.modeling import WhisperConfig, WhisperDecoderLM, WhisperEncoderModel
from mstar_common.safetensors_io import copy_checked, format_names, tensor_readers

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENCODER_PREFIX = "model.encoder."
DECODER_PREFIX = "model.decoder."
TIED_HEAD = "proj_out.weight"


def read_config(checkpoint_dir: str | Path) -> tuple[WhisperConfig, dict[str, Any]]:
    hf_config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    return WhisperConfig.from_hf(hf_config), hf_config


def load_encoder(checkpoint_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> WhisperEncoderModel:
    path = Path(checkpoint_dir)
    config, _ = read_config(path)
    with torch.device("meta"):
        model = WhisperEncoderModel(config)
    # Built on meta, materialised uninitialised: random init of a real-size model would cost seconds.
    model = model.to(dtype=DTYPES[dtype]).to_empty(device=device)
    _fill(model, path, ENCODER_PREFIX)
    logger.info("[whisper/encoder] loaded %d layers (d_model %d, %d mel bins) from %s", config.encoder_layers,
                config.d_model, config.num_mel_bins, path.name)
    return model.eval()


def load_decoder(checkpoint_dir: str | Path, dtype: str = "float32", device: str = "cpu",
                 attn_backend: AttentionBackend | None = None, fuse_projections: bool = False) -> WhisperDecoderLM:
    path = Path(checkpoint_dir)
    config, _ = read_config(path)
    with torch.device("meta"):
        model = WhisperDecoderLM(config, attn_backend)
    model = model.to(dtype=DTYPES[dtype]).to_empty(device=device)
    model.tie_weights()
    _fill(model, path, DECODER_PREFIX)
    if fuse_projections:
        model.fuse_projections()
    logger.info("[whisper/decoder] loaded %d layers (vocab %d) from %s", config.decoder_layers, config.vocab_size,
                path.name)
    return model.eval()


@torch.no_grad()
def _fill(model: torch.nn.Module, path: Path, prefix: str) -> None:
    params = dict(model.named_parameters())  # the tied proj_out is deduplicated away here
    filled: set[str] = set()
    unused: list[str] = []
    foreign: list[str] = []
    tied_copy = None
    for name, reader in tensor_readers(path):
        if name.startswith(prefix):
            if name in params:
                copy_checked(params[name], reader.get_tensor(name), name)
                filled.add(name)
            else:
                unused.append(name)
        elif name == TIED_HEAD:
            if prefix == DECODER_PREFIX:
                tied_copy = reader.get_tensor(name)
        elif not name.startswith((ENCODER_PREFIX, DECODER_PREFIX)):
            foreign.append(name)
    missing = sorted(set(params) - filled)
    if missing or unused or foreign:
        raise ValueError(f"checkpoint {path.name} does not match Whisper ({prefix}*): missing parameters "
                         f"{format_names(missing)}; unused checkpoint tensors {format_names(sorted(unused + foreign))}")
    embed = "model.decoder.embed_tokens.weight"
    if tied_copy is not None and not torch.equal(tied_copy.to(params[embed]), params[embed]):
        raise ValueError(f"the checkpoint's {TIED_HEAD} differs from {embed}; Whisper ties them")



