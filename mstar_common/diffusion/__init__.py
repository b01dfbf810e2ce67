"""Runtimes of the diffusion components: a batching loop for stateless components, the denoise loop, and its
captured-graph buckets. Family-independent; the families supply the forward passes. The `image_*` modules,
`diffusers_checkpoint` and `tiny_checkpoint` hold what the image families (flux2_klein, z_image_turbo) share."""
