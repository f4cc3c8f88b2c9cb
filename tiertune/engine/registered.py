"""The chunks a run registers, read from the engine's own build: a ``StreamedTrainer`` built on a ledger store
(``StoreConfig.ledger``: nothing is read, nothing allocated) registers every chunk a run of the recipe would,
through the run's own loader, layout, stash and sharding, from a checkpoint or from a config.json and
safetensors headers alone, and its step holds what a run's step holds (``ChunkStore.moments``). ``lay_out``
turns those into the plan's chunks and moments (``engine.memory``) and decides, over them, how many
micro-batches a wave runs and whether the speculative step's twins are made; ``train`` checks the plan before
loading, ``estimate`` reports it and replays steps under the run's budgets.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from tiertune.distributed.world import World
from tiertune.engine.layout import ROLES, home_tier_used, state_used_on
from tiertune.engine.memory import (
    IN_PLACE,
    QUANT_CACHE,
    Moments,
    Plan,
    PlannedChunk,
    fit_twins,
    fit_wave,
    make_plan,
)
from tiertune.engine.schedule import waves
from tiertune.engine.stash import ChunkStash
from tiertune.files import nearest_existing
from tiertune.logs import held_back
from tiertune.offload.chunk import pack_tensors
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import Tier

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig
    from tiertune.engine.trainer import StreamedTrainer

UNBOUNDED = 1 << 62
"""A ledger build's budgets: every chunk is registered, whatever the run's budgets are."""


@dataclass
class Laid:
    """What ``lay_out`` read from the ledger build and its step: the chunks (the wave's boundaries and the
    twins as decided), what the step's holders held at once (``ChunkStore.moments``), the parameters (all,
    and those trained), the micro-batches a wave runs and the disk's free bytes the twins were decided on."""

    chunks: list[PlannedChunk]
    moments: Moments
    parameters: int
    trained: int
    wave: int
    disk_free: int

    @cached_property
    def plan(self) -> Plan:
        """The memory plan (``engine.memory``) of these chunks and moments."""
        return make_plan(self.chunks, self.moments)

    def applied(self, store_cfg: StoreConfig, cfg: EngineConfig) -> tuple[StoreConfig, EngineConfig]:
        """``store_cfg`` and ``cfg`` as the run takes them: the plan's reserved slots, the twins and the wave."""
        twins = any(c.role == "twin" for c in self.chunks)
        return (
            dataclasses.replace(store_cfg, reserve=self.plan.store_reserve()),
            dataclasses.replace(cfg, twins=twins, wave_size=self.wave),
        )


