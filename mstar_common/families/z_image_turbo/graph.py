"""Z-Image-Turbo text-to-image: a walk over three stateless components.

    client ─prompt, size, n, seed─▶ walk (entry; CPU: validate, tokenize with the chat template)
        ├─▶ text_encoder  input_ids [512] + text_len ─▶ prompt_embeds [text_len, 2560]  (Qwen3-4B, second-to-last
        │                 hidden state of the real tokens; batched across requests)
        ├─▶ denoise       caption refiner once, then the whole Euler loop inside the component ─▶ latents
        │                 [n, 16, H/8, W/8] (every step batched across requests of one layout, each row at its own step)
        └─▶ vae_decode    latents ─▶ uint8 RGB [n, H, W, 3]  (FLUX.1 VAE; batched per output size)
    walk ─PNG/JPEG/WebP bytes [n] + the seed used─▶ client

No reference-image conditioning: a request carrying reference images (/v1/images/edits) is refused by the walk.
"""

from mstar_common.diffusion import image_graph as w
from mstar_common.diffusion.image_graph import TEXT_ENCODER, WALK
from mstar_common.graph import MODEL_DTYPE, Component, FamilyGraph, Loop, Sequential, Step, TensorSpec, Walk

# The wire tensors (w.*) and the walk and text encoder components are shared by the image families.

DENOISE = Component(
    "denoise", "denoise_loop",
    inputs=(TensorSpec(w.PROMPT_EMBEDS, MODEL_DTYPE, (-1, -1)), *w.SIZE, TensorSpec(w.NUM_IMAGES, "INT32"),
            TensorSpec(w.SEED, "INT64"), TensorSpec(w.NUM_STEPS, "INT32"), TensorSpec(w.WANT_PNG_ROWS, "INT32")),
    # latents for the vae_decode hop; with model_kwargs.vae_in_denoise (the decode in this process) pixels or,
    # asked with want_png_rows, PNG rows
    outputs=(TensorSpec(w.LATENTS, MODEL_DTYPE, (-1, -1, -1, -1)), *w.DECODED),
)
VAE_DECODE = Component(
    "vae_decode", "stateless",
    inputs=(TensorSpec(w.LATENTS, MODEL_DTYPE, (-1, -1, -1, -1)), *w.SIZE, TensorSpec(w.WANT_PNG_ROWS, "INT32")),
    outputs=w.DECODED,
)

GRAPH = FamilyGraph(
    components={c.name: c for c in (WALK, TEXT_ENCODER, DENOISE, VAE_DECODE)},
    walks={
        "generate": Walk(
            "generate",
            Sequential((
                Step("walk"),
                Step("text_encoder"),
                Loop(Step("denoise"), until="num_inference_steps Euler steps"),
                Step("vae_decode"),
            )),
            entry="walk",
            description="text-to-image (no reference images)",
        ),
    },
)
