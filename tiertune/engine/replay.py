"""A run's training step replayed on a ledger: the bytes each tier holds and each link moves, counted by the
store's own code.

``replay`` registers the run's chunks (the ``PlannedChunk`` list ``estimate.report`` lays out, in the order
the trainer registers them) in a ``ChunkStore`` that is a ledger (``StoreConfig.ledger``: the same placement,
eviction, prefetch and trace, over no bytes), and makes the calls a step makes, in the engine's order
(``engine.trainer.step``, ``engine.schedule``, ``engine.gradients``, ``engine.update``): per wave of
micro-batches the groups outside the decoder layers bound, each layer's weights acquired once in forward and
once in backward (which recomputes it), the boundary chunks of the layers' inputs written and read when those
are chunks, each layer's gradients added on the host once (GaLore's accumulators and projections beside them); the optimizer's units on their tier, into the twins when the step
speculates, during backward when it overlaps; the twins exchanged in. The optimizer worker's calls are made
in turn with the compute thread's (the worker keeping up with backward), and each transfer finishes by the
store's next call. So what a step moves comes from the schedule the engine runs, with every micro-batch, and
a change to that schedule is a change here, checked against runs by ``tests/finetune/test_estimate.py``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiertune.engine.config import EngineConfig
from tiertune.engine.layout import home_tier_used
from tiertune.engine.memory import IN_PLACE, QUANT_CACHE, PlannedChunk
from tiertune.engine.schedule import waves as schedule_waves
from tiertune.engine.stash import ChunkStash, DeviceStash, Stash, stash_slots
from tiertune.offload.chunk import Chunk
from tiertune.offload.inplace import InPlace
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier

STATE_ROLES = ("grads", "accum", "master", "exp_avg", "exp_avg_sq", "proj")


@dataclass
class Replayed:
    """What the ledger counted: per tier its peak bytes over the replayed steps; per link (``disk->host``...)
    the bytes the last step moved; per memory tier and size class the most chunks in use at once."""

    peaks: dict[str, int]
    moved: dict[str, int]
    in_use: dict[str, dict[int, int]] = field(default_factory=dict)


@dataclass
class _Unit:
    """One weight chunk of a trained group and its state, by role; its twins (the sources' order)."""

    weights: Chunk
    roles: dict[str, Chunk] = field(default_factory=dict)
    twins: list[Chunk] = field(default_factory=list)

    def sources(self) -> list[Chunk]:
        return [self.roles.get("master", self.weights), self.roles["exp_avg"], self.roles["exp_avg_sq"]]

    def reads(self) -> list[Chunk]:
        return self.sources() + ([self.roles["proj"]] if "proj" in self.roles else [])


@dataclass
class _Group:
    layer: bool
    weights: list[Chunk] = field(default_factory=list)
    units: list[_Unit] = field(default_factory=list)


CLIPPED = (True, False, False, False)
"""Which replayed steps are clipped, by default: the first (speculated, then redone with the coefficient),
so the second runs the optimizer after backward and the last two speculate and are confirmed. Every way a
step's update runs is in the peaks; the bytes moved are the last step's, the steady state of a run whose
steps are not clipped."""


def replay(
    chunks: Sequence[PlannedChunk],
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    micro_batches: int,
    clipped: Sequence[bool] = CLIPPED,
    device: torch.device | None = None,
) -> Replayed:
    """Replay ``len(clipped)`` training steps of ``micro_batches`` micro-batches over ``chunks`` on a ledger
    store configured as ``store_cfg`` (its budgets and the plan's reserve). ``clipped[k]``: whether step k's
    gradient norm is above ``max_grad_norm`` (the engine speculates on a step unless the one before was
    clipped, and redoes a speculative step that is). The first step records the trace, as in a run; the bytes
    moved are the last step's. ``device``: what the run computes on (default: the store's), which decides the
    tier the CPU optimizer uses a chunk homed on the device on (``layout.home_tier_used``)."""
    store = ChunkStore(dataclasses.replace(store_cfg, ledger=True))
    device = device or store_cfg.device
    try:
        groups, stash = _register(store, chunks)
        step = _Step(store, cfg, device, groups, stash)
        before: dict[str, int] = {}
        for number, clip in enumerate(clipped, start=1):
            before = dict(store.stats().bytes_moved)
            last_clipped = number > 1 and cfg.clips and clipped[number - 2]
            step.run(number, micro_batches, step.overlap and not last_clipped, cfg.clips and clip)
        stats = store.stats()
        moved = {k: n - before.get(k, 0) for k, n in stats.bytes_moved.items() if n - before.get(k, 0)}
        return Replayed({t: s.peak for t, s in stats.tiers.items()}, moved, store.in_use_peaks())
    finally:
        store.close()


def _register(store: ChunkStore, chunks: Sequence[PlannedChunk]) -> tuple[list[_Group], list[Chunk]]:
    """Register ``chunks`` in the trainer's order: every group's weights (``engine.loaded``), then each trained
    group's states (``layout.add_states``), the boundary chunks (``stash.ChunkStash``), the twins
    (``layout.add_twins``). ``chunks`` come in the estimate's order: a weight chunk, then its states."""
    groups: dict[int, _Group] = {}
    units: list[tuple[_Unit, list[PlannedChunk]]] = []
    acts: list[PlannedChunk] = []
    twins: list[PlannedChunk] = []
    for c in chunks:
        if c.role == "weights":
            group = groups.setdefault(c.group, _Group(c.layer))
            chunk = _add(store, c)
            group.weights.append(chunk)
            units.append((_Unit(chunk), []))
            group.units.append(units[-1][0])
        elif c.role in STATE_ROLES:
            units[-1][1].append(c)
        elif c.role == "twin":
            twins.append(c)
        elif c.role == "act":
            acts.append(c)
        else:
            raise ValueError(f"a planned chunk of role {c.role!r} has no place in the replay")
    trained: list[_Unit] = []
    for unit, states in units:
        for c in states:
            unit.roles[c.role] = _add(store, c)
        if states:
            trained.append(unit)
    stash = [_add(store, c) for c in acts]
    if twins:  # three per trained unit, in its sources' order (``layout.add_twins``)
        for unit, twin in zip([u for u in trained for _ in range(3)], twins, strict=True):
            unit.twins.append(_add(store, twin))
    for group in groups.values():  # a frozen group's chunks are weights alone: no unit of the optimizer
        group.units = [u for u in group.units if u.roles]
    return [groups[g] for g in sorted(groups)], stash


def _add(store: ChunkStore, c: PlannedChunk) -> Chunk:
    """Register ``c`` and fill it as the run does: weights as the loader streams them in (through the host
    for a disk home), master weights from them (``layout.add_states``); the rest start empty."""
    assert c.layout is not None
    if c.kind == IN_PLACE:  # frozen bytes in the model's files: no slot, never written
        return store.add_placed([(c.layout, InPlace((), ()))], c.kind)[0]
    name = f"{c.kind}.{c.role}"
    if c.kind == QUANT_CACHE:  # quantized on load into the cache (a first run), then read in place from it
        [chunk] = store.add_layouts([c.layout], c.home, name, in_file=True)
        with store.writing(chunk):
            pass
        store.home_in_file(chunk, Path("quantized cache"))
        return chunk
    [chunk] = store.add_layouts([c.layout], c.home, name)
    if c.role in ("weights", "master"):
        with store.writing(chunk):
            pass
    return chunk


class _Step:
    """The store calls of one training step, in the engine's order."""

    def __init__(
        self,
        store: ChunkStore,
        cfg: EngineConfig,
        device: torch.device,
        groups: list[_Group],
        stash: list[Chunk],
    ) -> None:
        self.store, self.cfg, self.device = store, cfg, device
        # the layer boundaries: the engine's stash over the ledger (``stash.ChunkStash``), else tensors of
        # no bytes (activations on the device, outside the store)
        self.boundaries: Stash = (
            ChunkStash(store, stash, stash_slots(cfg), defaultdict(float))
            if stash
            else DeviceStash(torch.device("meta"), cfg.dtype)
        )
        self.layers = [g for g in groups if g.layer]
        self.others = [g for g in groups if not g.layer]
        # the optimizer's units in the order backward finishes them (``StreamedTrainer.units``)
        self.order = [u for g in [*reversed(self.layers), *self.others] for u in g.units]
        twins = any(u.twins for u in self.order)
        # ``layout.add_twins``: overlapped when not clipping, or with the twins of a speculative step
        self.overlap = cfg.overlap_optimizer != "off" and (not cfg.clips or twins)
        self.speculating = self.overlap  # the step being run's (``run``)

    def run(self, number: int, micro_batches: int, speculating: bool, clipped: bool) -> None:
        """One step (``StreamedTrainer.step``, ``engine.schedule``, ``Updater.finish``): per wave of
        micro-batches each layer visited once in forward and once in backward; ``speculating``, the optimizer
        runs during backward, and again after it when the step is ``clipped``; else after backward."""
        store = self.store
        self.speculating = speculating
        waves = schedule_waves(self.cfg, micro_batches)
        for w, wave in enumerate(waves):
            first, last = w == 0, w == len(waves) - 1
            for group in self.others:  # bound for the whole wave
                self._weights(group)
            # the boundaries as the engine's own stash opens, closes and sends them home (views of no bytes)
            shapes = [torch.Size([1])] * len(wave)
            boundaries = self.boundaries
            boundaries.open(0, shapes, write=True)  # the prefix: the embeddings' output
            for i, group in enumerate(self.layers):  # forward: boundary i through layer i into i + 1
                boundaries.settle()
                self._weights(group)
                boundaries.open(i + 1, shapes, write=True)
                self._release(group.weights)
                boundaries.close(i, keep=True)
            boundaries.close(len(self.layers), keep=False)  # the suffix: the loss on the last boundary
            for i in reversed(range(len(self.layers))):  # backward: boundary i, the weights again
                group = self.layers[i]
                boundaries.settle()
                boundaries.open(i, shapes, write=False)
                self._weights(group)
                self._release(group.weights)
                boundaries.close(i, keep=False)
                self._grads(group, number, first, last)
                self._overlapped(group, last)  # the worker waits for the weights it writes to be released
            for group in reversed(self.others):
                self._release(group.weights)
            for group in self.others:
                self._grads(group, number, first, last)
                self._overlapped(group, last)
        if not speculating or clipped:  # after backward, or redone from the untouched sources
            for unit in self.order:
                self._update(unit)
        for unit in self.order:  # the twins hold the new states: exchanged in, no byte copied
            for source, twin in zip(unit.sources(), unit.twins, strict=False):
                store.exchange(source, twin)
                store.discard(twin)
            if unit.twins:
                store.discard(unit.roles["grads"])
        store.mark_step()

    def _weights(self, group: _Group) -> None:
        for chunk in group.weights:
            self.store.acquire(chunk, Tier.DEVICE)

    def _release(self, chunks: list[Chunk]) -> None:
        for chunk in reversed(chunks):
            self.store.release(chunk)

    def _grads(self, group: _Group, number: int, first: bool, last: bool) -> None:
        """``GradientSink.add`` of a wave: each unit's gradients on the host (GaLore: its accumulator and
        projection); ``first``, ``last``: the step's first and last wave."""
        store = self.store
        for unit in group.units:
            grads = unit.roles["grads"]
            store.acquire(grads, Tier.HOST, overwrite=first)
            if "proj" in unit.roles:
                accum = unit.roles.get("accum") if not (first and last) else None
                if accum is not None:
                    store.acquire(accum, Tier.HOST, overwrite=first)
                if last:
                    refresh = (number - 1) % self.cfg.galore.update_proj_gap == 0
                    store.acquire(unit.roles["proj"], Tier.DEVICE)
                    store.release(unit.roles["proj"], dirty=refresh)
                if accum is not None:
                    store.release(accum, dirty=not last)
                    if last:
                        store.discard(accum)
            store.release(grads, dirty=True)

    def _overlapped(self, group: _Group, last: bool) -> None:
        """The optimizer during backward: a group's units once its last wave's gradients are in."""
        if last and self.speculating:
            for unit in group.units:
                self._update(unit)

    def _update(self, unit: _Unit) -> None:
        """``Updater.unit`` on the optimizer worker, which first prefetches the next units' states."""
        store = self.store
        at = self.order.index(unit)
        store.prefetch([c for u in self.order[at + 1 : at + 3] for c in u.reads()])
        held: list[tuple[Chunk, bool]] = []

        def get(chunk: Chunk, source: Chunk | None = None, dirty: bool = True) -> None:
            store.acquire(chunk, home_tier_used(chunk.home, self.device), traced=False, copy_from=source)
            held.append((chunk, dirty))

        get(unit.roles["grads"], dirty=False)
        if unit.twins:
            for twin, source in zip(unit.twins, unit.sources(), strict=True):
                get(twin, source)
        else:
            for source in unit.sources():
                get(source)
        if "proj" in unit.roles:
            get(unit.roles["proj"], dirty=False)
        if "master" in unit.roles:
            with store.writing(unit.weights):
                pass
        for chunk, dirty in reversed(held):
            store.release(chunk, dirty=dirty)
        if not unit.twins:
            store.discard(unit.roles["grads"])
