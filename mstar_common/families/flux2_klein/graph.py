"""FLUX.2 [klein] text-to-image and multi-reference editing: a walk over four stateless components.

    client ─prompt, size, n, seed, reference images─▶ walk (entry; CPU: validate, tokenize, decode uploads)
        ├─▶ text_encoder  input_ids [512] + text_len ─▶ prompt_embeds [512, J]        (batched across requests)
        ├─▶ vae_encode    one reference image ─▶ ref_tokens [N_ref, C]                (batched per image size)
        ├─▶ denoise       the whole Euler loop inside the component ─▶ latents [n, N, C]
        │                 (every step batched across requests of one token layout, each row at its own step)
        └─▶ vae_decode    latents ─▶ uint8 RGB [n, H, W, 3]                            (batched per output size)
    walk ─PNG/JPEG/WebP bytes [n] + the seed used─▶ client

The walk makes one async BLS call per component per request: each hop carries a whole prompt or image
(~1 ms against ~100s of ms of work), while every component batches across the concurrent requests.
The denoise loop never leaves its component.
"""

from mstar_common.graph import Component, FamilyGraph, Loop, Parallel, Sequential, Step, TensorSpec, Walk

# walk (entry) wire tensors
PROMPT, WIDTH, HEIGHT, NUM_IMAGES, SEED, NUM_STEPS = "prompt", "width", "height", "num_images", "seed", \
    "num_inference_steps"
REFERENCE_IMAGES, OUTPUT_FORMAT, PNG_LEVEL, COMPRESSION = "reference_images", "output_format", "png_compress_level", \
    "output_compression"
IMAGES = "images"
# component wire tensors
INPUT_IDS, TEXT_LEN, PROMPT_EMBEDS = "input_ids", "text_len", "prompt_embeds"
PIXELS, REF_TOKENS, REF_GRID, LATENTS = "pixels", "ref_tokens", "ref_grid", "latents"

_SIZE = (TensorSpec(WIDTH, "INT32"), TensorSpec(HEIGHT, "INT32"))

WALK = Component(
    "walk", "walk_router",
    inputs=(TensorSpec(PROMPT, "BYTES"), *_SIZE, TensorSpec(NUM_IMAGES, "INT32"), TensorSpec(SEED, "INT64"),
            TensorSpec(NUM_STEPS, "INT32"), TensorSpec(REFERENCE_IMAGES, "BYTES", (-1,)),
            TensorSpec(OUTPUT_FORMAT, "BYTES"), TensorSpec(PNG_LEVEL, "INT32"), TensorSpec(COMPRESSION, "INT32")),
    outputs=(TensorSpec(IMAGES, "BYTES", (-1,)), TensorSpec(SEED, "INT64")),
)
TEXT_ENCODER = Component(
    "text_encoder", "stateless",
    inputs=(TensorSpec(INPUT_IDS, "INT32", (-1,)), TensorSpec(TEXT_LEN, "INT32")),
    outputs=(TensorSpec(PROMPT_EMBEDS, "FP32", (-1, -1)),),
)
VAE_ENCODE = Component(
    "vae_encode", "stateless",
    inputs=(TensorSpec(PIXELS, "UINT8", (-1, -1, 3)),),
    outputs=(TensorSpec(REF_TOKENS, "FP32", (-1, -1)), TensorSpec(REF_GRID, "INT32", (2,))),
)
DENOISE = Component(
    "denoise", "denoise_loop",
    inputs=(TensorSpec(PROMPT_EMBEDS, "FP32", (-1, -1)), TensorSpec(REF_TOKENS, "FP32", (-1, -1)),
            TensorSpec(REF_GRID, "INT32", (-1, 2)), *_SIZE, TensorSpec(NUM_IMAGES, "INT32"),
            TensorSpec(SEED, "INT64"), TensorSpec(NUM_STEPS, "INT32")),
    outputs=(TensorSpec(LATENTS, "FP32", (-1, -1, -1)),),
)
VAE_DECODE = Component(
    "vae_decode", "stateless",
    inputs=(TensorSpec(LATENTS, "FP32", (-1, -1, -1)), *_SIZE),
    outputs=(TensorSpec(PIXELS, "UINT8", (-1, -1, -1, 3)),),
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
