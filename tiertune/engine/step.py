"""The step in progress as the engine's callbacks see it (``StepContext``: backward's gradient hand-off, the
optimizer worker, weight acquisition), and the learning rate of each step (``LRSchedule``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepContext:
    """The step in progress, as the engine's callbacks see it (backward's gradient hand-off, the optimizer
    worker, weight acquisition): set by the step, read while it runs."""

    lr: float = 0.0  # this step's learning rate
    speculating: bool = False  # the optimizer runs during backward, into twins, before the norm is known
    first_wave: bool = (
        False  # the wave of micro-batches being back-propagated is the step's first (overwrites)
    )
    last_wave: bool = False  # ... its last (gradients final: norms taken, units handed to the optimizer)
    traced: bool = True  # weight accesses enter the scheduler's trace (not during inference or DoRA init)
    number: int = 1  # the step being made, counted from 1 (AdamW's bias correction, GaLore's refreshes)
    # the step's backward and hand-offs are done: the compute thread only waits for the optimizer, whose units
    # from now on may use its cores too (``Updater``'s ``tail_threads``)
    tail: bool = False


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


__all__ = ["LRSchedule", "StepContext"]
