"""A run's steps replayed on a ledger: ``replay`` builds the ``StreamedTrainer`` the run would build over a
ledger store (``StoreConfig.ledger``: the store's own placement, eviction, prefetch and trace, over no bytes)
and the ledger substrate (``engine.compute.Ledger``: shapes, no arithmetic; ZeRO's collectives counting), and
calls its ``step``. Nothing here describes a step: a change to the schedule needs no change here, and
``tests/finetune/test_estimate.py`` checks the replay's figures against runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tiertune.distributed.world import World
from tiertune.engine.compute import Ledger
from tiertune.engine.config import EngineConfig
from tiertune.engine.trace import Trace
from tiertune.engine.trainer import StreamedTrainer
from tiertune.logs import held_back
from tiertune.offload.store import StoreConfig


@dataclass
class Replayed:
    """What the ledger counted: per tier its peak bytes over the replayed steps; per link (``disk->host``...)
    the bytes the last step moved; per collective the bytes this rank sent in the last step (of several
    ranks); the steps' schedule as each thread runs it (``engine.trace``: the estimate's timeline)."""

    peaks: dict[str, int]
    moved: dict[str, int]
    wire: dict[str, int] = field(default_factory=dict)
    trace: Trace = field(default_factory=Trace)
    evaluation: Evaluated | None = None  # held-out passes after the steps (``replay``'s ``evaluate``)
    # several adapters': each evaluating adapter's passes, by name, in the order they ran
    evaluations: dict[str, Evaluated] = field(default_factory=dict)
    # the bytes a step after a clipped one moved, by link (its update after backward: a run whose steps clip)
    after_clipped: dict[str, int] = field(default_factory=dict)


@dataclass
class Evaluated:
    """What the ledger counted of an evaluation after the replayed steps (``finetune.evaluation``: passes of the
    layers without autograd, the store left as it was found) and of the step after it: the bytes each pass moved
    and the bytes that step moved, by link; ``trace`` the whole replay, the steps, each pass and the step after
    it each begun by a ``("step",)`` (``estimates.timeline.simulate_steps`` plays each)."""

    passes: list[dict[str, int]]
    after: dict[str, int]
    trace: Trace
    first: int = 0  # the passes in ``trace`` before these (several adapters': the adapters' evaluated before)


CLIPPED = (True, True, False, False, False)
"""Which replayed steps are clipped, by default: the first two (the first speculated, then redone), so the second
and third run the optimizer after backward, in place, and the last two speculate and are confirmed: every way an
update runs is in the peaks; the bytes moved are the last step's, the steady state of a run whose steps are not
clipped, and the third's (``AFTER_CLIPPED``) that of a run whose steps clip (the second's follows a speculative
step: the demo's moves 11.9 MB where every later one moves 9.6). LoRA's adapters are updated on the device one
way: its first two steps (the first records the trace) are enough."""

AFTER_CLIPPED = 2
"""The replayed step that runs after backward after another that did (``CLIPPED``): a clipping run's steady state."""


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
    shapes: Sequence[tuple[int, int, int]] = (),
    evaluate: int = 0,
    evaluating: Sequence[int] = (),
) -> Replayed:
    """Replay ``len(clipped)`` steps of ``micro_batches`` micro-batches of ``rows`` x ``tokens`` (a preference
        objective's: ``rows`` pairs) of the model at ``model_dir`` (its safetensors headers, or its config.json
        alone) on a ledger store configured as ``store_cfg`` (its budgets and the plan's reserve). ``clipped[k]``:
        whether step k's gradient norm is above ``max_grad_norm`` (the engine speculates on a step unless the one
        before was clipped, and redoes a speculative step that is). The first step records the trace, as a run's;
        the bytes moved are the last step's (none: only built). ``device``: what the run computes on. Several
    adapters over the base (``cfg.others``): each one's step of its own micro-batches, ``shapes`` (rows, tokens,
    micro-batches) in ``cfg.adapter_configs``' order, run as one (``step_adapters``). ``evaluate``: that many
    evaluation passes of the step's micro-batches after the steps, then one more step (``Replayed.evaluation``;
    the peaks include them, the bytes moved and the trace are the steps' own); of several adapters, that many
    passes of each adapter in ``evaluating`` (indices in ``cfg.adapter_configs``) alone over its own
    micro-batches, one adapter after another as a run's evaluations due at one step, then one more step of all
    (``Replayed.evaluations``)."""
    ledger = dataclasses.replace(store_cfg, ledger=True, device=device or store_cfg.device)
    compute = Ledger(clipped, cfg.max_grad_norm)
    trace = compute.trace = Trace()
    # a replay is no run: what the engine says of the run it builds is not the estimate's to print
    with held_back("tiertune", logging.WARNING):
        trainer = StreamedTrainer(model_dir, ledger, cfg, world=world, compute=compute)
    trainer.store.trace = trace  # the steps' transfers, not the load's
    try:
        batch = [micro_batch(cfg, rows, tokens)] * micro_batches
        groups = None
        if cfg.others:  # several adapters over the base: each one's micro-batches (``shapes``), one step
            assert trainer.adapters is not None
            groups = {
                name: [micro_batch(c, r, n)] * k
                for name, c, (r, n, k) in zip(
                    trainer.adapters.names, cfg.adapter_configs, shapes, strict=True
                )
            }
        per_step: list[dict[str, int]] = []  # the bytes each step moved
        for _ in clipped:
            trace.op("step")
            with held_back("tiertune", logging.WARNING):
                if groups is None:
                    trainer.step(batch)
                else:
                    trainer.step_adapters(groups)
            per_step.append(_last_moved(trainer))
        last = trainer.last_report
        moved = per_step[-1] if per_step else {}
        wire = {k: n for k, n in last.wire.items() if n} if last else {}
        # a step after clipped ones: its update after backward, in place (``AFTER_CLIPPED``)
        n = AFTER_CLIPPED
        after = per_step[n] if len(clipped) > n + 1 and all(clipped[:n]) else {}
        if not evaluate or (groups is not None and not evaluating):
            return Replayed(_peaks(trainer), moved, wire, trace, after_clipped=after)
        steps = Trace()  # the steps' own schedule, before the evaluation's
        steps.compute, steps.units = list(trace.compute), [list(u) for u in trace.units]
        if groups is None:
            evaluated = _evaluation(trainer, trace, [(None, batch, cfg)], evaluate)
            return Replayed(_peaks(trainer), moved, wire, steps, evaluated[None], after_clipped=after)
        names = trainer.adapters.names  # type: ignore[union-attr]
        each = [(names[i], groups[names[i]], cfg.adapter_configs[i]) for i in evaluating]
        evaluations = _evaluation(trainer, trace, each, evaluate, groups)
        return Replayed(_peaks(trainer), moved, wire, steps, evaluations=evaluations, after_clipped=after)
    finally:
        trainer.close()


