"""The wire tensors of the image families (the entry walk's are the proxy's image inputs, mstar_common/wire.py)
and the components every image family declares alike: the entry walk, and the text encoder (padded ids + real
length in, prompt embeddings out)."""

from mstar_common.graph import Component, TensorSpec

# walk (entry) wire tensors
PROMPT, WIDTH, HEIGHT, NUM_IMAGES, SEED, NUM_STEPS = "prompt", "width", "height", "num_images", "seed", \
    "num_inference_steps"
REFERENCE_IMAGES, OUTPUT_FORMAT, PNG_LEVEL, COMPRESSION = "reference_images", "output_format", "png_compress_level", \
    "output_compression"
IMAGES = "images"
# component wire tensors
INPUT_IDS, TEXT_LEN, PROMPT_EMBEDS, LATENTS, PIXELS = "input_ids", "text_len", "prompt_embeds", "latents", "pixels"
REF_TOKENS, REF_GRID = "ref_tokens", "ref_grid"  # reference-image conditioning (flux2_klein edits)

SIZE = (TensorSpec(WIDTH, "INT32"), TensorSpec(HEIGHT, "INT32"))

WALK = Component(
    "walk", "walk_router",
    inputs=(TensorSpec(PROMPT, "BYTES"), *SIZE, TensorSpec(NUM_IMAGES, "INT32"), TensorSpec(SEED, "INT64"),
            TensorSpec(NUM_STEPS, "INT32"), TensorSpec(REFERENCE_IMAGES, "BYTES", (-1,)),
            TensorSpec(OUTPUT_FORMAT, "BYTES"), TensorSpec(PNG_LEVEL, "INT32"), TensorSpec(COMPRESSION, "INT32")),
    outputs=(TensorSpec(IMAGES, "BYTES", (-1,)), TensorSpec(SEED, "INT64")),
)
TEXT_ENCODER = Component(
    "text_encoder", "stateless",
    inputs=(TensorSpec(INPUT_IDS, "INT32", (-1,)), TensorSpec(TEXT_LEN, "INT32")),
    outputs=(TensorSpec(PROMPT_EMBEDS, "FP32", (-1, -1)),),
)
