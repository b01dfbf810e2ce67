"""Triton node for a denoise-loop component (e.g. the FLUX.2 transformer): the whole loop runs inside.

I/O contract: the family's denoise tensors (flux2_klein: prompt_embeds, optional ref_tokens + ref_grid,
width, height, num_images, seed, num_inference_steps in; latents out); one FINAL response per request.

Threads: `execute` parses and enqueues (refusals answered at once). The denoise engine's loop batches every
running request of one token layout into each step, each row at its own step index, so a new request joins
the running batch on the next step; captured CUDA graphs serve the configured (size, batch) buckets. A
cancelled request leaves the batch at the next step.
"""

from __future__ import annotations

from backends.stateless_node import ComponentNode


class TritonPythonModel(ComponentNode):
    KIND = "denoise_loop"
