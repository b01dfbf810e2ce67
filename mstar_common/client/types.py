"""Results and errors the SDK returns."""

from __future__ import annotations

from dataclasses import dataclass, field


class MStarError(Exception):
    """An error response from the server: `status` is the HTTP status (400 client fault, 500 server fault)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"[{status}] {message}")
        self.status = status
        self.message = message


@dataclass(slots=True)
class ChatResult:
    text: str
    finish_reason: str
    usage: dict[str, int] = field(default_factory=dict)
    token_ids: list[int] | None = None  # only when return_token_ids=True


@dataclass(slots=True)
class ChatEvent:
    """One streamed event: new text (and tokens), or the last event with finish_reason and usage."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    usage: dict[str, int] | None = None
