"""Whisper speech recognition (WhisperForConditionalGeneration, tiny … large-v3): a walk over two components.

    client ─audio file (or PCM) + language, task, prompt, temperature, timestamps─▶ walk (entry; CPU)
        decode (libsndfile; FFmpeg for MP4/M4A, WebM), downmix, resample to 16 kHz, check the caps; cut uploads
        over 30 s into windows at quiet moments (≤ 30 s each)
        per window, all windows at once:
        ├─▶ encoder   PCM ≤ 30 s ─▶ log-mel [n_mels, 3000] ─▶ encoder_output [1500, d]
        │             (front end + encoder on the device, batched across every waiting window; CUDA graphs
        │              per batch bucket on the GPU)
        └─▶ decoder   encoder_output + prompt ids ─▶ streamed token ids
                      (AREngine: paged self-attention KV, continuous batching; the request's cross-attention
                       K/V is written once into a slot at admission; Whisper's token rules run per step
                       inside the engine, so the decode loop never leaves the component)
    walk ─text deltas (window order), then language, duration, segments─▶ client

Hops per window: one encoder call and one decoder stream, never per token. Language detection: without a
`language`, window 0's decoder picks it in its first step (argmax over language tokens, as transformers'
`detect_language` does for the first 30 s) and the other windows' decoders start forced to it, so every
window of an upload is transcribed in one language. Windows decode in parallel; the walk streams window 0's
text as it comes and each later window's once the windows before it are done.
"""

from mstar_common.families.text import TEXT_LM_OUTPUTS
from mstar_common.graph import Component, FamilyGraph, Loop, Sequential, Step, TensorSpec, Walk

# walk (entry) wire tensors: inputs
AUDIO = "audio"  # BYTES [1]: an encoded audio file (audio.decode_upload: WAV, FLAC, OGG, MP3, MP4/M4A, WebM, ...)
AUDIO_PCM = "audio_pcm"  # FP32 [-1]: mono samples in [-1, 1] (instead of `audio`)
SAMPLE_RATE = "sample_rate"  # INT32 [1]: Hz of audio_pcm
LANGUAGE = "language"  # BYTES [1]: ISO-639-1 code or English name; absent: detected
TASK = "task"  # BYTES [1]: transcribe | translate (to English)
PROMPT = "prompt"  # BYTES [1]: initial prompt (vocabulary, style) for every window
TEMPERATURE = "temperature"  # FP32 [1]: 0 = greedy; absent: 0 (with fallback when timestamps are on)
TIMESTAMPS = "timestamps"  # BOOL [1]: decode timestamp tokens and return timed segments
MAX_TOKENS = "max_tokens"  # INT32 [1]: text tokens per window (default: what the decoder window leaves)
SEED = "seed"  # INT64 [1]
# walk outputs (streamed; the metadata rides on the last response)
TEXT_OUTPUT = "text_output"  # BYTES [1]: new text since the previous response
FINISH_REASON = "finish_reason"  # BYTES [1]: "" until the last response, then "stop" | "length"
DETECTED_LANGUAGE = "language"  # BYTES [1]: the language code used (last response)
DURATION = "duration"  # FP32 [1]: seconds of audio (last response)
SEGMENTS = "segments"  # BYTES [1]: JSON list of {id, start, end, text, tokens, temperature, ...} (last response)
COMPLETION_TOKENS = "completion_tokens"  # INT32 [1]: text tokens so far
# component wire tensors
ENCODER_OUTPUT = "encoder_output"  # FP32 [1500, d_model]
INPUT_IDS = "input_ids"  # INT32 [-1]: decoder prompt
FORCED_IDS = "forced_ids"  # INT32 [-1]: tokens forced after the prompt; -1 = the model's language choice
# decoder outputs beside the text LM's (last response): OpenAI Whisper's window scores, NaN where not computed
AVG_LOGPROB = "avg_logprob"  # FP32 [1]: the free tokens' mean log-probability (their sum over their count + 1)
NO_SPEECH_PROB = "no_speech_prob"  # FP32 [1]: P(<|nospeech|>) at <|startoftranscript|>

WALK = Component(
    "walk", "walk_router",
    inputs=(TensorSpec(AUDIO, "BYTES"), TensorSpec(AUDIO_PCM, "FP32", (-1,)), TensorSpec(SAMPLE_RATE, "INT32"),
            TensorSpec(LANGUAGE, "BYTES"), TensorSpec(TASK, "BYTES"), TensorSpec(PROMPT, "BYTES"),
            TensorSpec(TEMPERATURE, "FP32"), TensorSpec(TIMESTAMPS, "BOOL"), TensorSpec(MAX_TOKENS, "INT32"),
            TensorSpec(SEED, "INT64")),
    outputs=(TensorSpec(TEXT_OUTPUT, "BYTES"), TensorSpec(FINISH_REASON, "BYTES"),
             TensorSpec(DETECTED_LANGUAGE, "BYTES"), TensorSpec(DURATION, "FP32"), TensorSpec(SEGMENTS, "BYTES"),
             TensorSpec(COMPLETION_TOKENS, "INT32")),
)
ENCODER = Component(
    "encoder", "stateless",
    inputs=(TensorSpec(AUDIO_PCM, "FP32", (-1,)),),
    outputs=(TensorSpec(ENCODER_OUTPUT, "FP32", (-1, -1)),),
)
DECODER = Component(
    "decoder", "autoregressive",
    inputs=(TensorSpec(ENCODER_OUTPUT, "FP32", (-1, -1)), TensorSpec(INPUT_IDS, "INT32", (-1,)),
            TensorSpec(FORCED_IDS, "INT32", (-1,)), TensorSpec(TIMESTAMPS, "BOOL"),
            TensorSpec(MAX_TOKENS, "INT32"), TensorSpec(TEMPERATURE, "FP32"), TensorSpec(SEED, "INT64")),
    outputs=(*TEXT_LM_OUTPUTS, TensorSpec(AVG_LOGPROB, "FP32"), TensorSpec(NO_SPEECH_PROB, "FP32")),
    holds_kv=True,
)

GRAPH = FamilyGraph(
    components={c.name: c for c in (WALK, ENCODER, DECODER)},
    walks={
        "transcribe": Walk(
            "transcribe",
            Sequential((
                Step("walk"),
                Step("encoder"),
                Loop(Step("decoder"), until="<|endoftext|> | max_tokens | the decoder's position limit"),
            )),
            entry="walk",
            description="transcription and translation; per window (≤ 30 s) one encoder call and one decoder "
                        "stream, windows in parallel",
        ),
    },
)
