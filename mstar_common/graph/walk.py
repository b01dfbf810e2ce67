"""Walk primitives: a family declares its components once and the walks requests take over them.

Four primitives express a walk (spec/ENGINE.md §4.1): Sequential (one after another), Parallel (side by
side), Loop (a component iterated, e.g. a decode loop that runs *inside* its component) and StreamEdge
(chunks flow from a producer to a consumer while the producer runs). The repository generator reads
these declarations: which components exist, which stream (decoupled Triton models), which walk a client
enters where, and which walks are static DAGs that a Triton ensemble can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

ComponentKind = Literal["autoregressive", "speech_lm", "stateless", "denoise_loop", "codec", "walk_router"]


MODEL_DTYPE = "MODEL"  # a TensorSpec dtype: the activations' dtype, which the deployment decides (Family.wire_dtype)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # Triton dtype name without the TYPE_ prefix: BYTES, INT32, FP32, ..., or MODEL_DTYPE
    dims: tuple[int, ...] = (1,)
    optional: bool = True


@dataclass(frozen=True, slots=True)
class Component:
    """One Triton Python-backend model: weights, resources and a step loop of its own."""

    name: str
    kind: ComponentKind
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    streams: bool = True  # decoupled: any number of responses per request
    holds_kv: bool = False  # owns a paged KV pool (sized by resources.kv_cache)


@dataclass(frozen=True, slots=True)
class Step:
    component: str


@dataclass(frozen=True, slots=True)
class Sequential:
    steps: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Parallel:
    branches: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Loop:
    """`body` iterated until a stop condition; the iteration runs inside the body's component."""

    body: Node
    until: str  # e.g. "eos | stop | max_tokens"


@dataclass(frozen=True, slots=True)
class StreamEdge:
    """Chunks from `producer` to `consumer` while the producer runs (never per token: per chunk, per step)."""

    producer: Node
    consumer: Node
    chunk: str  # the chunk policy, e.g. "28 tokens, stride 7"


Node = Step | Sequential | Parallel | Loop | StreamEdge


@dataclass(frozen=True, slots=True)
class Walk:
    name: str
    body: Node
    entry: str  # the component (or, for ensembles, the walk's Triton model) clients send requests to
    description: str = ""


@dataclass(frozen=True, slots=True)
class FamilyGraph:
    components: dict[str, Component]
    walks: dict[str, Walk] = field(default_factory=dict)

    @property
    def kv_holders(self) -> list[str]:
        """The components that own a paged KV pool (sized by `resources.kv_cache`)."""
        return [c.name for c in self.components.values() if c.holds_kv]

    def __post_init__(self) -> None:
        for name, comp in self.components.items():
            if comp.name != name:
                raise ValueError(f"component key {name!r} != component name {comp.name!r}")
        used: set[str] = set()
        for walk in self.walks.values():
            names = set(components_in(walk.body))
            if unknown := sorted(names - set(self.components)):
                raise ValueError(f"walk {walk.name!r} uses undeclared components {unknown}")
            if walk.entry not in names:
                raise ValueError(f"walk {walk.name!r} enters at {walk.entry!r}, which it does not visit")
            used |= names
        if unused := sorted(set(self.components) - used):
            raise ValueError(f"components {unused} are on no walk")


def components_in(node: Node) -> Iterator[str]:
    match node:
        case Step(component):
            yield component
        case Sequential(children) | Parallel(children):
            for child in children:
                yield from components_in(child)
        case Loop(body, _):
            yield from components_in(body)
        case StreamEdge(producer, consumer, _):
            yield from components_in(producer)
            yield from components_in(consumer)
        case _:
            raise TypeError(f"not a walk node: {node!r}")


def is_static_dag(node: Node) -> bool:
    """True when Triton's ensemble scheduler can run the walk: no loops, no streaming edges."""
    match node:
        case Step():
            return True
        case Sequential(children) | Parallel(children):
            return all(is_static_dag(c) for c in children)
        case _:
            return False
