"""Python SDK for the M* proxy: `MStarClient("http://localhost:8000").chat("Hi").text`."""

from mstar_common.client.client import MStarClient
from mstar_common.client.speech import SpeechChunk, SpeechResult
from mstar_common.client.transcription import TranscriptionEvent, TranscriptionResult
from mstar_common.client.types import ChatEvent, ChatResult, EventStream, MStarConnectionError, MStarError

__all__ = ["ChatEvent", "ChatResult", "EventStream", "MStarClient", "MStarConnectionError", "MStarError",
           "SpeechChunk", "SpeechResult", "TranscriptionEvent", "TranscriptionResult"]
