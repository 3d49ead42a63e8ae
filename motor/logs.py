"""Logging set-up shared by every motor process."""
from __future__ import annotations

import logging
import os


def setup_logging(level: str = "info") -> None:
    """Configure the root logger once: ``LEVEL name: message`` on stderr.

    ``MOTOR_LOG_LEVEL`` in the environment overrides ``level`` (used by
    ``motor up`` to pass one level to every child process).
    """
    level = os.environ.get("MOTOR_LOG_LEVEL", level)
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )
