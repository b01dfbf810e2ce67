"""Deployment schema: a YAML file in configs/ -> typed, validated dataclasses.

The loader turns each mapping into a dataclass and refuses unknown keys, wrong types and impossible
resource plans before anything starts, naming the YAML path of the offending key. Family-specific
checks (which components exist, what the pools must hold) come from the family's graph.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class DeploymentError(ValueError):
    """A deployment that must not start; the message names the YAML key and the rule."""


@dataclass(slots=True)
class Placement:
    """Where one component's Triton instances run."""

    device: Literal["cpu", "gpu"] = "cpu"
    gpus: list[int] = field(default_factory=list)  # GPU ids; one instance group per GPU (gpu only)
    instances: int = 1  # instances per GPU (gpu) or in total (cpu)

    def check(self, path: str) -> None:
        if self.instances < 1:
            raise DeploymentError(f"{path}.instances: must be >= 1, got {self.instances}")
        if self.device == "gpu" and not self.gpus:
            raise DeploymentError(f"{path}.gpus: a gpu placement needs at least one GPU id, e.g. [0]")
        if self.device == "cpu" and self.gpus:
            raise DeploymentError(f"{path}.gpus: a cpu placement takes no GPU ids (got {self.gpus})")
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise DeploymentError(f"{path}.gpus: GPU ids must be distinct and >= 0, got {self.gpus}")


@dataclass(slots=True)
class ComponentConfig:
    placement: Placement = field(default_factory=Placement)
    cuda_graphs: bool = False  # capture decode/prefill graphs at startup (GPU only)


@dataclass(slots=True)
class KVCacheConfig:
    num_pages: int = 512  # pages per instance
    page_size: int = 16  # tokens per page


@dataclass(slots=True)
class Resources:
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    max_model_len: int = 2048  # prompt + output tokens of one request
    max_batch_tokens: int = 2048  # packed tokens per engine step (chunked prefill budget)


@dataclass(slots=True)
class ServerConfig:
    """Ports and Python-backend sizing used by `mstar serve` (the committed repository ignores them)."""

    proxy_port: int = 8000
    http_port: int = 8010
    grpc_port: int = 8001
    metrics_port: int = 8002
    shm_default_byte_size: int = 16 * 1024 * 1024  # Python-backend shared-memory region per stub
    shm_growth_byte_size: int = 16 * 1024 * 1024
    stub_timeout_seconds: int = 120


@dataclass(slots=True)
class Deployment:
    name: str  # the model name clients use (OpenAI `model`)
    family: str
    checkpoint: str  # local dir, HF repo id in the local cache, or builtin:<name>
    components: dict[str, ComponentConfig] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    max_concurrent_requests: int = 16
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_deployment(path: str | Path) -> Deployment:
    path = Path(path)
    if not path.is_file():
        raise DeploymentError(f"deployment file not found: {path}")
    with path.open() as f:
        raw = yaml.safe_load(f)
    return deployment_from_dict(raw, source=path.name)


def deployment_from_dict(raw: Any, source: str = "<deployment>") -> Deployment:
    try:
        dep = _build(Deployment, raw, "")
    except DeploymentError as exc:
        raise DeploymentError(f"{source}: {exc}") from None
    validate_deployment(dep, source)
    return dep


def validate_deployment(dep: Deployment, source: str = "<deployment>") -> None:
    """Generic checks, then the family's own (components, model_kwargs, pool sizes)."""
    from mstar_common.families.registry import get_family

    _check_positive(source, "max_concurrent_requests", dep.max_concurrent_requests)
    _check_positive(source, "resources.kv_cache.num_pages", dep.resources.kv_cache.num_pages)
    _check_positive(source, "resources.kv_cache.page_size", dep.resources.kv_cache.page_size)
    _check_positive(source, "resources.max_model_len", dep.resources.max_model_len)
    _check_positive(source, "resources.max_batch_tokens", dep.resources.max_batch_tokens)
    try:
        family = get_family(dep.family)
    except KeyError as exc:
        raise DeploymentError(f"{source}: family: {exc.args[0]}") from None
    declared = set(family.graph.components)
    given = set(dep.components)
    if missing := sorted(declared - given):
        raise DeploymentError(f"{source}: components: missing {missing} (family {dep.family!r} has {sorted(declared)})")
    if extra := sorted(given - declared):
        raise DeploymentError(f"{source}: components: unknown {extra} (family {dep.family!r} has {sorted(declared)})")
    for name, comp in dep.components.items():
        comp.placement.check(f"{source}: components.{name}.placement")
        if comp.cuda_graphs and comp.placement.device != "gpu":
            raise DeploymentError(f"{source}: components.{name}.cuda_graphs: needs a gpu placement")
    family.validate_deployment(dep, source)


def check_kv_pool_holds_cap(dep: Deployment, source: str) -> None:
    """A paged pool must hold `max_concurrent_requests` requests of full length (no preemption)."""
    kv = dep.resources.kv_cache
    per_request = math.ceil(dep.resources.max_model_len / kv.page_size)
    needed = per_request * dep.max_concurrent_requests
    if kv.num_pages < needed:
        raise DeploymentError(
            f"{source}: resources.kv_cache.num_pages: {kv.num_pages} pages cannot hold max_concurrent_requests="
            f"{dep.max_concurrent_requests} requests of max_model_len={dep.resources.max_model_len} tokens "
            f"({per_request} pages of {kv.page_size} tokens each): need >= {needed}"
        )


def _check_positive(source: str, key: str, value: int) -> None:
    if value < 1:
        raise DeploymentError(f"{source}: {key}: must be >= 1, got {value}")


# --- strict mapping -> dataclass conversion -------------------------------------------------------


def _build(cls: type, raw: Any, path: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DeploymentError(f"{path or '<top level>'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(raw) - names):
        where = f"{path}: " if path else ""
        raise DeploymentError(f"{where}unknown key(s) {unknown}; allowed: {sorted(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        key_path = f"{path}.{f.name}" if path else f.name
        if f.name in raw:
            kwargs[f.name] = _coerce(hints[f.name], raw[f.name], key_path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DeploymentError(f"{key_path}: required key is missing")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args:
            raise DeploymentError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise DeploymentError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise DeploymentError(f"{path}: expected a mapping, got {value!r}")
        return {k: _coerce(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise DeploymentError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DeploymentError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DeploymentError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value:
            raise DeploymentError(f"{path}: expected a non-empty string, got {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp} at {path}")
