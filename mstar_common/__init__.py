"""M* on Triton: the library (importable without tritonserver or a GPU)."""

__version__ = "0.1.0"
