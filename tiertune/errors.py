"""Typed errors a user can meet. Each message says what happened, what was expected and what to change."""

from __future__ import annotations

from tiertune.units import format_size


class TiertuneError(Exception):
    """Base class of every error tiertune raises on purpose."""


class ConfigError(TiertuneError, ValueError):
    """A setting is malformed or out of range."""


class DataError(TiertuneError, ValueError):
    """A dataset file or row is not what the recipe says it is."""


class BudgetError(TiertuneError, MemoryError):
    """A tier cannot hold what is asked of it, even after evicting everything it may evict."""

    def __init__(
        self, tier: str, needed: int, available: int, setting: str, detail: str = "", message: str = ""
    ) -> None:
        """``message``: the whole message, when the refusal is of several tiers at once (a run's plan)."""
        self.tier = tier
        self.needed = needed
        self.available = available
        self.setting = setting
        what = (
            f"free space on the filesystem of `{setting}` or point it at a larger disk"
            if setting == "offload.disk_path"
            else f"raise `{setting}`"
        )
        msg = (
            f"{tier} tier: needs {format_size(needed)} but only {format_size(available)} is available"
            f"{' (' + detail + ')' if detail else ''}; {what} or place less state on the {tier} tier"
        )
        super().__init__(message or msg)


class StateError(TiertuneError, RuntimeError):
    """An illegal chunk state transition or use of a closed store: a bug, never bad input."""


class RankError(TiertuneError, RuntimeError):
    """A collective of a multi-process run failed: another rank stopped (killed, or failed with its own
    error) or did not answer within the collective timeout. Every rank stops; the newest checkpoint is intact."""


class StorageError(TiertuneError, OSError):
    """The disk tier cannot be used: missing or unwritable directory, failed I/O."""


class DiskFullError(StorageError):
    """The disk tier's filesystem has no room left (ENOSPC) or its budget is exhausted."""


class IntegrityError(StorageError):
    """A chunk read back from disk is short or does not match its checksum."""


class ModelError(TiertuneError, ValueError):
    """A model directory or its weight files cannot be used: missing, corrupt, or of an unknown shape."""


class NonFiniteError(TiertuneError, ArithmeticError):
    """A training step's loss or gradient norm is not finite: the run stops before that step is saved or
    exported, so the newest checkpoint holds the last good state."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT (Ctrl-C) or SIGTERM after cleaning up: ``signal`` is the signal's number,
    ``step`` the last step completed, ``checkpoint`` the newest checkpoint (or None) and ``recipe`` the run
    directory's ``recipe.yaml`` (the resolved recipe to resume with)."""

    def __init__(self, signum: int, step: int, checkpoint: object, recipe: object) -> None:
        import signal as _signal

        self.signal = signum
        self.step = step
        self.checkpoint = checkpoint
        self.recipe = recipe
        name = _signal.Signals(signum).name
        where = f"the newest checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
        when = f"after step {step}" if step else "before its first step"
        super().__init__(f"stopped by {name} {when}; {where}")


class Signalled(KeyboardInterrupt):
    """SIGTERM (or SIGINT) turned into an exception on the main thread, so that a run stops through its
    clean-up instead of being killed where it stands (SIGTERM's default)."""

    def __init__(self, signum: int) -> None:
        import signal as _signal

        super().__init__(_signal.Signals(signum).name)
        self.signum = signum
