"""Runtimes of the diffusion components: a batching loop for stateless components, the denoise loop, and its
captured-graph buckets. Family-independent; the families supply the forward passes."""
