"""The optimizer's worker thread (``OptimizerWorker``): the units of a step's update, one weight chunk each, run
in the order backward submits them, behind it."""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tiertune.errors import BudgetError
from tiertune.offload.store import ChunkStore

if TYPE_CHECKING:
    from tiertune.engine.layout import GroupState
    from tiertune.engine.trace import Trace


MAX_PENDING = 2
"""Units queued or running at most before ``OptimizerWorker.submit`` waits (``engine.trace``'s replays too)."""

Unit = tuple["GroupState", int]
"""One unit of optimizer work: a group's state and the index of one of its weight chunks."""


class OptimizerWorker:
    """One background thread that runs the optimizer's units in the order they are submitted, and, when none
    is queued, the *background* pieces of a unit split in two (``submit_background``: the rows of an embedding
    whose gradient is final early, ``engine.update``), which count towards no limit but ``join``'s.

    While it works on one unit it prefetches the optimizer states of the next units of the step's plan
    from disk, even before backward has submitted them (their sources do not depend on the gradients).
    ``submit`` waits while ``max_pending`` units are queued or running, so that a slow optimizer holds back
    backward instead of letting every layer's gradients pile up (the step takes as long either way: the
    worker never idles); it stops waiting when the worker itself waits in the store on another thread (for
    room, or a chunk the caller holds), not when it waits for a read of its states.
    ``join`` waits for the submitted units and re-raises the first error.
    """

    def __init__(
        self,
        store: ChunkStore,
        run_unit: Callable[[Unit, torch.Tensor | None, Any], None],
        times: dict[str, float],
        lookahead: int = 2,
        max_pending: int = MAX_PENDING,
        inline: bool = False,
        threads: Callable[[], int] | None = None,
        trace: Trace | None = None,
    ) -> None:
        """``run_unit((state, j), coef, part)`` updates weight chunk ``j`` of group state ``state`` (``part``: the
        part of it that ``submit`` or ``submit_background`` was given, None for all of it); the seconds it
        takes are added to ``times["optimizer_busy"]``. ``inline``: no thread, each unit runs as it is
        submitted, on the caller's thread (over a ledger store, whose calls one thread makes in turn: the
        worker keeping up with backward). ``threads()``: the torch threads of the unit about to start (set
        on the worker's own thread: torch's setting is the calling thread's); None: as the thread starts.
        ``trace`` (inline only): where the submits, waits and each unit's own script are recorded
        (``engine.trace``)."""
        self._store = store
        self._run_unit = run_unit
        self._times = times
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lookahead = lookahead
        self._max_pending = max_pending
        self._plan: list[Unit] = []
        self._pending = 0  # units and background pieces queued or running
        self._background = 0  # ... background pieces among them
        self._later: collections.deque = collections.deque()  # the worker's background pieces not yet run
        self._of_state: collections.Counter[int] = collections.Counter()  # queued or running, by state id
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._inline = inline
        self._held: list[
            tuple[GroupState, int, torch.Tensor | None, Any]
        ] = []  # inline: ``submit(behind=True)``
        self._threads = threads
        self._trace = trace if inline else None
        self._position = 0  # in the plan: the unit running, or the last one run
        self._thread = threading.Thread(target=self._run, name="tiertune-optimizer", daemon=True)
        if not inline:
            self._thread.start()

    def start_step(self, plan: list[Unit]) -> None:
        if self._inline:
            self._plan, self._position = plan, 0
            return
        self._queue.put(("plan", plan))

    def submit(
        self,
        state: GroupState,
        coef: torch.Tensor | None,
        j: int | None = None,
        behind: bool = False,
        part: Any = None,
        wait: bool = True,
    ) -> float:
        """Queue the unit(s) of ``state`` (chunk ``j``, or all of its chunks); returns the seconds waited.
        ``behind``: the caller drains to one unit left before its next hand-off (``drain(2)``), so that unit may
        still run while the caller makes its next gradients; inline (a ledger), the last such unit runs at the
        next submit or full drain, after what the caller does in between: the worst case, whose peak the
        estimate then predicts (a worker that keeps up holds one group's gradients less). ``part`` (with
        ``j``): the rest of a unit whose background pieces were submitted before; it runs after all of them.
        ``wait=False``: queued without waiting for fewer pending (a delayed update's units, which the next step
        runs beside)."""
        waited = 0.0
        for k in range(len(state.weights)) if j is None else (j,):
            if self._inline:
                self._run_held()
                if self._trace is not None:
                    self._trace.op(*(("submit",) if part is None else ("submit", "after")))
                if behind:
                    self._held.append((state, k, coef, part))
                else:
                    self._unit(state, k, coef, part)
                continue
            began = time.perf_counter()
            with self._cond:
                if wait:
                    self._wait_below(self._max_pending)
                if self._error is not None:
                    raise self._error
                self._pending += 1
                self._of_state[id(state)] += 1
            waited += time.perf_counter() - began
            self._queue.put(("unit", (state, k, coef, part)))
        return waited

    def submit_background(self, items: list[tuple[GroupState, int, Any]]) -> None:
        """Queue ``items`` ((state, chunk, part) each) as background pieces: the worker runs one whenever no unit
        is queued, in the order given, and those of a state before the unit submitted with a ``part`` for it
        (the rest of a split update). Never waits: the pieces count towards no limit of ``submit`` or
        ``drain``, only ``join``'s. Inline (a ledger) they run now, one after the other."""
        if not items:
            return
        if self._inline:
            self._run_held()
            if self._trace is not None:
                self._trace.op("submit", "background", len(items))
            for state, j, part in items:
                self._unit(state, j, None, part, background=True)
            return
        with self._cond:
            if self._error is not None:
                raise self._error
            self._pending += len(items)
            self._background += len(items)
            self._of_state.update(id(state) for state, _, _ in items)
        self._queue.put(("background", [(state, j, None, part) for state, j, part in items]))

    def drain(self, limit: int = 1) -> float:
        """Wait until fewer than ``limit`` submitted units are queued or running (1: all done), or the worker
        waits in the store on another thread, perhaps for a chunk the caller holds; returns the seconds
        waited."""
        began = time.perf_counter()
        if self._trace is not None:
            self._trace.op("drain", limit)
        if self._inline and limit <= 1:
            self._run_held()
        with self._cond:
            self._wait_below(limit)
        return time.perf_counter() - began

    def _wait_below(self, limit: int) -> None:
        """With the lock held: wait until fewer than ``limit`` units are queued or running, the worker failed,
        or the worker itself waits in the store on another thread (maybe for a chunk the caller holds:
        waiting on would hang). A worker waiting for a transfer in flight is waited for: the transfer ends by
        itself, and returning early would let the caller stage its next chunks beside the worker's."""
        while (
            self._pending - self._background >= limit
            and self._error is None
            and not self._store.waiting(self._thread.ident)
        ):
            self._cond.wait(timeout=0.05)

    def wait_state(self, state: GroupState, stuck_s: float = 60.0) -> float:
        """Wait until no unit or piece of ``state`` is queued or running (inline: the units held back run now);
        returns the seconds waited. Unlike ``drain``, a worker waiting in the store on another thread is waited
        for too (the caller is about to overwrite what that unit reads, and holds nothing on the host then): a
        worker stuck so for ``stuck_s`` seconds on end is a ``BudgetError`` (the host budget cannot hold the
        update beside the step), not a hang."""
        began = time.perf_counter()
        if self._inline:
            self._run_held()
            return 0.0
        stuck = None
        with self._cond:
            while self._of_state[id(state)] and self._error is None:
                if not self._store.waiting(self._thread.ident):
                    stuck = None
                elif stuck is None:
                    stuck = time.perf_counter()
                elif time.perf_counter() - stuck > stuck_s:
                    raise BudgetError(
                        f"the optimizer's worker has waited {stuck_s:.0f} s for host memory while the next step "
                        "runs (offload.delay_update holds a step's update beside the next step): raise "
                        "offload.host_budget, or set offload.delay_update: false"
                    )
                self._cond.wait(timeout=0.05)
            if self._error is not None:
                raise self._error
        return time.perf_counter() - began

    def join(self) -> None:
        if self._trace is not None:
            self._trace.op("join")
        self._run_held()
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run_held(self) -> None:
        """Inline: the unit held back by ``submit(behind=True)``, if any."""
        while self._held:
            self._unit(*self._held.pop(0))

    def close(self) -> None:
        if self._inline:
            return
        self._queue.put(("stop", None))
        self._thread.join()

    def _unit(
        self, state: GroupState, j: int, coef: torch.Tensor | None, part: Any = None, background: bool = False
    ) -> None:
        """Unit ``j`` of ``state`` (or its ``part``), after prefetching the states of the next units of the plan
        (a background piece runs outside the plan: it neither moves along it nor prefetches)."""
        began = time.perf_counter()
        if self._threads is not None and not self._inline:
            n = self._threads()
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
        ahead: list[Unit] = []
        if not background:
            while self._position < len(self._plan) and self._plan[self._position] != (state, j):
                self._position += 1
            ahead = self._plan[self._position + 1 : self._position + 1 + self._lookahead]
        with self._trace.unit() if self._trace is not None else contextlib.nullcontext():
            self._store.prefetch([c for s, k in ahead for c in s.reads(k)])
            with self._store.holding("optimizer"):  # its own moments on a ledger (``engine.memory``)
                self._run_unit((state, j), coef, part)
        self._times["optimizer_busy"] += time.perf_counter() - began

    def _run(self) -> None:
        while True:
            if self._later:  # background pieces wait for nothing but the units queued
                try:
                    kind, item = self._queue.get_nowait()
                except queue.Empty:
                    self._run_one(self._later.popleft(), background=True)
                    continue
            else:
                kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "plan":
                self._plan, self._position = item, 0
                continue
            if kind == "background":
                self._later.extend(item)
                continue
            if item[3] is not None:  # the rest of a split unit: after its state's background pieces
                for piece in [p for p in self._later if p[0] is item[0]]:
                    self._later.remove(piece)
                    self._run_one(piece, background=True)
            self._run_one(item)

    def _run_one(self, item: tuple, background: bool = False) -> None:
        """Run one queued unit or background piece; an error is kept for ``join``/``submit`` to raise."""
        try:
            if self._error is None:
                self._unit(*item, background=background)
        except BaseException as exc:  # reported by join/submit on the compute thread
            with self._cond:
                self._error = self._error or exc
        finally:
            with self._cond:
                self._pending -= 1
                self._background -= background
                self._of_state[id(item[0])] -= 1
                self._cond.notify_all()
