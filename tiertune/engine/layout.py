"""The layout of a run's training state: which chunks the engine registers beside the weights for each
trained group (gradients, master weights, moments, GaLore's projections and accumulators, the speculative
step's twins), and the group's ``GroupState`` that holds them. ``state_layout`` (what chunks, where) is a
pure function of sizes: the engine registers what it says; whether the twins are made is the run's plan's
(``engine.memory``)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiertune.distributed.ownership import shard_layout
from tiertune.loading.model import ParamGroup
from tiertune.methods.optim import GaLore, decays, moment_entries
from tiertune.offload.chunk import ALIGN, Chunk, ChunkLayout, pack_tensors, tensor_align
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier
from tiertune.units import format_size

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig

log = logging.getLogger("tiertune.engine")


def gradient_entries(fp32: list, galore: GaLore | None) -> dict[str, list]:
    """The gradient chunks of one weight chunk whose tensors are ``fp32`` entries, by kind: ``grads`` (what
    the optimizer reads: low-rank for GaLore's projected weights) and, with GaLore, ``accum`` (the projected
    weights' full gradients, summed over micro-batches; used only when a step has several)."""
    if galore is None:
        return {"grads": fp32}
    return {"grads": galore.gradient_entries(fp32), "accum": galore.accumulator_entries(fp32)}


def state_entries(
    fp32: list, cfg: EngineConfig, galore: GaLore | None, whole: dict[str, int] | None = None
) -> dict[str, list]:
    """The optimizer's chunks for one weight chunk whose tensors are ``fp32`` entries, by kind: ``master``
    (when the weights are not fp32 and not their own master, ``EngineConfig.fp32_master``), ``exp_avg`` and ``exp_avg_sq`` (8-bit, low-rank for GaLore's projected
    weights) and GaLore's ``proj`` (when the chunk has a projected weight). The engine registers these; the
    estimate lays out the same. ``whole``: the whole tensors' elements where the entries are a rank's parts."""
    eight_bit = cfg.optim == "adamw_bnb_8bit"
    out: dict[str, list] = {"master": fp32} if cfg.fp32_master else {}
    moments = galore.moment_entries(fp32, eight_bit) if galore else moment_entries(fp32, eight_bit, whole)
    out["exp_avg"] = out["exp_avg_sq"] = moments
    proj = galore.projection_entries(fp32) if galore else []
    if proj:
        out["proj"] = proj
    return out


STATE_ROLES = ("weights", "master", "exp_avg", "exp_avg_sq", "proj")
"""The roles of a trained group's chunks whose contents are its state between steps (what a checkpoint keeps)."""

ROLES = {
    "grads": ("grad", "gradients"),
    "accum": ("grad_full", "accumulators"),
    "master": ("master", "master"),
    "exp_avg": ("exp_avg", "moments"),
    "exp_avg_sq": ("exp_avg_sq", "moments"),
    "proj": ("proj", "projections"),
}
"""A state chunk's role (the ``GroupState`` list it joins) -> (its name's suffix, the kind ``estimate`` reports)."""


@dataclass(frozen=True)
class StateChunk:
    """One chunk of a trained weight chunk's state as the layout decides it: the engine registers it
    (``add_states``), ``estimate`` lays out and sums the same."""

    role: str  # a key of ROLES
    entries: list
    home: str  # device, host or disk


def home_tier_used(home: str | Tier, device: torch.device) -> Tier:
    """The tier the CPU optimizer (and the gradient hand-off) uses a chunk homed on ``home`` on: the device
    tier when that is CPU memory, else the host (``cpu_tier`` for a registered chunk)."""
    return Tier.DEVICE if Tier(home) is Tier.DEVICE and device.type == "cpu" else Tier.HOST


def cpu_tier(chunk: Chunk, device: torch.device) -> Tier:
    """Where the CPU optimizer reads registered ``chunk``: the device tier when that is CPU memory, else the
    host (``home_tier_used``)."""
    return home_tier_used(chunk.home, device)


def state_used_on(role: str, home: str | Tier, device: torch.device) -> Tier:
    """The tier a step uses a state chunk of ``role`` homed on ``home`` on: GaLore's projections on the compute
    device, the others where the CPU optimizer works (``home_tier_used``)."""
    return Tier.DEVICE if role == "proj" else home_tier_used(home, device)


def state_layout(
    fp32: list, cfg: EngineConfig, galore: GaLore | None, whole: dict[str, int] | None = None
) -> list[StateChunk]:
    """The state chunks of one weight chunk whose tensors are ``fp32`` entries, in the order the engine
    registers them: gradients; GaLore's full-gradient accumulators when a step has several micro-batches;
    master weights (weights not fp32), the moments and GaLore's projections (read on the compute device).
    ``whole``: the whole tensors' elements where the entries are a rank's flat parts of them (ZeRO-3)."""
    grads = gradient_entries(fp32, galore)
    out = [StateChunk("grads", grads["grads"], cfg.gradients)]
    if grads.get("accum") and cfg.gradient_accumulation_steps > 1:
        out.append(StateChunk("accum", grads["accum"], cfg.gradients))
    states = state_entries(fp32, cfg, galore, whole)
    return out + [StateChunk(role, entries, cfg.optimizer_states) for role, entries in states.items()]


class GroupState:
    """A parameter group's chunks, one entry per weight chunk: weights (compute dtype), fp32 gradients, the
    optimizer's sources (fp32 master weights, or the weights themselves when they are fp32, the Adam
    moments and, with GaLore, the projections) and, when the step is speculative, their twins that receive
    the new values."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group
        self.weights: list[Chunk] = group.chunks
        # the tensors weight decay applies to, decided on their whole shapes (a rank of several holds parts)
        self.decayed = {n for n, p in group.params.items() if decays(p)}
        self.grads: list[Chunk] = []
        # empty when the weights are their own master copy (fp32, or bf16 with ``master_weights`` bfloat16)
        self.master: list[Chunk] = []
        self.exp_avg: list[Chunk] = []
        self.exp_avg_sq: list[Chunk] = []
        # GaLore, per weight chunk (None for a chunk with no projected weight): the projections, and the
        # full-gradient accumulators of its projected weights (added when a step first has several
        # micro-batches, or up front when the config says it will)
        self.proj: list[Chunk | None] = []
        self.accum: list[Chunk | None] = []
        self.twins: list[tuple[Chunk, ...]] = []  # twins of sources(j), per j

    @property
    def trainable(self) -> bool:
        """Whether the group's weights are trained (full fine-tuning) rather than a frozen base."""
        return bool(self.grads)

    def sources(self, j: int) -> tuple[Chunk, ...]:
        """The chunks the optimizer reads and rewrites for weight chunk ``j``: master weights and moments."""
        master = self.master[j] if self.master else self.weights[j]
        return (master, self.exp_avg[j], self.exp_avg_sq[j])

    def reads(self, j: int) -> tuple[Chunk, ...]:
        """Every state chunk the optimizer reads for weight chunk ``j``: the sources and GaLore's projection
        (which backward writes, the optimizer only reads)."""
        proj = self.proj[j] if self.proj else None
        return self.sources(j) + ((proj,) if proj is not None else ())


def laid_states(
    weights: ChunkLayout,
    cfg: EngineConfig,
    galore: GaLore | None,
    whole: ChunkLayout | None = None,
) -> list[tuple[StateChunk, ChunkLayout]]:
    """The state chunks of weight chunk ``weights`` (``state_layout``), each laid out as ``add_like`` lays it
    out. For a rank's shard of the chunk ``whole`` (ZeRO-3) each is as large as the largest rank's: ranks own
    different elements, and with equal capacities on every rank one memory plan (``engine.memory``) holds for
    all of them."""
    shards = whole.num_shards if whole is not None else 1
    numel = {t.name: math.prod(t.shape) for t in whole.tensors} if whole is not None else None

    def laid(chunk: ChunkLayout) -> list[tuple[StateChunk, ChunkLayout]]:
        fp32 = [(t.name, t.shape, torch.float32) for t in chunk.tensors]
        return [(spec, _one_chunk(spec.entries, shards)) for spec in state_layout(fp32, cfg, galore, numel)]

    mine = laid(weights)
    if whole is None:
        return mine
    largest: dict[str, int] = defaultdict(int)
    for rank in range(shards):
        for spec, layout in laid(shard_layout(whole, rank, shards)):
            largest[spec.role] = max(largest[spec.role], layout.capacity)
    return [(spec, dataclasses.replace(layout, capacity=largest[spec.role])) for spec, layout in mine]


def _one_chunk(entries: list, num_shards: int) -> ChunkLayout:
    """``entries`` in one chunk, never split; a rank's shard with no tensors: one empty page (its state chunks
    are empty too)."""
    if not entries:
        return ChunkLayout((), ALIGN)
    size = sum(math.prod(shape) * 4 for _, shape, _ in entries)
    [layout] = pack_tensors(entries, max(size, 1) + tensor_align(num_shards) * len(entries), num_shards)
    return layout


def add_states(
    store: ChunkStore,
    group: ParamGroup,
    cfg: EngineConfig,
    galore: GaLore | None,
    read_master: Callable[[str, torch.Tensor], None],
    wholes: Mapping[int, ChunkLayout] | None = None,
) -> GroupState:
    """Register the training state of trained group ``group`` (its weight chunks already in ``store``): per
    weight chunk, fp32 gradients (``gradient_entries``), master weights read by ``read_master(name, view)``
    when the weights are not fp32, the moments and GaLore's projections (``state_entries``), laid out by
    ``laid_states``. ``wholes``: one rank's of several, the whole chunk of each of its shards by chunk id (``Zero.full``)."""
    state = GroupState(group)
    for j, chunk in enumerate(group.chunks):
        whole = (wholes or {}).get(chunk.id)
        for spec, layout in laid_states(chunk.layout, cfg, galore, whole):
            [added] = store.add_layouts([layout], spec.home, f"{chunk.name}.{ROLES[spec.role][0]}")
            getattr(state, spec.role).append(added)
            if spec.role == "master":
                with store.writing(added) as views:
                    for name, view in views.items():
                        read_master(name, view)
        if galore is not None:  # one entry per weight chunk: None where it projects no weight
            for roles in (state.accum, state.proj):
                roles += [None] * (j + 1 - len(roles))
    return state


def add_accumulator(store: ChunkStore, state: GroupState, j: int, galore: GaLore, home: str) -> Chunk | None:
    """GaLore's full-gradient accumulator of weight chunk ``j`` of ``state``, registered on ``home`` on first
    use (None when the chunk has no projected weight)."""
    if state.accum[j] is None:
        entries = [(s.name, s.shape, torch.float32) for s in state.weights[j].tensors]
        full = galore.accumulator_entries(entries)
        if full:
            name = f"{state.weights[j].name}.{ROLES['accum'][0]}"
            state.accum[j] = add_like(store, full, home, name)[0]
    return state.accum[j]


def add_like(store: ChunkStore, entries: list, home: str | Tier, name: str) -> list[Chunk]:
    """One chunk holding ``entries`` (the fp32 twin of a weight chunk: never split, whatever its size), laid out
    by ``_one_chunk``."""
    return store.add_layouts([_one_chunk(entries, store.config.num_shards)], home, name)


def add_twins(store: ChunkStore, states: list[GroupState], cfg: EngineConfig) -> bool:
    """Decide whether the optimizer overlaps backward; add the twin states that needs. Returns the choice.

    Without clipping, updating in place during backward is exact. With clipping, the coefficient is
    known only after the last gradient, so the step runs speculatively with coefficient 1 into twins of
    the master weights and moments, and is confirmed (the twins exchanged in, no copy) or redone from
    the untouched originals with the real coefficient. The twins cost 12 bytes per parameter on the
    optimizer states' tier (plus 4 on the weights' tier when the weights are fp32). The run's plan decides
    whether they are made (``cfg.twins``, ``engine.memory``); an engine built without one makes them, with
    ``auto``, when their homes fit the room its store has left.
    """
    mode = cfg.overlap_optimizer
    if mode == "off" or cfg.delay_update:  # (a delayed update knows its norm before it starts)
        return False
    if not cfg.clips:
        return True
    twins = cfg.twins
    if twins is None:
        need: dict[Tier, int] = defaultdict(int)
        for state in states:
            for c in (c for j in range(len(state.weights)) for c in state.sources(j)):
                need[c.home] += c.capacity
        twins = mode == "on" or all(n <= store.room(t) for t, n in need.items())
        if not twins:
            short = ", ".join(
                f"{format_size(n)} on {t.value} ({format_size(store.room(t))} free)" for t, n in need.items()
            )
            log.info(
                "optimizer after backward, not overlapped: its speculative twin states need %s; "
                "raise the budgets (or offload.optimizer_states: disk) to overlap it",
                short,
            )
    if twins:
        _register_twins(store, states)
    return twins


def _register_twins(store: ChunkStore, states: list[GroupState]) -> None:
    for state in states:
        for j in range(len(state.weights)):
            state.twins.append(
                tuple(store.add_layouts([c.layout], c.home, f"{c.name}.twin")[0] for c in state.sources(j))  # type: ignore[misc]
            )


def state_chunks(states: list[GroupState], units: list[tuple[GroupState, int]] | None = None) -> list[Chunk]:
    """The chunks whose contents are the training state between steps: weights, master weights, moments
    and projections of the trained groups (gradients and twins are empty then; a frozen base is the input
    model's). In model order, or, given the optimizer's ``units``, in the order it changes them."""
    if units is not None:
        return [c for s, j in units if s.trainable for c in (s.weights[j], *s.reads(j))]
    out: list[Chunk] = []
    for state in states:
        if state.trainable:
            out += state.weights + state.master + state.exp_avg + state.exp_avg_sq
            out += [c for c in state.proj if c is not None]
    return out


def state_bytes(states: list[GroupState]) -> dict[str, int]:
    """Bytes of each kind of training state in the store (chunk capacities): ``weights`` (compute dtype,
    quantized where the base is), ``gradients``, ``master`` weights, ``moments`` (both of Adam's),
    ``projections`` (GaLore) and ``twins`` (the speculative step's copies of master weights and moments).
    Optimizer state is master + moments + projections. ``gradients`` counts GaLore's full-gradient
    accumulators too (there only with gradient accumulation)."""
    out = dict.fromkeys(("weights", "gradients", "master", "moments", "projections", "twins"), 0)
    for state in states:
        kinds = {
            "weights": state.weights,
            "gradients": state.grads + [c for c in state.accum if c is not None],
            "master": state.master,
            "moments": state.exp_avg + state.exp_avg_sq,
            "projections": [c for c in state.proj if c is not None],
            "twins": [c for twins in state.twins for c in twins],
        }
        for kind, chunks in kinds.items():
            out[kind] += sum(c.capacity for c in chunks)
    return out
