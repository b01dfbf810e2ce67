# Generated; the node runtime lives in backends.ar_node.
from backends.ar_node import TritonPythonModel  # noqa: F401
