"""Human-readable byte sizes, used only at the edges (config, logs); code passes integers."""

from __future__ import annotations

import re

from tiertune.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, setting: str = "size") -> int:
    """Parse ``512KiB``, ``20GiB``, ``1.5GB`` or a plain byte count into bytes.

    Raises ConfigError naming ``setting`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{setting}: expected a size like '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{setting}: a size cannot be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{setting}: cannot read {value!r} as a size; write a number with a unit "
            f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '20GiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
