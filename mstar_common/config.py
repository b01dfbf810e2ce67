"""Deployment schema: a YAML file in configs/ -> typed, validated dataclasses.

The loader turns each mapping into a dataclass and refuses unknown keys, wrong types and impossible
resource plans before anything starts, naming the YAML path of the offending key. Family-specific
checks (which components exist, what the pools must hold) come from the family's graph.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mstar_common import wire


def env_switch(name: str, default: bool) -> bool:
    """A `0`/`1` environment switch (`MSTAR_PDL`, `MSTAR_NORM_GEMV`, ...); unset or empty is `default`, anything
    else is refused with the switch's name."""
    flag = os.environ.get(name, "") or ("1" if default else "0")
    if flag not in ("0", "1"):
        raise ValueError(f"{name}={flag!r}: expected 0 or 1")
    return flag == "1"


DEFAULT_BLS_HOLD_S = 5.0


def bls_hold_s() -> float:
    """`MSTAR_BLS_HOLD_S`: how long backends/bls.py's ResponseKeeper keeps a finished BLS response iterator (read
    here, where `mstar serve` checks it before tritonserver starts, not only in the stubs)."""
    return number_switch("MSTAR_BLS_HOLD_S", DEFAULT_BLS_HOLD_S, lambda s: 0 <= s < math.inf, "expected seconds >= 0")


