"""What a model family provides to the generator, the validator and the Triton nodes."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from mstar_common.config import Deployment, DeploymentError
from mstar_common.graph import FamilyGraph


class Family(ABC):
    name: ClassVar[str]  # registry key == YAML `family:` == package directory name
    graph: ClassVar[FamilyGraph]
    builtin_checkpoints: ClassVar[dict[str, Any]] = {}  # name -> callable(out_dir) -> Path
    proxy_kind: ClassVar[str] = "text"  # which proxy routes serve it: text | speech

    @abstractmethod
    def validate_deployment(self, dep: Deployment, source: str) -> None:
        """Family checks beyond the generic schema (raise config.DeploymentError naming the key)."""

    def check_checkpoint(self, dep: Deployment, checkpoint: Path, source: str) -> None:
        """Checks of the deployment against its checkpoint (raise config.DeploymentError naming the key): `mstar
        serve` runs them before it starts anything, and the components as they load. None by default."""
        return None

    def wire_dtype(self, dep: Deployment) -> str:
        """The Triton dtype (FP32, BF16 or FP16) of the tensors declared with MODEL_DTYPE: activations that cross
        from one component to another travel in the dtype the components compute in, so a bf16 deployment moves
        half the bytes of fp32 and rounds nothing on the way."""
        return "FP32"

    @abstractmethod
    def build_component(self, component: str, dep: Deployment, checkpoint: Path, device: str) -> Any:
        """Load one component's runtime (weights, resources, engine) for a Triton instance."""

    def kv_shape(self, checkpoint: Path) -> tuple[int, int, int] | None:
        """(layers, KV heads, head dim) of the paged KV pool's component, from the checkpoint's config alone
        (`mstar check` prints the pool's size with it); None for a family without a paged pool."""
        return None

    def extra_pools(self, dep: Deployment, checkpoint: Path) -> list[tuple[str, str, int, str]]:
        """Memory a component allocates at load besides its weights and paged KV pool, per instance, sized by a
        deployment key: (component, what it is, bytes, the key). `mstar check` prints each, and a cpu placement's
        counts toward the machine's memory. Whisper's cross-attention slots; none by default."""
        return []

    def engine_process_refusal(self, component: str, dep: Deployment) -> str | None:
        """Why this autoregressive component's engine cannot run in a process of its own (`MSTAR_ENGINE_PROCESS=1`,
        mstar_common/engine/engine_process.py), or None when it can: its requests must be token ids and sampling
        parameters alone, and nothing but the engine may need the weights it loads."""
        return f"the {self.name} family's requests carry state beside their token ids"


def check_max_model_len(dep: Deployment, limit: int, name: str, source: str) -> None:
    """resources.max_model_len within the checkpoint's position limit (`name` in its config.json)."""
    if dep.resources.max_model_len > limit:
        raise DeploymentError(f"{source}: resources.max_model_len: {dep.resources.max_model_len} exceeds the "
                              f"checkpoint's {name}={limit}")


def check_position_limit(dep: Deployment, checkpoint: Path, source: str) -> None:
    """An HF causal LM's `max_position_embeddings` (config.json), where it declares one, bounds max_model_len; with
    YaRN RoPE, the context it scales to where that is longer (`rotary.position_limit`)."""
    from mstar_common.layers.rotary import position_limit

    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise DeploymentError(f"checkpoint {checkpoint}: cannot read config.json: {exc}") from None
    limit = position_limit(config)
    if limit is not None:
        name = "max_position_embeddings" if limit == config.get("max_position_embeddings") else \
            "YaRN context (original_max_position_embeddings x factor)"
        check_max_model_len(dep, int(limit), name, source)


def refuse_upload_limit(dep: Deployment, source: str) -> None:
    """`limits.max_upload_s` set on a family that takes no uploads: nothing reads it (ENGINE.md §16.3 refuses a
    setting nothing reads, where it was accepted and ignored). The parsed deployment cannot tell the default given
    from the default left unset, so only another value is refused."""
    from mstar_common.config import DeploymentError, LimitsConfig

    if dep.limits.max_upload_s != LimitsConfig().max_upload_s:
        raise DeploymentError(f"{source}: limits.max_upload_s: the {dep.family} family takes no audio or video "
                              f"uploads, so nothing would read it; remove it")


