"""Logging for the processes whose lines go to the server's log: a component's stub and its engine process. Each
line names the process it came from (`qwen3_llm_0_1`, `qwen3_llm_0_1 engine`), since the instances of a component
share that log."""

from __future__ import annotations

import logging


def configure_logging(name: str) -> None:
    """INFO logging to stderr with `name` on every line."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{name.replace('%', '%%')}] %(name)s: %(message)s")
