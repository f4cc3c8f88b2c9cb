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


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: written to a temporary name beside it, fsynced, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    fsync_file(tmp)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (after files were renamed into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def nearest_existing(path: str | os.PathLike[str]) -> str:
    """``path`` or, when it does not exist yet, its nearest existing parent (where it would be created)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)
