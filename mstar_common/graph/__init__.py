from mstar_common.graph.walk import (
    Component,
    FamilyGraph,
    Loop,
    Parallel,
    Sequential,
    Step,
    StreamEdge,
    TensorSpec,
    Walk,
    components_in,
    is_static_dag,
)

__all__ = [
    "Component",
    "FamilyGraph",
    "Loop",
    "Parallel",
    "Sequential",
    "Step",
    "StreamEdge",
    "TensorSpec",
    "Walk",
    "components_in",
    "is_static_dag",
]
