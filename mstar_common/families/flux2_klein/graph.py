"""FLUX.2 [klein] text-to-image and multi-reference editing: a walk over four stateless components.

    client ─prompt, size, n, seed, reference images─▶ walk (entry; CPU: validate, tokenize, decode uploads)
        ├─▶ text_encoder  input_ids [512] + text_len ─▶ prompt_embeds [512, J]        (batched across requests)
        ├─▶ vae_encode    one reference image ─▶ ref_tokens [N_ref, C]                (batched per image size)
        ├─▶ denoise       the whole Euler loop inside the component ─▶ latents [n, N, C]
        │                 (every step batched across requests of one token layout, each row at its own step)
        └─▶ vae_decode    latents ─▶ uint8 RGB [n, H, W, 3]                            (batched per output size)
                          (model_kwargs.vae_in_denoise: the denoise component decodes, answers pixels)
    walk ─PNG/JPEG/WebP bytes [n] + the seed used─▶ client

The walk makes one async BLS call per component per request: each hop carries a whole prompt or image
(~1 ms against ~100s of ms of work), while every component batches across the concurrent requests.
The denoise loop never leaves its component.
"""

from mstar_common.diffusion import image_graph as w
from mstar_common.diffusion.image_graph import TEXT_ENCODER, WALK
from mstar_common.graph import MODEL_DTYPE, Component, FamilyGraph, Loop, Parallel, Sequential, Step, TensorSpec, Walk

# The wire tensors (w.*) and the walk and text encoder components are shared by the image families.

VAE_ENCODE = Component(
    "vae_encode", "stateless",
    inputs=(TensorSpec(w.PIXELS, "UINT8", (-1, -1, 3)),),
    outputs=(TensorSpec(w.REF_TOKENS, MODEL_DTYPE, (-1, -1)), TensorSpec(w.REF_GRID, "INT32", (2,))),
)
DENOISE = Component(
    "denoise", "denoise_loop",
    inputs=(TensorSpec(w.PROMPT_EMBEDS, MODEL_DTYPE, (-1, -1)), TensorSpec(w.REF_TOKENS, MODEL_DTYPE, (-1, -1)),
            TensorSpec(w.REF_GRID, "INT32", (-1, 2)), *w.SIZE, TensorSpec(w.NUM_IMAGES, "INT32"),
            TensorSpec(w.SEED, "INT64"), TensorSpec(w.NUM_STEPS, "INT32"), TensorSpec(w.WANT_PNG_ROWS, "INT32")),
    # latents for the vae_decode hop; with model_kwargs.vae_in_denoise (the decode in this process) pixels or,
    # asked with want_png_rows, PNG rows
    outputs=(TensorSpec(w.LATENTS, MODEL_DTYPE, (-1, -1, -1)), *w.DECODED),
)
VAE_DECODE = Component(
    "vae_decode", "stateless",
    inputs=(TensorSpec(w.LATENTS, MODEL_DTYPE, (-1, -1, -1)), *w.SIZE, TensorSpec(w.WANT_PNG_ROWS, "INT32")),
    outputs=w.DECODED,
)

GRAPH = FamilyGraph(
    components={c.name: c for c in (WALK, TEXT_ENCODER, VAE_ENCODE, DENOISE, VAE_DECODE)},
    walks={
        "generate": Walk(
            "generate",
            Sequential((
                Step("walk"),
                Parallel((Step("text_encoder"), Step("vae_encode"))),
                Loop(Step("denoise"), until="num_inference_steps Euler steps"),
                Step("vae_decode"),
            )),
            entry="walk",
            description="text-to-image, and editing with up to four reference images",
        ),
    },
)
