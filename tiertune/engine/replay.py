"""A run's training steps replayed on a ledger: the bytes each tier holds and each link moves, counted by the
engine's own step over the store's own code.

``replay`` builds the ``StreamedTrainer`` the run would build, over a ledger store (``StoreConfig.ledger``:
the same placement, eviction, prefetch and trace, over no bytes) and the ledger substrate
(``engine.compute.Ledger``: shapes, no arithmetic), and calls its ``step``. Every store call a step makes
(weights acquired per wave and layer, the boundaries stashed, gradients handed to the host, the optimizer's
units, the twins exchanged) is the engine's own; nothing here describes a step. A change to the schedule is
a change here, checked against runs by ``tests/finetune/test_estimate.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tiertune.distributed.world import World
from tiertune.engine.compute import Ledger
from tiertune.engine.config import EngineConfig
from tiertune.engine.trainer import StreamedTrainer
from tiertune.logs import held_back
from tiertune.offload.store import StoreConfig


@dataclass
class Replayed:
    """What the ledger counted: per tier its peak bytes over the replayed steps; per link (``disk->host``...)
    the bytes the last step moved; per memory tier and size class the most chunks in use at once; per
    collective the bytes this rank sent in the last step (of several ranks)."""

    peaks: dict[str, int]
    moved: dict[str, int]
    in_use: dict[str, dict[int, int]] = field(default_factory=dict)
    wire: dict[str, int] = field(default_factory=dict)
    adapters: int = 0  # the LoRA parameters the engine trains (peft's wrapping)


CLIPPED = (True, False, False, False)
"""Which replayed steps are clipped, by default: the first (speculated, then redone with the coefficient),
so the second runs the optimizer after backward and the last two speculate and are confirmed. Every way a
step's update runs is in the peaks; the bytes moved are the last step's, the steady state of a run whose
steps are not clipped."""


def replay(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    rows: int,
    tokens: int,
    micro_batches: int,
    clipped: Sequence[bool] = CLIPPED,
    device: torch.device | None = None,
    world: World | None = None,
) -> Replayed:
    """Replay ``len(clipped)`` steps of ``micro_batches`` micro-batches of ``rows`` x ``tokens`` (a preference
    objective's: ``rows`` pairs) of the model at ``model_dir`` (its safetensors headers, or its config.json
    alone) on a ledger store configured as ``store_cfg`` (its budgets and the plan's reserve). ``clipped[k]``:
    whether step k's gradient norm is above ``max_grad_norm`` (the engine speculates on a step unless the one
    before was clipped, and redoes a speculative step that is). The first step records the trace, as in a run;
    the bytes moved are the last step's (no step: the trainer only built). ``device``: what the run computes
    on (default: the store's)."""
    ledger = dataclasses.replace(store_cfg, ledger=True, device=device or store_cfg.device)
    # a replay is no run: what the engine says of the run it builds is not the estimate's to print
    with held_back("tiertune", logging.WARNING):
        trainer = StreamedTrainer(
            model_dir, ledger, cfg, world=world, compute=Ledger(clipped, cfg.max_grad_norm)
        )
    try:
        batch = [_micro_batch(cfg, rows, tokens)] * micro_batches
        before: dict[str, int] = {}
        sent: dict[str, int] = {}
        for _ in clipped:
            before, sent = trainer.store_stats().bytes_moved, trainer.wire_sent()
            with held_back("tiertune", logging.WARNING):
                trainer.step(batch)
        stats = trainer.store_stats()
        moved = _since(before, stats.bytes_moved)
        peaks = {t: s.peak for t, s in stats.tiers.items()}
        adapters = sum(p.numel() for p in trainer.adapters.params) if trainer.adapters else 0
        return Replayed(peaks, moved, trainer.in_use_peaks(), _since(sent, trainer.wire_sent()), adapters)
    finally:
        trainer.close()


def _since(before: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """The counts that grew since ``before``, by how much."""
    return {k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0)}


def _micro_batch(cfg: EngineConfig, rows: int, tokens: int) -> dict[str, torch.Tensor]:
    """A micro-batch of the run's shape: ``rows`` sequences of ``tokens``, or for a preference objective
    ``rows`` pairs (their chosen, then rejected sequences; KTO's labels; a full fine-tune's reference
    log-probabilities, computed before training)."""
    objective = cfg.objective
    if not objective.paired:
        return {"input_ids": torch.zeros(rows, tokens, dtype=torch.long)}
    batch = {"input_ids": torch.zeros(2 * rows, tokens, dtype=torch.long), "pairs": torch.tensor(rows)}
    if objective.type == "kto":
        batch["label"] = torch.ones(rows, dtype=torch.bool)
    if objective.reference and cfg.method != "lora":
        batch["ref_logps"] = torch.zeros(2 * rows)
    return batch
