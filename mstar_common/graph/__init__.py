from mstar_common.graph.walk import (
    MODEL_DTYPE,
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
    "MODEL_DTYPE",
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