def _evaluation(
    trainer: StreamedTrainer,
    trace: Trace,
    each: Sequence[tuple[str | None, list[dict[str, torch.Tensor]], EngineConfig]],
    passes: int,
    groups: dict[str, list[dict[str, torch.Tensor]]] | None = None,
) -> dict[str | None, Evaluated]:
    """``passes`` evaluation passes as ``finetune.evaluation.evaluate`` makes them (a LoRA DPO's or KTO's second
    pass, the base with its adapters off, for its reference) over each of ``each``'s micro-batches, by the
    adapter it names alone (None: the model as it is), then one more step (of every adapter's ``groups``).
    Returns each one's passes, by the name given."""
    from tiertune.engine.generate import moved_by_pass

    found: dict[str | None, list[dict[str, int]]] = {}
    for name, batch, cfg in each:

        def one_pass(name: str | None = name, batch: list = batch, cfg: EngineConfig = cfg) -> None:
            trace.op("step")
            with held_back("tiertune", logging.WARNING):
                if name is not None:
                    trainer.adapters.activate(name)  # type: ignore[union-attr]
                trainer.sequence_logps(batch)
                if cfg.objective.reference and trainer.adapters is not None:
                    with trainer.reference():
                        trainer.sequence_logps(batch)

        found[name] = moved_by_pass(trainer, passes, one_pass)
    trace.op("step")
    with held_back("tiertune", logging.WARNING):
        if groups is None:
            trainer.step(each[0][1])
        else:
            trainer.step_adapters(groups)
    after = _last_moved(trainer)
    return {name: Evaluated(moved, after, trace, i * passes) for i, (name, moved) in enumerate(found.items())}


