"""Triton-language kernels: one op per file, each with a checked wrapper `<op>()` and a torch reference `<op>_ref()`.

Importing a module here imports `triton`; CPU-only code paths never do (the engine imports these lazily, on CUDA).
"""
