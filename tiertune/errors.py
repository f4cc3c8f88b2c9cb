"""Typed errors a user can meet. Each message says what happened, what was expected and what to change."""

from __future__ import annotations


class TiertuneError(Exception):
    """Base class of every error tiertune raises on purpose."""


class ConfigError(TiertuneError, ValueError):
    """A setting is malformed or out of range."""


class DataError(TiertuneError, ValueError):
    """A dataset file or row is not what the recipe says it is."""


class BudgetError(TiertuneError, MemoryError):
    """A tier cannot hold what is asked of it, even after evicting everything it may evict."""

    def __init__(self, tier: str, needed: int, available: int, setting: str, detail: str = "") -> None:
        from tiertune.units import format_size

        self.tier = tier
        self.needed = needed
        self.available = available
        self.setting = setting
        msg = (
            f"{tier} tier: needs {format_size(needed)} but only {format_size(available)} is available"
            f"{' (' + detail + ')' if detail else ''}; raise `{setting}` or place less state on the {tier} tier"
        )
        super().__init__(msg)


class StateError(TiertuneError, RuntimeError):
    """An illegal chunk state transition or use of a closed store: a bug, never bad input."""


class StorageError(TiertuneError, OSError):
    """The disk tier cannot be used: missing or unwritable directory, failed I/O."""


class DiskFullError(StorageError):
    """The disk tier's filesystem has no room left (ENOSPC) or its budget is exhausted."""


class IntegrityError(StorageError):
    """A chunk read back from disk is short or does not match its checksum."""


class ModelError(TiertuneError, ValueError):
    """A model directory or its weight files cannot be used: missing, corrupt, or of an unknown shape."""
