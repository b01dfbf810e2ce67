"""Orpheus text-to-speech: a Llama-3.2-3B LM that speaks in SNAC codes, and the SNAC 24 kHz decoder.

    client ──text, voice──▶ lm (prompt → prefill → decode loop inside the component; head over custom rows)
                             │ tokens → 7-code frames → 28-token windows (stride 7), per stream
                             │ ONE BLS request per step carrying every window ready in that step
                             ▼
                           snac (batched decode of all windows, CUDA graph per batch bucket on a GPU)
                             │ each window's played frame (2048 samples)
                             ▼
                           lm ──PCM chunks as soon as decoded──▶ client

The decode loop never leaves the LM component; the LM (`orpheus_lm`) is the entry model and owns the
walk: the stream edge to the codec is crossed per chunk and per step, never per token or per request.
"""

from mstar_common import wire
from mstar_common.families.orpheus.codes import WINDOW_FRAMES
from mstar_common.families.orpheus.lm import SPEECH_INPUTS, SPEECH_OUTPUTS
from mstar_common.families.orpheus.tokens import CODES_PER_FRAME
from mstar_common.graph import Component, FamilyGraph, Loop, Step, StreamEdge, TensorSpec, Walk

LM = Component("lm", "speech_lm", SPEECH_INPUTS, SPEECH_OUTPUTS, streams=True, holds_kv=True)
SNAC = Component(
    "snac", "codec",
    inputs=(TensorSpec(wire.CODEC_WINDOWS, "INT32", (-1, WINDOW_FRAMES, CODES_PER_FRAME), optional=False),),
    outputs=(TensorSpec(wire.CODEC_AUDIO, "FP32", (-1, -1)),),
    streams=True,
)

GRAPH = FamilyGraph(
    components={"lm": LM, "snac": SNAC},
    walks={
        "speech": Walk(
            "speech",
            StreamEdge(
                Loop(Step("lm"), until="end_of_speech | max_tokens"),
                Step("snac"),
                chunk="one 28-token window (4 frames, stride 7) per new frame; all streams' windows per step",
            ),
            entry="lm",
            description="text to 24 kHz speech, streamed",
        ),
    },
)
