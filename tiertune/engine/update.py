"""The update side of a step: the optimizer worker thread that runs the CPU optimizer one weight chunk at a
time behind backward (``OptimizerWorker``), and the learning rate of each step (``LRSchedule``)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiertune.offload.store import ChunkStore

if TYPE_CHECKING:
    from tiertune.engine.trainer import GroupState


@dataclass
class StepContext:
    """The step in progress, as the engine's callbacks see it (backward's gradient hand-off, the optimizer
    worker, weight acquisition): set by the step, read while it runs."""

    lr: float = 0.0  # this step's learning rate
    speculating: bool = False  # the optimizer runs during backward, into twins, before the norm is known
    first_micro: bool = False  # the micro-batch being back-propagated is the step's first (overwrites)
    last_micro: bool = False  # ... its last (gradients final: norms taken, units handed to the optimizer)
    traced: bool = True  # weight accesses enter the scheduler's trace (not during inference or DoRA init)


Unit = tuple["GroupState", int]
"""One unit of optimizer work: a group's state and the index of one of its weight chunks."""


class OptimizerWorker:
    """One background thread that runs the optimizer's units in the order they are submitted.

    While it works on one unit it prefetches the optimizer states of the next units of the step's plan
    from disk, even before backward has submitted them (their sources do not depend on the gradients).
    ``submit`` waits while ``max_pending`` units are queued or running, so that a slow optimizer holds back
    backward instead of letting every layer's gradients pile up (the step takes as long either way: the
    worker never idles); it stops waiting when the worker itself waits in the store (for room or a chunk the caller holds).
    ``join`` waits for the submitted units and re-raises the first error.
    """

    def __init__(
        self, store: ChunkStore, run_unit: Callable[[Unit, torch.Tensor | None], None], times: dict[str, float],
        lookahead: int = 2, max_pending: int = 2,
    ) -> None:  # fmt: skip
        """``run_unit((state, j), coef)`` updates weight chunk ``j`` of group state ``state``; the seconds it
        takes are added to ``times["optimizer_busy"]``."""
        self._store = store
        self._run_unit = run_unit
        self._times = times
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lookahead = lookahead
        self._max_pending = max_pending
        self._plan: list[Unit] = []
        self._pending = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tiertune-optimizer", daemon=True)
        self._thread.start()

    def start_step(self, plan: list[Unit]) -> None:
        self._queue.put(("plan", plan))

    def submit(self, state: GroupState, coef: torch.Tensor | None, j: int | None = None) -> float:
        """Queue the unit(s) of ``state`` (chunk ``j``, or all of its chunks); returns the seconds waited."""
        store = self._store
        waited = 0.0
        for k in range(len(state.weights)) if j is None else (j,):
            began = time.perf_counter()
            with self._cond:
                while self._pending >= self._max_pending and self._error is None:
                    if store.waiting(self._thread.ident):  # maybe for a chunk the caller holds
                        break
                    self._cond.wait(timeout=0.05)
                if self._error is not None:
                    raise self._error
                self._pending += 1
            waited += time.perf_counter() - began
            self._queue.put(("unit", (state, k, coef)))
        return waited

    def join(self) -> None:
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join()

    def _run(self) -> None:
        position = 0
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "plan":
                self._plan, position = item, 0
                continue
            state, j, coef = item
            try:
                if self._error is None:
                    began = time.perf_counter()
                    while position < len(self._plan) and self._plan[position] != (state, j):
                        position += 1
                    ahead = self._plan[position + 1 : position + 1 + self._lookahead]
                    self._store.prefetch([c for s, k in ahead for c in s.reads(k)])
                    self._run_unit((state, j), coef)
                    self._times["optimizer_busy"] += time.perf_counter() - began
            except BaseException as exc:  # reported by join/submit on the compute thread
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()


class LRSchedule:
    """The learning rate of each step, from transformers' own scheduler (as the HF Trainer computes it)."""

    def __init__(self, learning_rate: float, kind: str, warmup_steps: int, max_steps: int) -> None:
        from transformers import get_scheduler

        self._param = nn.Parameter(torch.zeros(1))
        self._opt = torch.optim.SGD([self._param], lr=learning_rate)
        self._sched = get_scheduler(
            kind,
            self._opt,
            num_warmup_steps=warmup_steps,
            num_training_steps=max_steps,
        )
        self._at = 0

    def lr(self, step: int) -> float:
        """The learning rate of step ``step`` (counted from 0; steps are asked for in increasing order)."""
        while self._at < step:
            self._opt.step()
            self._sched.step()
            self._at += 1
        return float(self._opt.param_groups[0]["lr"])
