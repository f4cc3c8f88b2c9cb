"""The update of a LoRA step (``AdapterUpdate``): the adapters' own optimizer on the compute device, after
backward; the frozen base has nothing for the CPU optimizer (``engine.update``) to change."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tiertune.errors import NonFiniteError

if TYPE_CHECKING:
    from tiertune.engine.compute import Compute
    from tiertune.engine.config import EngineConfig
    from tiertune.engine.layout import GroupState
    from tiertune.engine.sharding import Sharding
    from tiertune.engine.step import StepContext
    from tiertune.engine.worker import Unit
    from tiertune.methods.lora import Adapters
    from tiertune.offload.chunk import Chunk


class AdapterUpdate:
    """The update of a LoRA step, with ``Updater``'s start and finish: after backward, the adapters' own optimizer
    on the compute device (``methods.lora.Adapters.step``: clipping as ``clip_grad_norm_``), replicated on every
    rank of several, their gradients summed over the global batch first. The frozen base has no chunk to
    change: ``units`` is empty and ``before_update`` is never called."""

    def __init__(
        self,
        adapters: Adapters,
        config: EngineConfig,
        ctx: StepContext,
        counts: dict[str, int],
        sharding: Sharding,
        compute: Compute,
    ) -> None:
        self.adapters, self.config, self.ctx, self.counts, self.sharding = (
            adapters,
            config,
            ctx,
            counts,
            sharding,
        )
        self.compute = compute
        self.units: list[Unit] = []
        self.before_update: Callable[[tuple[Chunk, ...]], None] | None = None

    def splits(self, state: GroupState) -> bool:
        """No split update: the base is frozen (``Updater.splits``)."""
        return False

    def before_gradients(self, state: GroupState) -> float:
        """No delayed update: nothing to wait for (``Updater.before_gradients``)."""
        return 0.0

    def after_gradients(self, state: GroupState) -> None:
        """No delayed update (``Updater.after_gradients``)."""

    def settle(self, weights: bool = False) -> None:
        """Nothing in flight: the adapters' step ran in ``finish`` (``Updater.settle``)."""

    weights_behind = False  # never behind (``Updater.weights_behind``)

    def start(self, early: Sequence[GroupState] = ()) -> None:
        """A step begins: nothing to prepare (autograd accumulates the adapters' gradients)."""

    def finish(self, loss: float) -> float:
        """After backward: the adapters' optimizer step; returns the gradient norm. A loss that is not finite
        raises NonFiniteError with the adapters as they were (their gradients dropped)."""
        cfg = self.config
        if not math.isfinite(loss):
            self.adapters.zero_grad()
            raise NonFiniteError(f"the loss is {loss}")
        self.sharding.all_reduce_grads(self.adapters.params)
        clip = cfg.max_grad_norm if cfg.clips else None
        norm = self.compute.run(
            self.adapters.step,
            self.ctx.lr,
            cfg.weight_decay,
            (cfg.adam_beta1, cfg.adam_beta2),
            cfg.adam_epsilon,
            clip,
        )
        self.counts["after_backward"] += 1
        if norm is None:  # a ledger's: its adapters, on the meta device, hold no values
            self.adapters.zero_grad()
            return float(self.compute.norm(torch.zeros(()), self.ctx.number))
        return norm

    def close(self) -> None:
        """Nothing runs beside the compute thread."""


__all__ = ["AdapterUpdate"]
