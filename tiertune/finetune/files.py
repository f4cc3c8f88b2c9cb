"""Durable writes for run outputs: what a reader finds is either the old state or the complete new one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush ``path``'s bytes to the disk (before it is renamed into place)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def move_files_into(src: Path, dst: Path, last: str | None = None) -> None:
    """Move every file of ``src`` into ``dst``, each fsynced first; ``last`` (the file whose presence marks
    the directory complete, e.g. an index or a config) is moved after all the others."""
    for path in sorted(src.iterdir(), key=lambda p: p.name == last):
        fsync_file(path)
        os.replace(path, dst / path.name)
