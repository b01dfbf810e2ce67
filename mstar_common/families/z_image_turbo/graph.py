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

from mstar_common.graph import Component, FamilyGraph, Loop, Sequential, Step, TensorSpec, Walk

# walk (entry) wire tensors: the proxy's image inputs (mstar_common/wire.py)
PROMPT, WIDTH, HEIGHT, NUM_IMAGES, SEED, NUM_STEPS = "prompt", "width", "height", "num_images", "seed", \
    "num_inference_steps"
REFERENCE_IMAGES, OUTPUT_FORMAT, PNG_LEVEL, COMPRESSION = "reference_images", "output_format", "png_compress_level", \
    "output_compression"
IMAGES = "images"
# component wire tensors
INPUT_IDS, TEXT_LEN, PROMPT_EMBEDS, LATENTS, PIXELS = "input_ids", "text_len", "prompt_embeds", "latents", "pixels"

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
DENOISE = Component(
    "denoise", "denoise_loop",
    inputs=(TensorSpec(PROMPT_EMBEDS, "FP32", (-1, -1)), *_SIZE, TensorSpec(NUM_IMAGES, "INT32"),
            TensorSpec(SEED, "INT64"), TensorSpec(NUM_STEPS, "INT32")),
    outputs=(TensorSpec(LATENTS, "FP32", (-1, -1, -1, -1)),),
)
VAE_DECODE = Component(
    "vae_decode", "stateless",
    inputs=(TensorSpec(LATENTS, "FP32", (-1, -1, -1, -1)), *_SIZE),
    outputs=(TensorSpec(PIXELS, "UINT8", (-1, -1, -1, 3)),),
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