def check_kernel_head_dim(dep: Deployment, checkpoint: Path, component: str, source: str) -> None:
    """A GPU component on the Triton attention kernels (or flashinfer, whose KV write is their prologue) needs a
    head dim they take, and an fp8 pool's 8-bit q.k dot one of at least 32: otherwise its first capture or step
    fails, deep inside a kernel compile or launch. The torch backends take any."""
    from mstar_common.engine.attention import KERNEL_BACKENDS, KERNEL_HEAD_DIMS  # torch: not at import

    comp = dep.components[component]
    if comp.placement.device != "gpu" or comp.attention_backend not in (*KERNEL_BACKENDS, "flashinfer"):
        return
    head_dim = causal_lm_kv_shape(checkpoint)[2]
    if head_dim not in KERNEL_HEAD_DIMS:
        raise DeploymentError(
            f"{source}: components.{component}.attention_backend: {comp.attention_backend!r} runs the Triton "
            f"attention kernels (flashinfer: their KV write), which take head dims {list(KERNEL_HEAD_DIMS)}; the "
            f"checkpoint's head_dim is {head_dim}: set attention_backend: torch_static (or torch)")
    check_fp8_head_dim(dep, component, head_dim, source)


def check_fp8_head_dim(dep: Deployment, component: str, head_dim: int, source: str) -> None:
    """An fp8 pool read by the Triton kernels of a GPU component (its q.k an 8-bit dot over the head dim) needs a
    head dim of at least `FP8_MIN_HEAD_DIM`: the builtin tiny checkpoints' 16 failed to compile at the first step."""
    from mstar_common.engine.attention import KERNEL_BACKENDS  # torch: not at import

    comp = dep.components[component]
    if comp.placement.device != "gpu" or comp.attention_backend not in KERNEL_BACKENDS:
        return
    if dep.resources.kv_cache.dtype == "fp8_e4m3" and head_dim < FP8_MIN_HEAD_DIM:
        raise DeploymentError(
            f"{source}: resources.kv_cache.dtype: fp8_e4m3 reads the pool with 8-bit dots over the head dim, which "
            f"Triton takes from {FP8_MIN_HEAD_DIM}; the checkpoint's head_dim is {head_dim}: use auto (or "
            f"attention_backend: torch_static)")


FP8_MIN_HEAD_DIM = 32  # Triton's 8-bit tl.dot needs K >= 32 (mstar_kernels/paged_decode_attention.py, qk_fp8)


def causal_lm_kv_shape(checkpoint: Path) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of an HF causal LM's config.json (Qwen3, Llama): GQA's KV heads where given, and
    the head dim where given (Qwen3 sets it apart from hidden_size / heads)."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    return int(config["num_hidden_layers"]), int(config.get("num_key_value_heads") or heads), int(head_dim)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # any one, or a *.tiktoken


def check_lm_checkpoint(checkpoint: Path, source: str, read_config: Callable[[dict], Any]) -> None:
    """An HF causal LM checkpoint as its family's loader will open it, before anything starts: `config.json` through
    `read_config` (a model the loader does not build, scaled RoPE, sliding windows, ... are refused naming the key),
    each shard its safetensors index names (a download cut short leaves the index and some shards), and a tokenizer
    (a folder of weights alone would fail inside transformers, in words about sentencepiece)."""
    from mstar_common.safetensors_io import safetensors_files

    hf_config = json.loads((checkpoint / "config.json").read_text())  # unreadable: cli's refusal, naming it
    try:
        read_config(hf_config)
    except ValueError as exc:
        raise DeploymentError(f"{source}: checkpoint {checkpoint}: config.json: {exc}") from None
    try:
        files = safetensors_files(checkpoint)
    except FileNotFoundError:
        return  # no weights: cli.check_against_checkpoint's refusal
    except ValueError as exc:  # an index that is no index
        raise DeploymentError(f"{source}: {exc}") from None
    if missing := [file.name for file in files if not file.is_file()]:
        raise DeploymentError(f"{source}: checkpoint {checkpoint}: model.safetensors.index.json names shard(s) "
                              f"{missing} that are not in the folder (an unfinished download?)")
    if not any((checkpoint / name).is_file() for name in TOKENIZER_FILES) and not any(checkpoint.glob("*.tiktoken")):
        raise DeploymentError(f"{source}: checkpoint {checkpoint}: no tokenizer ({', '.join(TOKENIZER_FILES)} or "
                              f"*.tiktoken); the model is served with the checkpoint's own")
