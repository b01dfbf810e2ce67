"""The M* SDK: `from mstar import MStarClient`."""

from mstar_common.client import ChatEvent, ChatResult, MStarClient, MStarError

__all__ = ["ChatEvent", "ChatResult", "MStarClient", "MStarError"]
