"""Byte counts for people (``format_size``) and for alignment (``round_up``); code passes integers. A size a
user writes is read by ``settings.parse_size``."""

from __future__ import annotations


def format_size(nbytes: int | float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.50 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def format_seconds(seconds: float) -> str:
    """A short duration: 850 us, 12.3 ms, 1.25 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3g} s"
