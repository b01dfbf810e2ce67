"""The Qwen3 family: deployment checks and the component builder."""

from __future__ import annotations

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
from mstar_common.families.qwen3.graph import GRAPH
from mstar_common.families.text import TextLMRuntime

logger = logging.getLogger(__name__)

MODEL_KWARGS = {
    "dtype": "weights and activations: float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on gpu)",
    "default_max_tokens": "output cap for requests that set no max_tokens (default: none, the room the prompt leaves)",
    "generation_config": "auto (default): a request's unset temperature/top_p/top_k/min_p/repetition_penalty take "
                         "the checkpoint's generation_config.json values, as vLLM's; ignore: the API's defaults",
}
GENERATION_CONFIG_MODES = ("auto", "ignore")
DTYPES = ("float32", "bfloat16", "float16")


def _build_tiny(out_dir: Path) -> Path:
    from mstar_common.families.qwen3.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(out_dir)


class Qwen3Family(Family):
    name: ClassVar[str] = "qwen3"
    graph = GRAPH
    builtin_checkpoints: ClassVar[dict[str, Any]] = {"qwen3-tiny": _build_tiny}

    def validate_deployment(self, dep: Deployment, source: str) -> None:
        refuse_upload_limit(dep, source)
        if unknown := sorted(set(dep.model_kwargs) - set(MODEL_KWARGS)):
            raise DeploymentError(f"{source}: model_kwargs: unknown key(s) {unknown}; allowed: "
                                  f"{sorted(MODEL_KWARGS)} (docs/deployment.md)")
        dtype = dep.model_kwargs.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise DeploymentError(f"{source}: model_kwargs.dtype: must be one of {list(DTYPES)}, got {dtype!r}")
        default_max = dep.model_kwargs.get("default_max_tokens")
        if default_max is not None and (isinstance(default_max, bool) or not isinstance(default_max, int)
                                        or default_max < 1):
            raise DeploymentError(f"{source}: model_kwargs.default_max_tokens: must be an integer >= 1 or null (the "
                                  f"room the prompt leaves), got {default_max!r}")
        mode = dep.model_kwargs.get("generation_config", "auto")
        if mode not in GENERATION_CONFIG_MODES:
            raise DeploymentError(f"{source}: model_kwargs.generation_config: must be one of "
                                  f"{list(GENERATION_CONFIG_MODES)}, got {mode!r}")
        check_kv_pool_holds_cap(dep, source)

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """The checkpoint as the loader opens it (`check_lm_checkpoint`), max_model_len against its positions, and
        its generation_config.json sampling values."""
        check_lm_checkpoint(checkpoint, source, self.read_config)
        check_kernel_head_dim(dep, checkpoint, "llm", source)
        check_position_limit(dep, checkpoint, source)
        sampling_defaults(dep, checkpoint, source)

    def read_config(self, hf_config: dict) -> Any:
        """config.json as this family's loader reads it (ValueError naming the key it refuses)."""
        from mstar_common.families.qwen3.loader import read_qwen3_config

        return read_qwen3_config(hf_config)

    def kv_shape(self, checkpoint: Path) -> tuple[int, int, int]:
        return causal_lm_kv_shape(checkpoint)

    def engine_process_refusal(self, component: str, dep: Deployment) -> str | None:
        return None  # token ids and sampling parameters in, tokens out (the llama family too)

    def load_model(self, checkpoint: Path, dtype: str, device: str) -> tuple[Any, dict]:
        from mstar_common.families.qwen3.loader import load_qwen3

        return load_qwen3(checkpoint, dtype=dtype, device=device)

    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> TextLMRuntime:
        if component != "llm":
            raise KeyError(f"{self.name} has no component {component!r}")
        from transformers import AutoTokenizer

        from mstar_common.engine.ar_engine import AREngine
        from mstar_common.engine.cuda_graph import configure_fast_path
        from mstar_common.engine.types import EngineConfig

        dtype = dep.model_kwargs.get("dtype") or ("float32" if device == "cpu" else "bfloat16")
        model, hf_config = self.load_model(checkpoint, dtype, device)
        graphs = configure_fast_path(model, dep.components[component], device, dep.max_concurrent_requests,
                                     dep.resources.max_batch_tokens)
        self.check_checkpoint(dep, checkpoint, dep.name)
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
        kv = dep.resources.kv_cache
        config = EngineConfig(
            num_kv_pages=kv.num_pages, gpu_memory_share=kv.instance_share(dep.components[component].placement),
            page_size=kv.page_size,
            max_num_seqs=dep.max_concurrent_requests,
            max_batch_tokens=dep.resources.max_batch_tokens,
            max_model_len=dep.resources.max_model_len,
            dtype=dtype, kv_dtype=dep.resources.kv_cache.dtype, prefix_caching=dep.resources.kv_cache.prefix_caching,
            device=device,
            max_queue=dep.admission.resolved_max_queue(dep.max_concurrent_requests),
            queue_timeout_s=dep.admission.queue_timeout_s,
            request_timeout_s=dep.admission.request_timeout_s,
        )
        eos_ids = _eos_ids(checkpoint, hf_config, tokenizer)
        engine = AREngine(model, config, eos_token_ids=eos_ids, vocab_size=int(hf_config["vocab_size"]), graphs=graphs)
        logger.info("[%s/llm] loaded %s on %s (%s, attention %s), eos=%s", self.name, checkpoint.name, device, dtype,
                    model.attn_backend.name, eos_ids)
        if defaults := sampling_defaults(dep, checkpoint, dep.name):
            logger.info("[%s/llm] requests that leave them unset sample with the checkpoint's generation_config.json "
                        "%s (model_kwargs.generation_config: ignore turns this off)", self.name, defaults)
        return TextLMRuntime(
            engine=engine,
            tokenizer=tokenizer,
            vocab_size=int(hf_config["vocab_size"]),
            max_model_len=dep.resources.max_model_len,
            default_max_tokens=dep.model_kwargs.get("default_max_tokens"),
            sampling_defaults=defaults,
        )


def sampling_defaults(dep: Deployment, checkpoint: Path, source: str) -> dict[str, Any]:
    """The checkpoint's recommended sampling knobs (generation_config.json), unless the deployment ignores them."""
    import json

    from mstar_common.families.text import read_sampling_defaults

    path = checkpoint / "generation_config.json"
    if dep.model_kwargs.get("generation_config", "auto") == "ignore" or not path.is_file():
        return {}
    try:
        gen_config = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(gen_config, dict):
            raise ValueError(f"must be a JSON object, got {type(gen_config).__name__}")
        return read_sampling_defaults(gen_config)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeploymentError(f"{source}: checkpoint {checkpoint}: generation_config.json: {exc} (or set "
                              f"model_kwargs.generation_config: ignore)") from None


def _eos_ids(checkpoint: Path, hf_config: dict, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json (what `generate` stops on), else config.json, and the tokenizer's
    `eos_token` beside them, as vLLM stops: a fine-tune whose generation_config names only <|end_of_text|> while
    its tokenizer ends turns with <|eot_id|> ran on past the turn's end to max_tokens."""
    from mstar_common.families.qwen3.loader import read_eos_token_ids

    ids = [int(i) for i in read_eos_token_ids(checkpoint, hf_config) if i is not None]
    if tokenizer.eos_token_id is not None and int(tokenizer.eos_token_id) not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids
