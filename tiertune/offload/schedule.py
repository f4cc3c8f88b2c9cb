"""The scheduler: learns the order in which chunks are used, then prefetches along it and evicts by it.

Training repeats the same access order every step. During a warm-up step the scheduler *records* each
access (chunk, tier); at the step boundary (``mark_step``) the recording becomes the trace and the
scheduler *replays* it: it knows the next use of every chunk, so the store can prefetch the next chunks
and evict the one used furthest in the future (Belady's optimal policy). Without a trace, eviction is
least-recently-used and nothing is prefetched.

If an access differs from the trace (a different model path, a skipped layer), the scheduler logs it
once, drops the trace and records again from what this step has done so far; the next step boundary
freezes the new order.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterator
from typing import NamedTuple

from tiertune.offload.tiers import Tier

log = logging.getLogger("tiertune.offload")


class Access(NamedTuple):
    chunk: int
    tier: Tier
    overwrite: bool = False  # the accessor writes the chunk whole: nothing to prefetch for it


class Scheduler:
    """Records, replays and looks ahead along the per-step chunk access trace. Not thread-safe: the store
    calls it under its lock."""

    def __init__(self, quiet: bool = False) -> None:
        """``quiet``: a divergence is logged at debug level (a pass's scheduler: ``ChunkStore.begin_pass``)."""
        self.quiet = quiet
        self.trace: tuple[Access, ...] | None = None
        self.cursor = 0  # index in the trace of the next expected access
        self.clock = 0  # accesses so far, for LRU
        self.base = 0  # trace positions of the steps replayed whole before this one (``next_at``'s origin)
        self.epoch = 0  # changes whenever ``next_at`` of a chunk not accessed since may have changed
        self.divergences = 0
        self._recording: list[Access] = []
        self._positions: dict[int, list[int]] = {}
        self._tier_positions: dict[tuple[int, Tier], list[int]] = {}

    @property
    def replaying(self) -> bool:
        return self.trace is not None

    def on_access(self, chunk: int, tier: Tier, overwrite: bool = False) -> None:
        """Note an access; checks it against the trace when replaying."""
        self.clock += 1
        access = Access(chunk, tier, overwrite)
        if self.trace is not None:
            if self.cursor < len(self.trace) and self.trace[self.cursor] == access:
                self.cursor += 1
                return
            self._diverge(access)
        self._recording.append(access)

    def mark_step(self) -> None:
        """A step boundary: the first full recorded step becomes the trace; replay restarts at its head."""
        if self.trace is None:
            if self._recording:
                self._freeze(self._recording)
        elif self.cursor != len(self.trace):
            self._diverge(None)
            self._freeze(self._recording)
        else:
            self.base += len(self.trace)
        self._recording = []
        self.cursor = 0

    def end_pass(self) -> None:
        """The end of a pass that repeats only in part (``ChunkStore.begin_pass``'s): as ``mark_step``, but a pass
        that ended early along the trace (fewer micro-batches: the data's last) keeps the trace it replayed."""
        if self.trace is not None and self.cursor != len(self.trace):
            self._recording = []
            self.cursor = 0
            self.epoch += 1
            return
        self.mark_step()

    def forget(self) -> None:
        """The accesses since the last step boundary were not a step's (a pass before training): dropped; the
        trace, if there is one, replays from its head again."""
        self._recording = []
        self.cursor = 0
        self.epoch += 1

    def _diverge(self, access: Access | None) -> None:
        assert self.trace is not None
        self.divergences += 1
        expected = self.trace[self.cursor] if self.cursor < len(self.trace) else "the end of the step"
        got = access if access is not None else "the end of the step"
        level = logging.WARNING if self.divergences == 1 and not self.quiet else logging.DEBUG
        log.log(
            level,
            "chunk access order diverged from the recorded trace at position %d (expected %s, got %s); "
            "re-recording the trace (eviction falls back to LRU and prefetching pauses until the next step)",
            self.cursor,
            expected,
            got,
        )
        self._recording = list(self.trace[: self.cursor])
        self.trace = None
        self.epoch += 1
        self._positions.clear()
        self._tier_positions.clear()

    def _freeze(self, accesses: list[Access]) -> None:
        self.trace = tuple(accesses)
        self.epoch += 1
        self._positions = {}
        self._tier_positions = {}
        for i, (chunk, tier, _) in enumerate(self.trace):
            self._positions.setdefault(chunk, []).append(i)
            self._tier_positions.setdefault((chunk, tier), []).append(i)

    @property
    def now(self) -> int:
        """The position of the next expected access, counted from the first replayed step's head."""
        return self.base + self.cursor

    def next_at(self, chunk: int, tier: Tier | None = None) -> float:
        """The position (as ``now`` counts) of ``chunk``'s next use (on ``tier`` if given); inf if never or no
        trace. It changes only when the chunk is accessed or ``epoch`` changes: an order of chunks by it
        stays right while other chunks are used."""
        if self.trace is None:
            return math.inf
        positions = self._positions.get(chunk) if tier is None else self._tier_positions.get((chunk, tier))
        if not positions:
            return math.inf
        i = bisect.bisect_left(positions, self.cursor)
        if i < len(positions):
            return self.base + positions[i]
        return self.base + len(self.trace) + positions[0]  # the trace repeats every step: wrapped

    def next_use(self, chunk: int, tier: Tier | None = None) -> float:
        """Accesses from now until ``chunk``'s next use (on ``tier`` if given); inf if never or no trace.

        The trace repeats every step, so the distance wraps around into the next step.
        """
        return self.next_at(chunk, tier) - self.now

    def upcoming(self, count: int, tier: Tier | None = None) -> list[int]:
        """The next ``count`` distinct chunks the trace will read (on ``tier`` if given), soonest first;
        a chunk whose next access overwrites it is skipped (its bytes are not needed)."""
        if self.trace is None or count <= 0:
            return []
        out: list[int] = []
        seen: set[int] = set()
        n = len(self.trace)
        for k in range(n):
            chunk, t, overwrite = self.trace[(self.cursor + k) % n]
            if (tier is not None and t is not tier) or chunk in seen:
                continue
            seen.add(chunk)  # only a chunk's next access says whether its bytes are needed
            if not overwrite:
                out.append(chunk)
                if len(out) == count:
                    break
        return out

    def victim_key(self, chunk: int, last_use: int, tier: Tier) -> tuple[float, int, int]:
        """The key that orders a copy of ``chunk`` on ``tier`` among eviction victims, best first (smallest).

        Replaying: furthest next use first (Belady). Recording: least recently used first. Ties (no next
        use) go to the least recently used, then to the chunk registered first.
        """
        look = tier if tier is Tier.DEVICE else None  # a host copy serves any later use
        return (-self.next_at(chunk, look), last_use, chunk)


class EvictionOrder:
    """The chunks with a copy on one memory tier, kept sorted by the scheduler's ``victim_key``: the best
    victims are read off the front, not found by sorting every copy at each allocation. A key is set
    again when it may change: when its chunk is accessed, and for all when the scheduler's epoch changes."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[float, int, int]] = {}
        self._sorted: list[tuple[float, int, int]] = []

    def __iter__(self) -> Iterator[tuple[float, int, int]]:
        return iter(self._sorted)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._keys

    def put(self, key: tuple[float, int, int]) -> None:
        """Add chunk ``key[2]`` with ``key``, or move it there."""
        old = self._keys.get(key[2])
        if old == key:
            return
        if old is not None:
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._keys[key[2]] = key
        bisect.insort(self._sorted, key)

    def drop(self, chunk: int) -> None:
        """Remove ``chunk`` (it has no copy on the tier any more)."""
        old = self._keys.pop(chunk, None)
        if old is not None:
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def clear(self) -> None:
        self._keys.clear()
        self._sorted.clear()
