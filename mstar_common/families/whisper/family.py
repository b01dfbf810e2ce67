"""The Whisper family (WhisperForConditionalGeneration, tiny … large-v3): deployment checks and the builders of
its walk and two components. The graph and the request path are drawn in `graph.py`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError, check_kv_pool_holds_cap, is_finite_number
from mstar_common.families.base import Family, check_fp8_head_dim, check_max_model_len
from mstar_common.families.whisper.graph import GRAPH
from mstar_common.memory_plan import DTYPE_BYTES

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_UPLOAD_S = 600.0


@dataclass(frozen=True, slots=True)
class WhisperOptions:
    """`model_kwargs` of a Whisper deployment."""

    dtype: str | None = None  # float32 | bfloat16 | float16; None: float32 on cpu, bfloat16 on gpu
    max_audio_bytes: int = 25 * 1024 * 1024  # encoded upload size (a larger upload is a 400)
    encoder_max_batch: int = 16  # windows per encoder forward (and the largest CUDA-graph bucket)
    max_parallel_windows: int = 16  # windows of one upload in flight at once
    # the temperature fallback of timestamped requests without a temperature (OpenAI Whisper's defaults; null: off)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    def dtype_for(self, device: str) -> str:
        return self.dtype or ("float32" if device == "cpu" else "bfloat16")


def max_audio_bytes(dep: Deployment, options: WhisperOptions) -> int:
    """The encoded upload cap: `model_kwargs.max_audio_bytes` where set, else OpenAI's 25 MiB or the proxy's body
    cap (`limits.max_body_bytes`, 16 MiB unless set) where that is smaller, so a deployment without either starts."""
    if "max_audio_bytes" in dep.model_kwargs:
        return options.max_audio_bytes
    body_cap = getattr(getattr(dep, "limits", None), "max_body_bytes", None)
    return options.max_audio_bytes if body_cap is None else min(options.max_audio_bytes, body_cap)


def options_from_kwargs(kwargs: dict[str, Any], source: str) -> WhisperOptions:
    allowed = {f.name for f in fields(WhisperOptions)}
    if unknown := sorted(set(kwargs) - allowed):
        raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    options = WhisperOptions(**kwargs)
    if options.dtype is not None and options.dtype not in DTYPES:
        raise DeploymentError(f"{source}: model_kwargs.dtype: must be one of {list(DTYPES)}, got {options.dtype!r}")
    for name in ("max_audio_bytes", "encoder_max_batch", "max_parallel_windows"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DeploymentError(f"{source}: model_kwargs.{name}: must be an integer >= 1, got {value!r}")
    for name, low, high in (("compression_ratio_threshold", 0.0, None), ("logprob_threshold", None, 0.0),
                            ("no_speech_threshold", 0.0, 1.0)):
        value = getattr(options, name)
        if value is None:
            continue
        if not is_finite_number(value) or (low is not None and value < low) or (high is not None and value > high):
            bounds = f"in [{low}, {high}]" if low is not None and high is not None else (
                f">= {low}" if low is not None else f"<= {high}")
            raise DeploymentError(f"{source}: model_kwargs.{name}: must be null (the rule off) or a number {bounds}, "
                                  f"got {value!r}")
    return options


def max_upload_seconds(dep: Deployment) -> float:
    limits = getattr(dep, "limits", None)
    return float(getattr(limits, "max_upload_s", DEFAULT_MAX_UPLOAD_S))


def _build_tiny(out_dir: Path) -> Path:
    from mstar_common.families.whisper.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out_dir)


def _build_large_v3_random(out_dir: Path) -> Path:
    from mstar_common.families.whisper.tiny import build_large_v3_random

    return build_large_v3_random(out_dir)


class WhisperFamily(Family):
    name: ClassVar[str] = "whisper"
    graph = GRAPH
    proxy_kind: ClassVar[str] = "transcription"
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"whisper-tiny-random": _build_tiny,
                                                     "whisper-large-v3-random": _build_large_v3_random}

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        options = options_from_kwargs(dep.model_kwargs, source)
        if dep.components["walk"].placement.device != "cpu":
            raise DeploymentError(f"{source}: components.walk.placement: the walk router runs on the cpu")
        if dep.components["walk"].cuda_graphs:
            raise DeploymentError(f"{source}: components.walk.cuda_graphs: the walk router runs no model")
        if dep.components["decoder"].prefill_token_buckets:
            raise DeploymentError(f"{source}: components.decoder.prefill_token_buckets: only the decoder's decode "
                                  "steps are captured (its prefill steps attend per row and run eager)")
        body_cap = getattr(getattr(dep, "limits", None), "max_body_bytes", None)
        if body_cap is not None and max_audio_bytes(dep, options) > body_cap:  # only a cap the deployment set can be
            raise DeploymentError(f"{source}: model_kwargs.max_audio_bytes: {options.max_audio_bytes} exceeds "
                                  f"limits.max_body_bytes ({body_cap}); the proxy would refuse such uploads first")
        if not dep.components["decoder"].capture_sampling:
            raise DeploymentError(f"{source}: components.decoder.capture_sampling: the decoder's graphs stop at the "
                                  "logits (its token rules and the sampler run after the replay, for greedy and "
                                  "sampled steps alike), so there is no sampling variant to leave out; remove it")
        if dep.components["decoder"].attention_backend == "flashinfer":
            raise DeploymentError(f"{source}: components.decoder.attention_backend: 'flashinfer' plans each step for "
                                  "the decoder's self-attention, and its cross-attention over the audio would run "
                                  "that plan; use auto, triton or triton_unfused")
        if dep.resources.kv_cache.prefix_caching:
            raise DeploymentError(f"{source}: resources.kv_cache.prefix_caching: the decoder's KV depends on the "
                                  "audio as well as the token ids, so whisper cannot reuse prompt prefixes "
                                  "(leave it unset or false)")
        check_kv_pool_holds_cap(dep, source)

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        from mstar_common.families.whisper.loader import read_config

        config = read_config(checkpoint)[0]
        check_max_model_len(dep, config.max_target_positions, "max_target_positions", source)
        check_fp8_head_dim(dep, "decoder", self.kv_shape(checkpoint)[2], source)
        # what the components would refuse at load, after the decoder's weights: known from the files now
        read_tokens(checkpoint)
        frontend_config(checkpoint, config.num_mel_bins)

    def kv_shape(self, checkpoint: Path) -> tuple[int, int, int]:
        """The decoder's self-attention pool (the cross-attention slots are apart from it)."""
        config = json.loads((checkpoint / "config.json").read_text())
        heads = int(config["decoder_attention_heads"])
        return int(config["decoder_layers"]), heads, int(config["d_model"]) // heads

    def extra_pools(self, dep: Deployment, checkpoint: Path) -> list[tuple[str, str, int, str]]:
        """The decoder's cross-attention K/V: one slot of the encoder's positions per admitted request."""
        device = "cpu" if dep.components["decoder"].placement.device == "cpu" else "cuda"
        dtype = options_from_kwargs(dep.model_kwargs, dep.name).dtype_for(device)
        what = f"cross-attention KV ({dep.max_concurrent_requests} slots, {dtype})"
        return [("decoder", what, cross_kv_bytes(checkpoint, dep.max_concurrent_requests,
                                                 dep.resources.kv_cache.page_size, dtype), "max_concurrent_requests")]

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        builders = {"walk": _walk, "encoder": _encoder, "decoder": _decoder}
        if component not in builders:
            raise KeyError(f"whisper has no component {component!r}; it has {sorted(builders)}")
        options = options_from_kwargs(dep.model_kwargs, dep.name)
        runtime = builders[component](dep, options, checkpoint, device)
        logger.info("[whisper/%s] loaded %s on %s (%s)", component, checkpoint.name, device,
                    options.dtype_for(device))
        return runtime


