"""The wire tensors of the image families (the entry walk's are the proxy's image inputs, mstar_common/wire.py)
and the components every image family declares alike: the entry walk, and the text encoder (padded ids + real
length in, prompt embeddings out)."""

from mstar_common.graph import MODEL_DTYPE, Component, TensorSpec

# walk (entry) wire tensors
PROMPT, WIDTH, HEIGHT, NUM_IMAGES, SEED, NUM_STEPS = "prompt", "width", "height", "num_images", "seed", \
    "num_inference_steps"
REFERENCE_IMAGES, OUTPUT_FORMAT, PNG_LEVEL, COMPRESSION = "reference_images", "output_format", "png_compress_level", \
    "output_compression"
IMAGES = "images"
# component wire tensors
INPUT_IDS, TEXT_LEN, PROMPT_EMBEDS, LATENTS, PIXELS = "input_ids", "text_len", "prompt_embeds", "latents", "pixels"
REF_TOKENS, REF_GRID = "ref_tokens", "ref_grid"  # reference-image conditioning (flux2_klein edits)
# The decoders' answer for a PNG: want_png_rows = 1 asks for png_rows (Paeth-filtered scanlines [n, H, 1 + 3W],
# filtered on the device: mstar_common/diffusion/png.py) instead of pixels; the walk then only deflates them.
PNG_ROWS, WANT_PNG_ROWS = "png_rows", "want_png_rows"
DECODED = (TensorSpec(PIXELS, "UINT8", (-1, -1, -1, 3)), TensorSpec(PNG_ROWS, "UINT8", (-1, -1, -1)))

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
    outputs=(TensorSpec(PROMPT_EMBEDS, MODEL_DTYPE, (-1, -1)),),
)
