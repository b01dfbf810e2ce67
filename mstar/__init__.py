"""The M* SDK: `from mstar import MStarClient`."""

from mstar_common.client import (
    ChatEvent,
    ChatResult,
    EventStream,
    MStarClient,
    MStarConnectionError,
    MStarError,
    SpeechChunk,
    SpeechResult,
    TranscriptionEvent,
    TranscriptionResult,
)

__all__ = ["ChatEvent", "ChatResult", "EventStream", "MStarClient", "MStarConnectionError", "MStarError",
           "SpeechChunk", "SpeechResult", "TranscriptionEvent", "TranscriptionResult"]
