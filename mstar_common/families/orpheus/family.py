"""The Orpheus family: deployment checks and the builders of its two components (`lm`, `snac`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError, check_kv_pool_holds_cap
from mstar_common.families.base import (
    Family,
    causal_lm_kv_shape,
    check_kernel_head_dim,
    check_lm_checkpoint,
    check_position_limit,
    refuse_upload_limit,
)
from mstar_common.families.orpheus.codes import FRAME_RULES
from mstar_common.families.orpheus.graph import GRAPH
from mstar_common.families.orpheus.tokens import CODES_PER_FRAME, DEFAULT_VOICE, PROMPT_FRAMING_IDS, VOICES

logger = logging.getLogger(__name__)

MODEL_KWARGS = {
    "dtype": "LM weights: float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on gpu)",
    "codec_dtype": "SNAC weights: float32 | bfloat16 (default float32)",
    "codec_checkpoint": "SNAC checkpoint dir or cached repo id (default: <checkpoint>/snac)",
    "codec_noise": "SNAC NoiseBlocks on/off (default: the codec checkpoint's `noise`)",
    "codec_max_batch": "windows per SNAC run, the largest CUDA-graph bucket (default 64)",
    "default_max_tokens": "audio-token cap for requests that set no max_tokens (default 1200, ~14 s)",
    "max_input_tokens": "cap on the tokenized input text (default 1024)",
    "voices": "the checkpoint's voice names (default: the fine-tuned checkpoints' eight)",
    "default_voice": "voice for requests that name none (default tara)",
    "frame_rule": "strict (drop malformed frames) | wrap (random-weight demos and benchmarks only)",
    "codec_in_process": "decode SNAC inside the LM component instead of through the BLS hop (default false)",
    "first_chunk_frames": "SNAC frames (85 ms each) in a stream's first audio response (default 3: a 256 ms "
                          "playback buffer against the gaps when many streams start together; 1: the first frame "
                          "as soon as it is decoded; auto: 1 frame, plus one per 40 streams being served, up to 8)",
}
DTYPES = ("float32", "bfloat16", "float16")
# H200, 2026-12-01 (docs/benchmarks.md): with 3, c=192 had 148/192 streams without a playback gap against 0/192
# with 1, for 35 ms more first audio at c=1 (93 ms).
DEFAULT_FIRST_CHUNK_FRAMES = 3
_POSITIVE_INTS = ("codec_max_batch", "default_max_tokens", "max_input_tokens")
DEFAULT_MAX_INPUT_TOKENS = 1024  # text tokens of one request


def _builtin(preset: str):
    def build(out_dir: Path) -> Path:
        from mstar_common.families.orpheus.tiny import build_orpheus_checkpoint

        return build_orpheus_checkpoint(out_dir, preset)

    return build


class OrpheusFamily(Family):
    name: ClassVar[str] = "orpheus"
    graph = GRAPH
    proxy_kind: ClassVar[str] = "speech"
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"orpheus-tiny": _builtin("tiny"),
                                                      "orpheus-3b-random": _builtin("3b")}

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        refuse_upload_limit(dep, source)
        kw = dep.model_kwargs
        if unknown := sorted(set(kw) - set(MODEL_KWARGS)):
            raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: "
                                  f"{sorted(MODEL_KWARGS)} (docs/deployment.md)")
        for key, allowed in (("dtype", DTYPES), ("codec_dtype", DTYPES[:2]), ("frame_rule", FRAME_RULES)):
            if key in kw and kw[key] not in allowed:
                raise DeploymentError(f"{source}: model_kwargs.{key}: must be one of {list(allowed)}, got {kw[key]!r}")
        for key in _POSITIVE_INTS:
            if key in kw and (isinstance(kw[key], bool) or not isinstance(kw[key], int) or kw[key] < 1):
                raise DeploymentError(f"{source}: model_kwargs.{key}: must be an integer >= 1, got {kw[key]!r}")
        frames = kw.get("first_chunk_frames", DEFAULT_FIRST_CHUNK_FRAMES)
        if frames != "auto" and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
            raise DeploymentError(f"{source}: model_kwargs.first_chunk_frames: must be an integer >= 1 or 'auto', "
                                  f"got {frames!r}")
        if "codec_checkpoint" in kw and not (isinstance(kw["codec_checkpoint"], str) and kw["codec_checkpoint"]):
            raise DeploymentError(f"{source}: model_kwargs.codec_checkpoint: must be a checkpoint folder, a cached HF "
                                  f"repo id or builtin:<name>, got {kw['codec_checkpoint']!r}")
        for key in ("codec_noise", "codec_in_process"):
            if key in kw and not isinstance(kw[key], bool):
                raise DeploymentError(f"{source}: model_kwargs.{key}: must be true or false")
        voices = kw.get("voices", list(VOICES))
        if not isinstance(voices, list) or not voices or not all(isinstance(v, str) and v for v in voices):
            raise DeploymentError(f"{source}: model_kwargs.voices: must be a non-empty list of names")
        if kw.get("default_voice", DEFAULT_VOICE) not in voices:
            raise DeploymentError(f"{source}: model_kwargs.default_voice: {kw.get('default_voice', DEFAULT_VOICE)!r} "
                                  f"is not one of voices {voices}")
        max_input = kw.get("max_input_tokens", DEFAULT_MAX_INPUT_TOKENS)
        # a text at the cap must leave room for audio: the prompt adds 6 framing ids and the voice's prefix
        # ("tara: ", a token at least) to the text (tokens.py `prompt_ids`)
        need = max_input + PROMPT_FRAMING_IDS + 1 + CODES_PER_FRAME
        if need > dep.resources.max_model_len:
            raise DeploymentError(f"{source}: model_kwargs.max_input_tokens: {max_input} text tokens, the prompt's "
                                  f"{PROMPT_FRAMING_IDS} framing ids and voice prefix, and one {CODES_PER_FRAME}-token "
                                  f"audio frame need at least {need} tokens, more than resources.max_model_len="
                                  f"{dep.resources.max_model_len}; lower it or raise max_model_len")
        check_kv_pool_holds_cap(dep, source)

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """max_model_len against the LM's positions, the codec checkpoint, and the LM as the Llama loader opens it
        (its config.json, shards and tokenizer: what it does not build or cannot find is refused here, before
        anything starts)."""
        from mstar_common.families.llama.loader import read_llama_config
        from mstar_common.families.orpheus.snac import check_codec_readable

        check_position_limit(dep, checkpoint, source)
        try:
            check_codec_readable(codec_checkpoint(dep, checkpoint))
        except DeploymentError as exc:
            raise DeploymentError(f"{source}: {exc}") from None
        except (ValueError, FileNotFoundError) as exc:
            raise DeploymentError(f"{source}: model_kwargs.codec_checkpoint: {exc}") from None
        check_lm_checkpoint(checkpoint, source, read_llama_config)
        check_kernel_head_dim(dep, checkpoint, "lm", source)

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        if component == "lm":
            self.check_checkpoint(dep, checkpoint, dep.name)
            return _build_lm(dep, checkpoint, device)
        if component == "snac":
            return _build_snac(dep, checkpoint, device)
        raise KeyError(f"orpheus has no component {component!r}")

    def kv_shape(self, checkpoint: Path) -> tuple[int, int, int]:
        return causal_lm_kv_shape(checkpoint)

    def engine_process_refusal(self, component: str, dep: Deployment) -> str | None:
        if dep.model_kwargs.get("codec_in_process", False):
            return "model_kwargs.codec_in_process: the codec decodes in the LM's own stub, beside its codec pump"
        return None  # text in, audio tokens out; the codec is its own component, reached over BLS from the stub


def codec_checkpoint(dep: Deployment, checkpoint: Path) -> Path:
    from mstar_common.checkpoints import resolve_checkpoint

    spec = dep.model_kwargs.get("codec_checkpoint")
    if spec is None:
        path = checkpoint / "snac"
        if not (path / "config.json").is_file():
            raise DeploymentError(f"model_kwargs.codec_checkpoint: not set, and {checkpoint.name} has no snac/ "
                                  "directory (e.g. set it to hubertsiuzdak/snac_24khz)")
        return path
    try:
        return resolve_checkpoint(spec, OrpheusFamily.builtin_checkpoints)
    except FileNotFoundError as exc:
        raise DeploymentError(f"model_kwargs.codec_checkpoint: {exc}") from None


def _build_lm(dep: Deployment, checkpoint: Path, device: str):
    from transformers import AutoTokenizer

    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.cuda_graph import configure_fast_path
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.llama.loader import load_llama
    from mstar_common.families.orpheus.lm import AudioTokenLM, OrpheusLMRuntime
    from mstar_common.families.orpheus.tokens import TokenLayout
    from mstar_common.repository import model_name

    kw = dep.model_kwargs
    dtype = kw.get("dtype") or ("float32" if device == "cpu" else "bfloat16")
    llama, hf_config = load_llama(checkpoint, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    layout = TokenLayout.from_tokenizer(tokenizer, int(hf_config["vocab_size"]))
    kv = dep.resources.kv_cache
    config = EngineConfig(
        num_kv_pages=kv.num_pages, gpu_memory_share=kv.instance_share(dep.components["lm"].placement),
        page_size=kv.page_size, max_num_seqs=dep.max_concurrent_requests,
        max_batch_tokens=dep.resources.max_batch_tokens, max_model_len=dep.resources.max_model_len,
        dtype=dtype, kv_dtype=dep.resources.kv_cache.dtype, device=device,
        prefix_caching=dep.resources.kv_cache.prefix_caching,
        max_queue=dep.admission.resolved_max_queue(dep.max_concurrent_requests),
        queue_timeout_s=dep.admission.queue_timeout_s, request_timeout_s=dep.admission.request_timeout_s,
    )
    model = AudioTokenLM(llama, layout.custom_start, layout.vocab_size)
    # the in-process codec ahead of the engine, which sizes the KV pool by what this process holds by then (an
    # `auto` pool), or checks a fixed one against the memory left: the codec's weights and graphs are part of it
    local_codec = _build_snac(dep, checkpoint, device) if kw.get("codec_in_process", False) else None
    graphs = configure_fast_path(model, dep.components["lm"], device, dep.max_concurrent_requests,
                                 dep.resources.max_batch_tokens)
    engine = AREngine(model, config, eos_token_ids=layout.stop_token_ids, vocab_size=layout.vocab_size,
                      graphs=graphs)
    snac_config = json.loads((codec_checkpoint(dep, checkpoint) / "config.json").read_text())
    logger.info("[orpheus/lm] loaded %s on %s (%s, attention %s, cuda graphs %s)", checkpoint.name, device, dtype,
                model.attn_backend.name, graphs is not None)
    return OrpheusLMRuntime(
        engine=engine, tokenizer=tokenizer, layout=layout,
        voices=tuple(kw.get("voices", VOICES)), default_voice=kw.get("default_voice", DEFAULT_VOICE),
        max_input_tokens=kw.get("max_input_tokens", DEFAULT_MAX_INPUT_TOKENS),
        default_max_tokens=kw.get("default_max_tokens", 1200),
        frame_rule=kw.get("frame_rule", "strict"), codec_model=model_name(dep.family, "snac"),
        sample_rate=int(snac_config.get("sampling_rate", 24000)),
        first_chunk_frames=_first_chunk_frames(kw.get("first_chunk_frames", DEFAULT_FIRST_CHUNK_FRAMES)),
        local_codec=local_codec,
    )


def _first_chunk_frames(value: int | str) -> int | None:
    """The knob's value for codec_pump.AudioStream: a frame count, or None for "auto"."""
    return None if value == "auto" else int(value)


def _build_snac(dep: Deployment, checkpoint: Path, device: str):
    import torch

    from mstar_common.families.orpheus.codec import SnacCodec
    from mstar_common.families.orpheus.snac import load_snac_decoder

    kw = dep.model_kwargs
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kw.get("codec_dtype", "float32")]
    decoder = load_snac_decoder(codec_checkpoint(dep, checkpoint), dtype=dtype, device=device,
                                noise=kw.get("codec_noise"))
    use_graphs = dep.components["snac"].cuda_graphs and device.startswith("cuda")
    logger.info("[orpheus/snac] loaded on %s (%s), cuda graphs %s", device, dtype, use_graphs)
    return SnacCodec(decoder, torch.device(device), max_batch=kw.get("codec_max_batch", 64), use_cuda_graphs=use_graphs)
