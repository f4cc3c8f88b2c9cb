"""Logging helpers any layer may use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held_back(name: str, level: int) -> Iterator[None]:
    """Logger ``name``'s messages below ``level`` held back for the block (its own level restored after)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
