"""The chunks a run registers, read from the engine's own build: a ``StreamedTrainer`` built on a ledger store
(``StoreConfig.ledger``: nothing is read, nothing allocated) registers every chunk a run of the recipe would,
through the run's own loader, layout, stash and sharding, from a checkpoint or from a config.json and
safetensors headers alone. ``lay_out`` turns what it registered into the plan's chunks (``engine.memory``) and
decides, over them, how many micro-batches a wave runs and whether the speculative step's twins are made;
``train`` checks the plan before loading (``memory_plan``), ``estimate`` reports it and replays a step.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from typing import TYPE_CHECKING, NamedTuple

from tiertune.distributed.world import World
from tiertune.engine.layout import ROLES, home_tier_used, state_used_on
from tiertune.engine.memory import (
    IN_PLACE,
    QUANT_CACHE,
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


class Laid(NamedTuple):
    """What ``lay_out`` read from the ledger build: the chunks (the wave's boundaries and the twins as
    decided), the parameters (all, and those trained: None for LoRA, whose adapters the layout's build does
    not wrap, ``replay`` counts them) and the micro-batches a wave runs."""

    chunks: list[PlannedChunk]
    parameters: int
    trained: int | None
    wave: int


def lay_out(
    model_dir: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    notes: list[str],
    disk_free: int,
    world: World | None = None,
) -> Laid:
    """The chunks a run of the model at ``model_dir`` registers under ``store_cfg`` and ``cfg`` (one rank's of
    ``world``), and the wave and twins its budgets allow: with activations on the host and ``cfg.wave_size``
    0, the most micro-batches of a step whose boundary chunks fit the budgets (decided before the twins, which
    take the room left); the twins, when asked for or when the run fits with them (``disk_free``: the room at
    ``disk_path``). What a reader should know is appended to ``notes``."""
    from tiertune.engine.trainer import StreamedTrainer

    ledger = dataclasses.replace(
        store_cfg,
        ledger=True,
        device_budget=UNBOUNDED,
        host_budget=UNBOUNDED,
        disk_budget=None,
        reserve=None,
    )
    speculates = cfg.method != "lora" and cfg.overlap_optimizer != "off" and cfg.clips
    built = dataclasses.replace(cfg, twins=True if speculates else cfg.twins)
    # a build for its layout, no run: its notes are not for users
    with held_back("tiertune", logging.WARNING):
        trainer = StreamedTrainer(model_dir, ledger, built, world=world, layout_only=True)
    try:
        _unreadable_quantization(trainer.model.config, model_dir, cfg.quantize, notes)
        chunks = registered(trainer)
        counts = trainer.parameter_counts()
        stash = trainer.stash
    finally:
        trainer.close()
    on_cpu = store_cfg.device.type != "cuda"
    budgets = {Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget}
    k = cfg.gradient_accumulation_steps
    wave = len(waves(cfg, k)[0])
    if isinstance(stash, ChunkStash) and not cfg.wave_size:

        def boundaries(slots: int) -> list[PlannedChunk]:
            """The stash's boundary chunks with ``slots`` slots each, as the store packs them."""
            entries = ChunkStash.entries(stash.slot, slots, cfg.dtype)
            layouts = pack_tensors(entries, store_cfg.chunk_size, store_cfg.num_shards)
            return [
                PlannedChunk(
                    "activations", Tier.HOST, lay.capacity, Tier.DEVICE, True, layout=lay, role="act"
                )
                for _ in stash.chunks
                for lay in layouts
            ]

        chunks, wave = fit_wave(chunks, k, boundaries, budgets, on_cpu)
        if wave < k:
            notes.append(
                f"the hidden states at the layer boundaries of {k} micro-batches do not fit the budgets: a step "
                f"runs as {-(-k // wave)} waves of {wave} micro-batches, each wave streaming the weights once"
            )
    if speculates and cfg.overlap_optimizer != "on":  # auto: the twins when the run fits with them
        chunks = fit_twins(chunks, budgets, on_cpu, disk_free, int(store_cfg.block_size))
    return Laid(chunks, counts["total"], None if cfg.method == "lora" else counts["trained"], wave)


def registered(trainer: StreamedTrainer) -> list[PlannedChunk]:
    """Every chunk ``trainer`` registered, as the plan sees it: per parameter group its weights (read in place
    from the model's files, or the quantized cache's images, where they are), then its training state by role
    (``layout.GroupState``) and its twins; then the stash's layer boundaries."""
    store, device = trainer.store, trainer.store.device
    cache = getattr(trainer.quant_cache, "homed", ())
    trained = trainer.config.method != "lora"
    out: list[PlannedChunk] = []
    for gi, state in enumerate(trainer.states):
        layer = state.group.kind == "layer"
        for c in state.weights:
            in_place = store.in_place(c) is not None
            kind = (QUANT_CACHE if c.name in cache else IN_PLACE) if in_place else "weights"
            whole = trainer.sharding.full.get(c.id)  # ZeRO-3: the chunk this rank's shard is part of
            changed = trained and not in_place  # trained weights are written back each step
            out.append(
                PlannedChunk(
                    kind,
                    c.home,
                    c.capacity,
                    Tier.DEVICE,
                    changed,
                    in_place,
                    layer,
                    c.layout,
                    gi,
                    "weights",
                    whole,
                )
            )
        for role, (_, kind) in ROLES.items():
            for c in getattr(state, role):
                if c is not None:
                    tier = state_used_on(role, c.home, device)
                    out.append(
                        PlannedChunk(
                            kind, c.home, c.capacity, tier, True, layout=c.layout, group=gi, role=role
                        )
                    )
        for c in (c for twins in state.twins for c in twins):
            tier = home_tier_used(c.home, device)
            out.append(
                PlannedChunk("twins", c.home, c.capacity, tier, True, layout=c.layout, group=gi, role="twin")
            )
    for c in getattr(trainer.stash, "chunks", ()):
        out.append(
            PlannedChunk("activations", c.home, c.capacity, Tier.DEVICE, True, layout=c.layout, role="act")
        )
    return out


def memory_plan(
    model_path: str, store_cfg: StoreConfig, cfg: EngineConfig, world: World | None = None
) -> tuple[Plan, bool, int]:
    """The run's memory plan (``engine.memory``) for the store and engine settings ``plan`` resolved, from the
    chunks it will register (``lay_out``: nothing is loaded), whether those include the speculative step's
    twins, and the micro-batches a wave runs. What ``train`` checks before loading the model, and what
    ``estimate`` reports. One rank of several (``world``) plans rank 0's shards: every rank's chunks have the
    same capacities (``layout.laid_states``), so every rank plans alike."""
    disk_room = shutil.disk_usage(nearest_existing(store_cfg.disk_path)).free if store_cfg.disk_path else 0
    if world is not None and world.size > 1:
        world = World(rank=0, size=world.size, local_rank=0, local_size=world.local_size)
    laid = lay_out(model_path, store_cfg, cfg, [], disk_room, world)
    on_cpu = store_cfg.device.type != "cuda"
    return make_plan(laid.chunks, on_cpu), any(c.role == "twin" for c in laid.chunks), laid.wave


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


__all__ = ["UNBOUNDED", "Laid", "lay_out", "memory_plan", "registered"]