def _last_moved(trainer: StreamedTrainer) -> dict[str, int]:
    """The bytes the trainer's last step moved, by link (those it moved any of)."""
    last = trainer.last_report
    return {k: n for k, n in last.moved.items() if n} if last else {}


@dataclass
class Decoded:
    """What the ledger counted of a decoding (``engine.generate``'s weight accesses): the bytes each pass moved,
    by link (the first binds the groups outside the layers for the whole decoding), and each tier's peak."""

    moved: list[dict[str, int]]
    peaks: dict[str, int]


@contextmanager
def _ledger_trainer(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    device: torch.device | None,
    world: World | None,
) -> Iterator[StreamedTrainer]:
    """The trainer ``cfg`` builds over a ledger store configured as ``store_cfg`` and the ledger substrate (no
    clipped steps), closed after the block; what it says of the run it builds held back (a replay is no run)."""
    ledger = dataclasses.replace(store_cfg, ledger=True, device=device or store_cfg.device)
    with held_back("tiertune", logging.WARNING):
        trainer = StreamedTrainer(model_dir, ledger, cfg, world=world, compute=Ledger((), cfg.max_grad_norm))
    try:
        yield trainer
    finally:
        trainer.close()


def _peaks(trainer: StreamedTrainer) -> dict[str, int]:
    return {t: s.peak for t, s in trainer.store_stats().tiers.items()}


def replay_decoding(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    passes: int = 3,
    device: torch.device | None = None,
    world: World | None = None,
) -> Decoded:
    """``passes`` passes of a batched decoding (GRPO's sampling) of the model at ``model_dir`` on a ledger store
    configured as ``store_cfg``: each decoder layer's weights acquired once a pass, as ``generate`` does, over
    the store's own placement, eviction and prefetch."""
    from tiertune.engine.generate import ledger_decoding

    with _ledger_trainer(model_dir, store_cfg, cfg, device, world) as trainer:
        moved = ledger_decoding(trainer, passes)
        return Decoded(moved, _peaks(trainer))


def replay_frozen_passes(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    batches: Sequence[dict[str, torch.Tensor]],
    passes: int,
    head: Any = None,
    device: torch.device | None = None,
    world: World | None = None,
) -> Decoded:
    """``passes`` passes of a frozen model beside a trained one (``StreamedTrainer.sequence_logps`` with
    ``repeat``, ``head`` its figures: GRPO's reference of a full fine-tune) over ``batches``, on a ledger store
    configured as ``store_cfg``: the bytes each pass moved, by link (the first from cold, the next with what the
    budgets kept), and each tier's peak."""
    from tiertune.engine.generate import moved_by_pass

    with _ledger_trainer(model_dir, store_cfg, cfg, device, world) as trainer:
        moved = moved_by_pass(trainer, passes, lambda: trainer.sequence_logps(batches, head, repeat=True))
        return Decoded(moved, _peaks(trainer))


def micro_batch(cfg: EngineConfig, rows: int, tokens: int) -> dict[str, torch.Tensor]:
    """A micro-batch of the run's shape: ``rows`` sequences of ``tokens``, or for a preference objective
    ``rows`` pairs (their chosen, then rejected sequences; KTO's labels; a full fine-tune's reference
    log-probabilities, computed before training)."""
    objective = cfg.objective
    if objective.rollouts:  # GRPO's completions, each with its advantage
        return {"input_ids": torch.zeros(rows, tokens, dtype=torch.long), "advantages": torch.zeros(rows)}
    if not objective.paired:
        return {"input_ids": torch.zeros(rows, tokens, dtype=torch.long)}
    batch = {"input_ids": torch.zeros(2 * rows, tokens, dtype=torch.long), "pairs": torch.tensor(rows)}
    if objective.type == "kto":
        batch["label"] = torch.ones(rows, dtype=torch.bool)
    if objective.reference and cfg.method != "lora":
        batch["ref_logps"] = torch.zeros(2 * rows)
    return batch