def number_switch(name: str, default: float, is_valid: Callable[[float], bool], rule: str) -> float:
    """A numeric environment switch (`MSTAR_STALL_EXIT_S`, ...); unset or empty is `default`, a value that is no
    number or breaks `is_valid` is refused with the switch's name and `rule`."""
    raw = os.environ.get(name, "") or str(default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not is_valid(value):
        raise ValueError(f"{name}={raw!r}: {rule}")
    return value


class DeploymentError(ValueError):
    """A deployment that must not start; the message names the YAML key and the rule."""


@dataclass(slots=True)
class Placement:
    """Where one component's Triton instances run."""

    device: Literal["cpu", "gpu"] = "cpu"
    gpus: list[int] = field(default_factory=list)  # GPU ids; one instance group per GPU (gpu only)
    instances: int = 1  # instances per GPU (gpu) or in total (cpu)

    @property
    def total_instances(self) -> int:
        """Triton instances of the component in all: `instances` on each listed GPU, or `instances` on the cpu."""
        return self.instances * (len(self.gpus) if self.device == "gpu" else 1)

    def check(self, path: str) -> None:
        if not 1 <= self.instances <= 64:
            raise DeploymentError(f"{path}.instances: must be in [1, 64], got {self.instances}")
        if self.device == "gpu" and not self.gpus:
            raise DeploymentError(f"{path}.gpus: a gpu placement needs at least one GPU id, e.g. [0]")
        if self.device == "cpu" and self.gpus:
            raise DeploymentError(f"{path}.gpus: a cpu placement takes no GPU ids (got {self.gpus})")
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise DeploymentError(f"{path}.gpus: GPU ids must be distinct and >= 0, got {self.gpus}")
        if any(g > MAX_GPU_ID for g in self.gpus):  # config.pbtxt's gpus are int32
            raise DeploymentError(f"{path}.gpus: GPU ids are at most {MAX_GPU_ID}, got {max(self.gpus)}")


@dataclass(slots=True)
class ComponentConfig:
    placement: Placement = field(default_factory=Placement)
    cuda_graphs: bool = False  # capture decode/prefill graphs at startup (GPU only)
    # Autoregressive components (engine/cuda_graph.py); None = the engine's default ladder.
    decode_buckets: list[int] | None = None  # rows captured for decode steps (default 1, 2, 4, 8, 16, 24, 32, ...)
    prefill_token_buckets: list[int] | None = None  # prefill/mixed steps (64, 128, ... max_batch_tokens)
    capture_sampling: bool = True  # also capture the on-device sampling variant of each bucket
    attention_backend: str = "auto"  # auto | triton | triton_unfused | torch | torch_static | flashinfer
    fused_ops: bool = True  # Triton kernels for residual-add+RMSNorm and SiLU*up on the GPU


KV_DTYPES = ("auto", "fp8_e4m3")


NUM_PAGES_AUTO = "auto"
DEFAULT_GPU_MEMORY_FRACTION = 0.9


@dataclass(slots=True)
class KVCacheConfig:
    # pages per instance, or "auto": as many as the instance's share of its GPU's memory leaves after its weights and
    # what its steps need (engine/kv_sizing.py); gpu placements only. Unset (null): auto where the pool's component
    # is on a GPU, else the pages max_concurrent_requests requests of max_model_len tokens take (resolve_pool_size)
    num_pages: int | Literal["auto"] | None = None
    page_size: int = 16  # tokens per page
    dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3 (half the bytes of bf16; attention reads it back)
    # reuse earlier prompts' KV pages for a common start. null (default): on where the model's KV depends only on
    # the token ids; true: the same, and a family whose KV does not is refused at startup; false: off
    prefix_caching: bool | None = None
    # with num_pages: auto, the share of a GPU's total memory that the component's instances on it may hold in all
    # (weights, step buffers and graphs, the pool), split evenly among them; null: 0.9
    gpu_memory_fraction: float | None = None

    @property
    def is_auto(self) -> bool:
        return self.num_pages == NUM_PAGES_AUTO

    @property
    def fraction(self) -> float:
        """`gpu_memory_fraction`, its default where unset."""
        return DEFAULT_GPU_MEMORY_FRACTION if self.gpu_memory_fraction is None else self.gpu_memory_fraction

    def instance_share(self, placement: Placement) -> float:
        """The share of its GPU's memory that one instance of a component at `placement` may hold (auto pools)."""
        return self.fraction / placement.instances


@dataclass(slots=True)
class Resources:
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    max_model_len: int = 2048  # prompt + output tokens of one request
    max_batch_tokens: int = 2048  # packed tokens per engine step (chunked prefill budget)


@dataclass(slots=True)
class AdmissionConfig:
    """What happens past `max_concurrent_requests` (per component instance; see engine/admission.py)."""

    max_queue: int | None = None  # requests queued beyond the cap before a 429; None: 4 x max_concurrent_requests
    queue_timeout_s: float | None = 60.0  # longest wait for admission before a 503; None: no limit
    request_timeout_s: float | None = 600.0  # server-side deadline (and ceiling of a client's); None: none
    retry_after_s: int = 1  # Retry-After the proxy sends with a 429 or 503

    def resolved_max_queue(self, max_concurrent_requests: int) -> int:
        return 4 * max_concurrent_requests if self.max_queue is None else self.max_queue


@dataclass(slots=True)
class LimitsConfig:
    """Input caps the proxy enforces before anything reaches Triton (400/413 naming the limit)."""

    max_body_bytes: int = 16 * 1024 * 1024  # a larger request body is a 413
    max_upload_s: float = 600.0  # longest audio/video upload, in seconds of media
    allow_remote_urls: bool = False  # media given as http(s) URLs are fetched only when true


@dataclass(slots=True)
class ServerConfig:
    """Ports, Python-backend sizing and process supervision used by `mstar serve` (docs/reliability.md)."""

    proxy_port: int = 8000
    proxy_workers: int = 1  # OpenAI proxy processes sharing proxy_port (each its own event loop and gRPC channel)
    http_port: int = 8010
    grpc_port: int = 8001
    metrics_port: int = 8002
    shm_default_byte_size: int = 16 * 1024 * 1024  # Python-backend shared-memory region per stub
    shm_growth_byte_size: int = 16 * 1024 * 1024
    stub_timeout_seconds: int = 120
    drain_timeout_s: int = 30  # on shutdown, in-flight requests get this long to finish
    restart_on_fault: bool = True  # relaunch tritonserver when it or one of its stubs dies
    max_restarts: int = 5  # crash loop guard: give up after this many restarts within 10 minutes
    keep_run_folders: int = 10  # run folders of stopped servers of this name kept (the newest); older ones deleted


@dataclass(slots=True)
class Deployment:
    name: str  # the model name clients use (OpenAI `model`)
    family: str
    checkpoint: str  # local dir, HF repo id in the local cache, or builtin:<name>
    components: dict[str, ComponentConfig] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    max_concurrent_requests: int = 16
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_deployment(path: str | Path) -> Deployment:
    path = Path(path)
    if not path.is_file():
        raise DeploymentError(f"deployment file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise DeploymentError(f"{path.name}: not UTF-8 text (byte {data[exc.start]:#04x} on line {line}); save it "
                              f"as UTF-8") from None
    stream = io.StringIO(text)
    stream.name = path.name  # the file the YAML errors' marks name
    try:
        raw = yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise DeploymentError(f"{path.name}: not valid YAML: {exc}") from None
    except RecursionError:
        raise DeploymentError(f"{path.name}: nested too deeply to read (thousands of levels)") from None
    except ValueError as exc:  # an integer of more than 4300 digits (Python's limit on int(str))
        what = "a number of more than 4300 digits" if "digits" in str(exc) else str(exc)
        raise DeploymentError(f"{path.name}: a value cannot be read: {what}") from None
    if raw is None:
        raise DeploymentError(f"{path.name}: empty: a deployment is a mapping with at least name, family, checkpoint "
                              f"and components (docs/deployment.md)")
    return deployment_from_dict(raw, source=path.name)


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one, silently) and a key that
    is not a string (every key of a deployment is a name). YAML merge keys (`<<: *base`) work as in safe_load: the
    mapping's own keys override the merged ones."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"a key is a {key_node.id}; every key is a name",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"the key {key!r} is not a string (every key is a "
                    f"name; quote it)", key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        mapping = super().construct_mapping(node, deep=deep)
        # a merged mapping's keys (`<<: {1: a}`) come in past the loop above
        if stray := [key for key in mapping if not isinstance(key, str)]:  # (0, false and null are keys too)
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark, f"the key {stray[0]!r} (merged in by '<<') is not a "
                "string (every key is a name; quote it)", node.start_mark)
        return mapping

    def construct_yaml_str(self, node: yaml.ScalarNode) -> str:
        """A string, refused where it holds a lone UTF-16 surrogate (a `"\\ud800"` escape): no file name, voice or
        model name can, and writing or printing it would fail later, far from the key."""
        value = super().construct_yaml_str(node)
        if not wire.is_unicode_text(value):  # a pair escaped as two (`"\\ud83d\\ude00"`, as json.dump writes one)
            try:
                value = value.encode("utf-16", "surrogatepass").decode("utf-16")
            except UnicodeDecodeError:
                pass
        if not wire.is_unicode_text(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"the string {value!r} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape), which "
                "is not text", node.start_mark)
        return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:str", _UniqueKeyLoader.construct_yaml_str)


def deployment_from_dict(raw: Any, source: str = "<deployment>") -> Deployment:
    try:
        dep = _build(Deployment, raw, "")
    except DeploymentError as exc:
        raise DeploymentError(f"{source}: {exc}") from None
    validate_deployment(dep, source)
    return dep


# the OpenAI `model` clients send (an HF-style org/name too); it also names the run folder and the proxy's --model
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def validate_deployment(dep: Deployment, source: str = "<deployment>") -> None:
    """Generic checks, then the family's own (components, model_kwargs, pool sizes)."""
    from mstar_common.families.registry import get_family

    if not NAME_RULE.fullmatch(dep.name):
        raise DeploymentError(f"{source}: name: must be 1-128 letters, digits and . _ : / -, starting with a letter or "
                              f"digit (clients send it as the model), got {dep.name!r}")
    _check_positive(source, "max_concurrent_requests", dep.max_concurrent_requests, 2**20)
    _check_kv_pool_size(dep, source)
    _check_positive(source, "resources.kv_cache.page_size", dep.resources.kv_cache.page_size, 4096)
    if dep.resources.kv_cache.dtype not in KV_DTYPES:
        raise DeploymentError(f"{source}: resources.kv_cache.dtype: must be one of {list(KV_DTYPES)}, "
                              f"got {dep.resources.kv_cache.dtype!r}")
    _check_positive(source, "resources.max_model_len", dep.resources.max_model_len, 2**24)
    _check_positive(source, "resources.max_batch_tokens", dep.resources.max_batch_tokens, 2**24)
    _check_service_limits(dep, source)
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
        for key in ("decode_buckets", "prefill_token_buckets"):
            buckets = getattr(comp, key)
            if buckets is not None and (not buckets or min(buckets) < 1):
                raise DeploymentError(f"{source}: components.{name}.{key}: must be a non-empty list of integers >= 1")
            if buckets is not None:
                refuse_repeats(buckets, f"{source}: components.{name}.{key}")
        too_many = [b for b in comp.decode_buckets or () if b > dep.max_concurrent_requests]
        if too_many:
            raise DeploymentError(f"{source}: components.{name}.decode_buckets: {too_many} exceed "
                                  f"max_concurrent_requests ({dep.max_concurrent_requests}); no decode step has more "
                                  f"rows than that, so such a graph would never be captured or replayed")
        too_large = [b for b in comp.prefill_token_buckets or () if b > dep.resources.max_batch_tokens]
        if too_large:
            raise DeploymentError(f"{source}: components.{name}.prefill_token_buckets: {too_large} exceed "
                                  f"resources.max_batch_tokens ({dep.resources.max_batch_tokens}); no step packs more "
                                  f"tokens than that, so such a graph would be captured and never replayed")
        backends = ("auto", "triton", "triton_unfused", "torch", "torch_static", "flashinfer")
        if comp.attention_backend not in backends:
            raise DeploymentError(f"{source}: components.{name}.attention_backend: must be one of {list(backends)}, "
                                  f"got {comp.attention_backend!r}")
        if name not in family.graph.kv_holders:
            ignored = [key for key, unset in (("attention_backend", "auto"), ("decode_buckets", None),
                                              ("prefill_token_buckets", None), ("fused_ops", True),
                                              ("capture_sampling", True)) if getattr(comp, key) != unset]
            if ignored:
                raise DeploymentError(f"{source}: components.{name}.{ignored[0]}: {name} is not an autoregressive "
                                      f"component (those of {dep.family} are {family.graph.kv_holders}); it has no "
                                      f"paged attention, step buckets, fused decoder ops or sampling to set")
        elif comp.placement.device == "cpu" and comp.attention_backend in ("triton", "triton_unfused", "flashinfer"):
            raise DeploymentError(f"{source}: components.{name}.attention_backend: {comp.attention_backend!r} runs on "
                                  f"a GPU; a cpu placement takes 'auto', 'torch' or 'torch_static'")
        elif comp.cuda_graphs and comp.attention_backend == "torch":
            raise DeploymentError(f"{source}: components.{name}.attention_backend: 'torch' cannot be captured in a "
                                  f"CUDA graph (cuda_graphs: true); use 'auto', 'triton', 'torch_static' or "
                                  f"'flashinfer'")
        elif not comp.cuda_graphs and (comp.decode_buckets is not None or comp.prefill_token_buckets is not None):
            key = "decode_buckets" if comp.decode_buckets is not None else "prefill_token_buckets"
            raise DeploymentError(f"{source}: components.{name}.{key}: buckets are the captured CUDA graphs' sizes, "
                                  f"and cuda_graphs is off")
        if comp.attention_backend == "flashinfer" and dep.resources.kv_cache.dtype != "auto":
            raise DeploymentError(f"{source}: components.{name}.attention_backend: 'flashinfer' reads bf16/fp16 KV "
                                  f"pools only; resources.kv_cache.dtype {dep.resources.kv_cache.dtype!r} needs "
                                  f"'triton'")
    resolve_pool_size(dep, family.graph.kv_holders, source)
    _check_kv_pool_size(dep, source)
    family.validate_deployment(dep, source)


def check_kv_pool_holds_cap(dep: Deployment, source: str) -> None:
    """A paged pool must hold `max_concurrent_requests` requests of full length (no preemption), and one step's
    token budget must give every running request its decode token."""
    if dep.resources.max_batch_tokens < dep.max_concurrent_requests:
        raise DeploymentError(
            f"{source}: resources.max_batch_tokens: {dep.resources.max_batch_tokens} tokens a step cannot decode "
            f"max_concurrent_requests={dep.max_concurrent_requests} requests at once (one token each): need >= "
            f"{dep.max_concurrent_requests}")
    kv = dep.resources.kv_cache
    per_request = math.ceil(dep.resources.max_model_len / kv.page_size)
    needed = per_request * dep.max_concurrent_requests
    if kv.is_auto:
        return  # sized at start-up on the GPU, which refuses a pool that cannot hold the cap (engine/kv_sizing.py)
    if kv.num_pages < needed:
        raise DeploymentError(
            f"{source}: resources.kv_cache.num_pages: {kv.num_pages} pages cannot hold max_concurrent_requests="
            f"{dep.max_concurrent_requests} requests of max_model_len={dep.resources.max_model_len} tokens "
            f"({per_request} pages of {kv.page_size} tokens each): need >= {needed}"
        )


def resolve_pool_size(dep: Deployment, holders: list[str], source: str) -> None:
    """An unset `num_pages`: `auto` where every component holding a pool is on a GPU, else the pages the cap takes
    at full length, which is what a fixed pool must hold anyway (check_kv_pool_holds_cap). A family without a paged
    pool keeps it unset. Refusals say the value was the default's, not the user's."""
    kv = dep.resources.kv_cache
    placed = {name: dep.components[name].placement.device for name in holders if name in dep.components}
    if kv.num_pages is not None or not placed:
        return
    if all(device == "gpu" for device in placed.values()):
        kv.num_pages = NUM_PAGES_AUTO
        return
    if kv.gpu_memory_fraction is not None:
        on_cpu = next(name for name, device in placed.items() if device != "gpu")
        raise DeploymentError(f"{source}: resources.kv_cache.gpu_memory_fraction: sizes a pool of num_pages: auto, "
                              f"which components.{on_cpu} on the cpu cannot hold; give num_pages instead")
    pages = math.ceil(dep.resources.max_model_len / kv.page_size) * dep.max_concurrent_requests
    if pages > MAX_PAGES:
        raise DeploymentError(f"{source}: resources.kv_cache.num_pages: unset, so sized for max_concurrent_requests="
                              f"{dep.max_concurrent_requests} requests of max_model_len={dep.resources.max_model_len} "
                              f"tokens: {pages:,} pages, more than {MAX_PAGES:,}; lower those")
    kv.num_pages = pages


def _check_kv_pool_size(dep: Deployment, source: str) -> None:
    """`num_pages` is a count >= 1, or `auto` for pools on GPUs only; `gpu_memory_fraction` goes with `auto`."""
    from mstar_common.families.registry import get_family

    kv = dep.resources.kv_cache
    if kv.num_pages is None:
        return  # resolved once the placements are checked (resolve_pool_size), then checked here again
    if not kv.is_auto:
        _check_positive(source, "resources.kv_cache.num_pages", kv.num_pages, MAX_PAGES)
        if kv.gpu_memory_fraction is not None:
            raise DeploymentError(f"{source}: resources.kv_cache.gpu_memory_fraction: sizes a pool of num_pages: auto "
                                  f"only, and num_pages is {kv.num_pages}; drop one of the two")
        return
    fraction = kv.gpu_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        raise DeploymentError(f"{source}: resources.kv_cache.gpu_memory_fraction: must be in (0, 1], got {fraction}")
    try:
        holders = get_family(dep.family).graph.kv_holders
    except KeyError:
        return  # the unknown family is refused next, by name
    for name in holders:
        comp = dep.components.get(name)
        if comp is not None and comp.placement.device != "gpu":
            raise DeploymentError(f"{source}: resources.kv_cache.num_pages: auto sizes the pool from GPU memory, and "
                                  f"components.{name} holds it on the cpu; give a number of pages")


def _check_positive(source: str, key: str, value: int, high: int | None = None) -> None:
    """`value` >= 1, and <= `high` where given (a bound far past any real setting, below what would overflow a
    32-bit field in tritonserver, the kernels' page ids or a microsecond count)."""
    if value < 1:
        raise DeploymentError(f"{source}: {key}: must be >= 1, got {value}")
    if high is not None and value > high:
        raise DeploymentError(f"{source}: {key}: must be at most {high:,}, got {value:,}")


# upper bounds (see _check_positive)
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week
MAX_PAGES = 2**31 - 1  # page ids are int32 in the kernels' block tables
MAX_SHM_BYTES = 2**36  # 64 GiB; serve also checks a region against /dev/shm's size
MAX_GPU_ID = 1023  # far past any host; config.pbtxt holds GPU ids as int32


def _check_service_limits(dep: Deployment, source: str) -> None:
    adm, lim, srv = dep.admission, dep.limits, dep.server
    if adm.max_queue is not None and adm.max_queue < 0:
        raise DeploymentError(f"{source}: admission.max_queue: must be >= 0 (0: refuse past the cap), got "
                              f"{adm.max_queue}")
    if adm.max_queue is not None and adm.max_queue > 2**24:
        raise DeploymentError(f"{source}: admission.max_queue: must be at most {2**24:,}, got {adm.max_queue:,}")
    for key in ("queue_timeout_s", "request_timeout_s"):
        value = getattr(adm, key)
        if value is not None and not 0 < value <= MAX_TIMEOUT_S:
            raise DeploymentError(f"{source}: admission.{key}: must be a number of seconds in (0, {MAX_TIMEOUT_S:,}] "
                                  f"(a week), or null for no limit, got {value}")
    _check_positive(source, "admission.retry_after_s", adm.retry_after_s, MAX_TIMEOUT_S)
    _check_positive(source, "limits.max_body_bytes", lim.max_body_bytes, 2**34)
    if not 0 < lim.max_upload_s <= MAX_TIMEOUT_S:
        raise DeploymentError(f"{source}: limits.max_upload_s: must be a number of seconds in (0, {MAX_TIMEOUT_S:,}], "
                              f"got {lim.max_upload_s}")
    for key in ("shm_default_byte_size", "shm_growth_byte_size"):
        _check_positive(source, f"server.{key}", getattr(srv, key), MAX_SHM_BYTES)
    for key in ("stub_timeout_seconds", "drain_timeout_s"):
        _check_positive(source, f"server.{key}", getattr(srv, key), MAX_TIMEOUT_S)
    if srv.shm_default_byte_size < 1024 * 1024:
        raise DeploymentError(f"{source}: server.shm_default_byte_size: must be >= 1 MiB (1048576), got "
                              f"{srv.shm_default_byte_size}")
    ports = {key: getattr(srv, key) for key in ("proxy_port", "http_port", "grpc_port", "metrics_port")}
    for key, port in ports.items():
        if not 1 <= port <= 65535:
            raise DeploymentError(f"{source}: server.{key}: must be a TCP port in [1, 65535], got {port}")
    for key, port in ports.items():
        if other := next((k for k, p in ports.items() if p == port and k != key), None):
            raise DeploymentError(f"{source}: server.{other}: {port} is also server.{key}; each server needs a port "
                                  f"of its own")
    if not 1 <= srv.proxy_workers <= 64:
        raise DeploymentError(f"{source}: server.proxy_workers: must be in [1, 64], got {srv.proxy_workers}")
    if not 0 <= srv.keep_run_folders <= 10000:
        raise DeploymentError(f"{source}: server.keep_run_folders: must be in [0, 10000], got {srv.keep_run_folders}")
    if not 0 <= srv.max_restarts <= 1000:
        raise DeploymentError(f"{source}: server.max_restarts: must be in [0, 1000], got {srv.max_restarts}")


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
        if len(inner) == 1:
            return _coerce(inner[0], value, path)
        for alternative in inner:
            try:
                return _coerce(alternative, value, path)
            except DeploymentError:
                pass
        raise DeploymentError(f"{path}: expected {' or '.join(_describe(a) for a in inner)}, got {value!r}")
    if origin is Literal:
        if value not in args:
            raise DeploymentError(f"{path}: must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise DeploymentError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:  # as a null section (server: null) takes its defaults
            return {}
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
        try:
            return float(value)
        except OverflowError:  # an integer past any float (~1.8e308)
            raise DeploymentError(f"{path}: expected a number, got an integer too large for one") from None
    if tp is str:
        if not isinstance(value, str) or not value:
            raise DeploymentError(f"{path}: expected a non-empty string, got {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp} at {path}")


def refuse_repeats(values: list, where: str, what: str = "size") -> None:
    """A capture list names each graph once: a value given twice is refused (ENGINE.md 16.3), naming it."""
    if len(set(values)) < len(values):
        twice = sorted({v for v in values if values.count(v) > 1})
        raise DeploymentError(f"{where}: {twice} given more than once; each {what} is one captured graph, so list "
                              f"it once")


def is_finite_number(value: Any) -> bool:
    """An int or float that a float holds finitely: no bool, NaN, infinity or integer past ~1.8e308."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # math.isfinite converts an int to a float first
        return False


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))
