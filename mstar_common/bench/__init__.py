"""Serving benchmarks: closed-loop and Poisson workloads against Triton (gRPC streaming) or the OpenAI proxy,
an HF `generate` baseline on the same checkpoint, and the weight-streaming floor. `mstar bench` (`cli.py`;
`scripts/bench.py` from a checkout) drives it.
"""