def read_tokens(checkpoint: Path):
    from mstar_common.families.whisper.decoding import WhisperTokens
    from mstar_common.families.whisper.loader import read_config

    config, _ = read_config(checkpoint)
    gen_path = checkpoint / "generation_config.json"
    if not gen_path.is_file():
        raise DeploymentError(f"checkpoint {checkpoint.name}: generation_config.json is required (it declares "
                              "Whisper's special tokens and decoding rules)")
    try:
        config_forced = json.loads((checkpoint / "config.json").read_text()).get("forced_decoder_ids")
        return WhisperTokens.from_generation_config(json.loads(gen_path.read_text()), config.vocab_size,
                                                    config.max_target_positions, config_forced)
    except ValueError as exc:
        raise DeploymentError(f"checkpoint {checkpoint.name}: {exc}") from None


def cross_kv_bytes(checkpoint: Path, num_slots: int, page_size: int, dtype: str) -> int:
    """What the decoder's CrossKVPool allocates: per layer K and V of `max_source_positions` (in whole pages) per
    slot (modeling.CrossKVPool)."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = int(config["decoder_attention_heads"])
    head_dim = int(config["d_model"]) // heads
    positions = -(-int(config["max_source_positions"]) // page_size) * page_size
    return int(config["decoder_layers"]) * 2 * num_slots * positions * heads * head_dim * DTYPE_BYTES[dtype]


def _walk(dep: Deployment, options: WhisperOptions, checkpoint: Path, device: str):
    from transformers import AutoTokenizer

    from ensembles.whisper import FallbackRules, WalkOptions, WhisperWalk
    from mstar_common.families.whisper.audio import AudioLimits

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    limits = AudioLimits(max_seconds=max_upload_seconds(dep), max_bytes=max_audio_bytes(dep, options))
    decoders, walks = (dep.components[name].placement.total_instances for name in ("decoder", "walk"))
    in_flight = max(1, dep.max_concurrent_requests * decoders // walks)
    # the positions the decoder serves (resources.max_model_len, at most the checkpoint's): the prompt's half and
    # each window's room for max_tokens come from them, so the walk caps what the decoder would refuse
    tokens = read_tokens(checkpoint)
    tokens = replace(tokens, max_length=min(tokens.max_length, dep.resources.max_model_len))
    return WhisperWalk(tokenizer, tokens,
                       WalkOptions(limits, options.max_parallel_windows, max_windows_in_flight=in_flight,
                                   fallback=FallbackRules(options.compression_ratio_threshold,
                                                          options.logprob_threshold, options.no_speech_threshold),
                                   queue_timeout_s=dep.admission.queue_timeout_s))


def frontend_config(checkpoint: Path, num_mel_bins: int):
    """The checkpoint's log-mel front end (preprocessor_config.json; Whisper's standard one where there is none),
    refused where it is not the standard one."""
    from mstar_common.families.whisper.frontend import FrontEndConfig

    pre_path = checkpoint / "preprocessor_config.json"
    try:
        preprocessor = json.loads(pre_path.read_text()) if pre_path.is_file() else {}
        if not isinstance(preprocessor, dict):
            raise ValueError("preprocessor_config.json is not a JSON object")
        return FrontEndConfig.from_hf(preprocessor, num_mel_bins)
    except ValueError as exc:  # json's JSONDecodeError is one
        raise DeploymentError(f"checkpoint {checkpoint.name}: {exc}") from None


def _encoder(dep: Deployment, options: WhisperOptions, checkpoint: Path, device: str):
    from mstar_common.families.whisper.components import EncoderComponent
    from mstar_common.families.whisper.frontend import LogMelFrontEnd
    from mstar_common.families.whisper.loader import load_encoder, read_config

    config, _ = read_config(checkpoint)
    frontend = LogMelFrontEnd(frontend_config(checkpoint, config.num_mel_bins), device)
    model = load_encoder(checkpoint, options.dtype_for(device), device)
    cuda_graphs = dep.components["encoder"].cuda_graphs and device.startswith("cuda")
    return EncoderComponent(model, frontend, device, options.encoder_max_batch, cuda_graphs=cuda_graphs)


def _decoder(dep: Deployment, options: WhisperOptions, checkpoint: Path, device: str):
    from mstar_common.engine.ar_engine import AREngine
    from mstar_common.engine.attention import _has_triton, select_attention_backend
    from mstar_common.engine.cuda_graph import GraphConfig, default_decode_buckets
    from mstar_common.engine.types import EngineConfig
    from mstar_common.families.whisper.components import DecoderRuntime
    from mstar_common.families.whisper.decoding import TokenRules
    from mstar_common.families.whisper.loader import load_decoder, read_config
    from mstar_common.layers.linear import use_gemv_from_env

    config, _ = read_config(checkpoint)
    check_max_model_len(dep, config.max_target_positions, "max_target_positions", dep.name)
    dtype = options.dtype_for(device)
    component = dep.components["decoder"]
    fused = bool(component.fused_ops and device.startswith("cuda") and _has_triton())
    # On a GPU: q/k/v as one GEMM, each residual add + LayerNorm as one kernel (the CPU keeps HF's op order).
    model = load_decoder(checkpoint, dtype, device, fuse_projections=fused,
                         attn_backend=select_attention_backend(device, component.attention_backend))
    model.enable_fused_ops(fused)
    if fused:
        use_gemv_from_env(model)
    kv = dep.resources.kv_cache
    if device.startswith("cuda"):  # refused naming its key, not a CUDA out-of-memory traceback from the allocation
        import torch

        need = cross_kv_bytes(checkpoint, dep.max_concurrent_requests, kv.page_size, dtype)
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need > free:
            raise DeploymentError(
                f"{dep.name}: max_concurrent_requests: the decoder's {dep.max_concurrent_requests} cross-attention KV "
                f"slots need {need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on {device}; lower "
                f"max_concurrent_requests")
    model.configure_slots(dep.max_concurrent_requests, kv.page_size)
    tokens = read_tokens(checkpoint)
    model.rules = TokenRules(tokens, device)
    admission = dep.admission
    engine_config = EngineConfig(
        num_kv_pages=kv.num_pages, gpu_memory_share=kv.instance_share(dep.components["decoder"].placement),
        page_size=kv.page_size, max_num_seqs=dep.max_concurrent_requests,
        max_batch_tokens=dep.resources.max_batch_tokens, max_model_len=dep.resources.max_model_len,
        dtype=dtype, kv_dtype=dep.resources.kv_cache.dtype, device=device,
        prefix_caching=dep.resources.kv_cache.prefix_caching,
        max_queue=admission.resolved_max_queue(dep.max_concurrent_requests),
        queue_timeout_s=admission.queue_timeout_s, request_timeout_s=admission.request_timeout_s,
    )
    graphs = None
    if component.cuda_graphs and device.startswith("cuda"):
        # Decode steps only; sampling runs after the replay, behind the token rules (process_logits).
        graphs = GraphConfig(decode_buckets=component.decode_buckets or default_decode_buckets(
            dep.max_concurrent_requests), token_buckets=[], capture_sampling=False)
    engine = AREngine(model, engine_config, eos_token_ids=[tokens.eot], vocab_size=config.vocab_size, graphs=graphs)
    logger.info("[whisper/decoder] cross-KV pool: %d slots, %.1f MiB", model.cross_kv.num_slots,
                model.cross_kv.num_bytes / 2**20)
    return DecoderRuntime(engine, tokens, dep.resources.max_model_len, (config.max_source_positions, config.d_model))
