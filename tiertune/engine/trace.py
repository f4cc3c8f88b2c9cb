"""What a replayed step did, in order, for the estimate's timeline (``estimates.timeline``).

A ledger replay (``engine.replay``) runs the engine's own step over no bytes; a ``Trace`` attached to it records
what each thread of a run would do, in the order it would do it, with the sizes that price it:

- the compute thread's script: each decoder layer's forward and backward, and the head and loss, with their
  token positions (``Ledger``); the host-side arithmetic it runs itself (a gradient's copy into its host
  chunk: bytes); the optimizer's units it submits, and where it waits for them (``drain``, ``join``);
- each optimizer unit's script (``OptimizerWorker``, inline on a ledger: the i-th script is the i-th unit
  submitted): its AdamW (parameters), copies (bytes), and the chunks it uses;
- the store's transfers (``start``: chunk, link, bytes) and the uses that wait for them (``use``: a chunk
  acquired), on whichever script is running.

The trace prices nothing: it is the step's schedule, which ``estimates.timeline`` plays against a rate per
resource. Op tuples, first item the kind:

``("layer", tokens, "forward" | "backward")``, ``("head", tokens, "loss" | "distill" | "logps")``,
``("run", "adamw" | "copy" | "read", elements, bytes)`` (a read: a norm taken over a gradient), ``("start", chunk_id, link, bytes)``, ``("use", chunk_id)``,
``("submit",)``, ``("submit", "after")`` (a unit that runs after the background pieces queued before it),
``("submit", "background", k)`` (k background pieces: the next k scripts, run when no unit is queued),
``("drain", limit)``, ``("join",)``, ``("tail",)`` (backward done: units starting from here may use the compute
thread's cores), ``("step",)`` (a step begins; on the compute script only).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

Op = tuple
"""One recorded operation (see the module docstring)."""


class Trace:
    """The recorded scripts of a replay: the compute thread's (``compute``) and each optimizer unit's
    (``units``, in the order they were submitted)."""

    def __init__(self) -> None:
        self.compute: list[Op] = []
        self.units: list[list[Op]] = []
        self._current: list[Op] = self.compute

    def op(self, *op: object) -> None:
        """Record ``op`` on the script running now (a unit's inside ``unit``, else the compute thread's)."""
        self._current.append(op)

    @contextmanager
    def unit(self) -> Iterator[None]:
        """Record the block as the next optimizer unit's script (units run in the order submitted)."""
        outer, self._current = self._current, []
        self.units.append(self._current)
        try:
            yield
        finally:
            self._current = outer


__all__ = ["Op", "Trace"]
