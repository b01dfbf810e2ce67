"""The M* SDK: `from mstar import MStarClient`."""

from mstar_common.client import ChatEvent, ChatResult, MStarClient, MStarError, TranscriptionEvent, TranscriptionResult

__all__ = ["ChatEvent", "ChatResult", "MStarClient", "MStarError", "TranscriptionEvent", "TranscriptionResult"]