def lay_out(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    shape: tuple[int, int],
    notes: list[str] | None = None,
    world: World | None = None,
    disk_free: int | None = None,
) -> Laid:
    """The chunks a run of the model at ``model_dir`` registers under ``store_cfg`` and ``cfg``, what a step of
    micro-batches of ``shape`` (rows, tokens) holds at once, and the wave and twins its budgets allow: with
    activations on the host and ``cfg.wave_size`` 0, the most micro-batches of a step whose boundary chunks fit
    the budgets (decided before the twins, which take the room left); the twins, when asked for or when the run
    fits with them (``disk_free``, by default the room at ``disk_path``, takes their slots). Nothing is loaded:
    what ``train`` checks before loading the model, what ``estimate`` reports. One rank of several (``world``)
    plans rank 0's shards: every rank's chunks have the same capacities (``layout.laid_states``), so every rank
    plans alike. What a reader should know is appended to ``notes``."""
    from tiertune.engine.compute import Ledger
    from tiertune.engine.replay import micro_batch
    from tiertune.engine.trainer import StreamedTrainer

    notes = [] if notes is None else notes
    if disk_free is None:
        disk_free = (
            shutil.disk_usage(nearest_existing(store_cfg.disk_path)).free if store_cfg.disk_path else 0
        )
    if world is not None and world.size > 1:
        world = World(rank=0, size=world.size, local_rank=0, local_size=world.local_size)
    ledger = dataclasses.replace(
        store_cfg,
        ledger=True,
        device_budget=UNBOUNDED,
        host_budget=UNBOUNDED,
        disk_budget=None,
        reserve=None,
    )
    speculates = cfg.trains_base and cfg.overlap_optimizer != "off" and cfg.clips
    built = dataclasses.replace(cfg, twins=True if speculates else cfg.twins)
    k = cfg.gradient_accumulation_steps
    # a build and a step (speculated, clipped, redone: every way the optimizer holds chunks) of two micro-batches
    # (a wave of more holds the same chunks, a step of one accumulates no gradient), no run: its notes are not
    # for users
    with held_back("tiertune", logging.WARNING):
        trainer = StreamedTrainer(
            model_dir, ledger, built, world=world, compute=Ledger([True], cfg.max_grad_norm)
        )
        try:
            _unreadable_quantization(trainer.model.config, model_dir, cfg.quantize, notes)
            chunks = registered(trainer)
            trainer.step([micro_batch(cfg, *shape)] * min(k, 2))
            moments = trainer.store.moments()
            counts = trainer.parameter_counts()
            stash = trainer.stash
        finally:
            trainer.close()
    budgets = {Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget}
    wave = len(waves(cfg, k)[0])
    if isinstance(stash, ChunkStash) and not cfg.wave_size:

        def boundaries(slots: int) -> list[PlannedChunk]:
            """The stash's boundary chunks with ``slots`` slots each, as the store lays them out."""
            entries = ChunkStash.entries(stash.slot, slots, cfg.dtype)
            [lay] = pack_tensors(entries, store_cfg.chunk_size, store_cfg.num_shards)
            return [
                PlannedChunk("activations", "act", c.name, Tier.HOST, lay.capacity, Tier.DEVICE)
                for c in stash.chunks
            ]

        chunks, wave = fit_wave(chunks, moments, k, boundaries, budgets)
        if wave < k:
            notes.append(
                f"the hidden states at the layer boundaries of {k} micro-batches do not fit the budgets: a step "
                f"runs as {-(-k // wave)} waves of {wave} micro-batches, each wave streaming the weights once"
            )
    if speculates and cfg.overlap_optimizer != "on":  # auto: the twins when the run fits with them
        chunks, moments = fit_twins(chunks, moments, budgets, disk_free, int(store_cfg.block_size))
    return Laid(chunks, moments, counts["total"], counts["trained"], wave, disk_free)


def registered(trainer: StreamedTrainer) -> list[PlannedChunk]:
    """Every chunk ``trainer`` registered, as the plan sees it: per parameter group its weights (read in place
    from the model's files, or the quantized cache's images, where they are), then its training state by role
    (``layout.GroupState``) and its twins; then the stash's layer boundaries."""
    store, device = trainer.store, trainer.store.device
    cache = getattr(trainer.quant_cache, "homed", ())
    out: list[PlannedChunk] = []
    for state in trainer.states:
        for c in state.weights:
            in_place = store.in_place(c) is not None
            kind = (QUANT_CACHE if c.name in cache else IN_PLACE) if in_place else "weights"
            out.append(PlannedChunk.of(c, kind, "weights", Tier.DEVICE, in_place=in_place))
        for role, (_, kind) in ROLES.items():
            used = (c for c in getattr(state, role) if c is not None)
            out += [PlannedChunk.of(c, kind, role, state_used_on(role, c.home, device)) for c in used]
        twins = (c for twins in state.twins for c in twins)
        out += [PlannedChunk.of(c, "twins", "twin", home_tier_used(c.home, device)) for c in twins]
    return out + [
        PlannedChunk.of(c, "activations", "act", Tier.DEVICE) for c in getattr(trainer.stash, "chunks", ())
    ]


def _unreadable_quantization(config, model_dir: str, quantize: str, notes: list[str]) -> None:
    """A note when the checkpoint's own quantization is one tiertune cannot read (fp8, GPTQ, AWQ...): a run
    stops with a ModelError before it reads a weight; the ledger built the model with its shapes, as its
    unquantized release would be loaded."""
    from tiertune.errors import ModelError
    from tiertune.quant import saved_quantization

    try:
        saved_quantization(config, model_dir)
    except ModelError as exc:
        notes.append(
            f"{exc}. The figures above are for the same model loaded from bf16 weights (model.quantize: "
            f"{quantize}); `tiertune train` on this model.path stops with this error"
        )


__all__ = ["UNBOUNDED", "Laid", "lay_out", "registered"]
