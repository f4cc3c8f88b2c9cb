"""Stopping a run on SIGINT (Ctrl-C) and SIGTERM (what schedulers send) through its clean-up.

While a command runs (``stop_on_signals``), both signals become ``Signalled`` on the main thread, so the run
unwinds as from Ctrl-C: the checkpoint being written is completed within seconds or dropped (the newest
complete one stays), the offload files are removed, and the user is told where it stopped and how to resume
(SIGTERM's default would kill the process where it stands).

Where they are raised:

- While training (``at_safe_points``), a signal is only recorded, and ``check`` raises it at the next safe
  point: a step boundary, or the start of a decoder layer's forward or backward (the engine's
  ``safe_point``), where no chunk is half acquired. Raised anywhere else, it could land between a chunk's
  acquire and the ``try`` that releases it, and the clean-up would then wait forever for that chunk.
- Otherwise (loading, checking, exporting) it is raised at once. One that lands in a finalizer (a ``__del__``
  run by the garbage collector) cannot be: Python would print "Exception ignored" and go on. It stays
  recorded for ``check``, and the ignored exception is not printed.
- During the clean-up (``deferred``) further signals are noted, not raised, so a second Ctrl-C does not cut
  it short (``kill -9`` still does; the next run then removes what was left).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from tiertune.errors import Signalled

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignals:
    """The run's signal handling: ``stop.check()`` at each safe point, ``stop.deferred()`` for the clean-up.
    Made by ``stop_on_signals``."""

    def __init__(self) -> None:
        self.requested: int | None = None
        self.raised: int | None = None  # the signal raised as ``Signalled`` (the run is stopping for it)
        self._at_safe_points = False
        self._installed = False
        self._previous: dict[int, Any] = {}
        self._previous_hook: Any = None

    def install(self) -> None:
        """Take over SIGINT, SIGTERM and the hook for ignored exceptions (main thread only: elsewhere Python
        cannot install handlers, the signals keep theirs and ``check`` does nothing)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._raise) for s in SIGNALS}
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable
            self._installed = True

    def uninstall(self) -> None:
        """Give SIGINT, SIGTERM and the hook back."""
        if self._installed:
            for s, handler in self._previous.items():
                signal.signal(s, handler)
            sys.unraisablehook = self._previous_hook
            self._installed = False

    def check(self) -> None:
        """Raise the signal that arrived where it could not be raised (at a step boundary, say)."""
        if self.requested is not None:
            signum, self.requested = self.requested, None
            self.raised = signum
            raise Signalled(signum)

    @contextlib.contextmanager
    def at_safe_points(self) -> Iterator[None]:
        """Record signals in the block instead of raising them; ``check`` raises them (training)."""
        self._at_safe_points = True
        try:
            yield
        finally:
            self._at_safe_points = False

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Note further signals instead of raising them (the clean-up after a stop)."""
        if not self._installed:
            yield
            return
        previous = {s: signal.signal(s, self._note) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _raise(self, signum: int, frame: object) -> None:
        self.requested = signum  # for ``check``, should the exception be swallowed (a finalizer)
        if not self._at_safe_points:
            self.raised = signum
            raise Signalled(signum)

    def _unraisable(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Signalled):
            return  # swallowed in a finalizer: still pending, raised by ``check``
        self._previous_hook(unraisable)

    def _note(self, signum: int, frame: object) -> None:
        if self.raised is None and self.requested is None:
            # the first, while the run stops for another reason (another rank's stop): said as the stop's cause
            self.requested = signum
            return
        print(
            f"tiertune: {signal.Signals(signum).name} received again; completing (within seconds) or dropping "
            "the checkpoint being written and removing the offload files (kill -9 stops at once; the next run "
            "cleans up)",
            file=sys.stderr,
            flush=True,
        )


_active: list[StopOnSignals] = []  # the one in force, when there is one


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopOnSignals]:
    """Signals as ``Signalled`` for the block. Nested blocks (a command, then the run it starts) share one
    ``StopOnSignals``, so a signal swallowed while the command loads is raised by the run's ``check``."""
    if _active:
        yield _active[0]
        return
    stop = StopOnSignals()
    stop.install()
    _active.append(stop)
    try:
        yield stop
    finally:
        _active.clear()
        stop.uninstall()
