"""The layout of a run's training state: which chunks the engine registers beside the weights for each
trained group (gradients, master weights, moments, GaLore's projections and accumulators, the speculative
step's twins), and the group's ``GroupState`` that holds them. ``gradient_entries`` and ``state_entries``
are shared with ``finetune.estimate``."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from tiertune.engine.update import cpu_tier
from tiertune.errors import BudgetError
from tiertune.finetune.model import ParamGroup
from tiertune.finetune.optim import GaLore, moment_entries
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import BUDGET_SETTING, Tier
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


def state_entries(fp32: list, cfg: EngineConfig, galore: GaLore | None) -> dict[str, list]:
    """The optimizer's chunks for one weight chunk whose tensors are ``fp32`` entries, by kind: ``master``
    (when the weights are not fp32), ``exp_avg`` and ``exp_avg_sq`` (8-bit, low-rank for GaLore's projected
    weights) and GaLore's ``proj`` (when the chunk has a projected weight). The engine registers these; the
    estimate lays out the same."""
    eight_bit = cfg.optim == "adamw_bnb_8bit"
    out: dict[str, list] = {"master": fp32} if cfg.dtype != torch.float32 else {}
    moments = galore.moment_entries(fp32, eight_bit) if galore else moment_entries(fp32, eight_bit)
    out["exp_avg"] = out["exp_avg_sq"] = moments
    proj = galore.projection_entries(fp32) if galore else []
    if proj:
        out["proj"] = proj
    return out


class GroupState:
    """A parameter group's chunks, one entry per weight chunk: weights (compute dtype), fp32 gradients, the
    optimizer's sources (fp32 master weights, or the weights themselves when they are fp32, the Adam
    moments and, with GaLore, the projections) and, when the step is speculative, their twins that receive
    the new values."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group
        self.weights: list[Chunk] = group.chunks
        self.grads: list[Chunk] = []
        self.master: list[Chunk] = []  # empty when the weights are fp32 (their own master copy)
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


def add_states(
    store: ChunkStore,
    group: ParamGroup,
    cfg: EngineConfig,
    galore: GaLore | None,
    read_master: Callable[[str, torch.Tensor], None],
) -> GroupState:
    """Register the training state of trained group ``group`` (its weight chunks already in ``store``): per
    weight chunk, fp32 gradients (``gradient_entries``), master weights read by ``read_master(name, view)``
    when the weights are not fp32, the moments and GaLore's projections (``state_entries``)."""
    state = GroupState(group)
    for chunk in group.chunks:
        entries = [(s.name, s.shape, torch.float32) for s in chunk.tensors]
        add = partial(add_like, store, entries)
        grads = gradient_entries(entries, galore)
        state.grads += add_like(store, grads["grads"], cfg.gradients, f"{chunk.name}.grad")
        if galore is not None:
            state.accum.append(None)
            if cfg.gradient_accumulation_steps > 1:
                add_accumulator(store, state, len(state.accum) - 1, galore, cfg.gradients)
        states = state_entries(entries, cfg, galore)
        if "master" in states:
            masters = add(cfg.optimizer_states, f"{chunk.name}.master")
            state.master += masters
            with store.writing(masters[0]) as views:
                for name, view in views.items():
                    read_master(name, view)
        home = cfg.optimizer_states
        state.exp_avg += add_like(store, states["exp_avg"], home, f"{chunk.name}.exp_avg")
        state.exp_avg_sq += add_like(store, states["exp_avg_sq"], home, f"{chunk.name}.exp_avg_sq")
        if galore is not None:
            proj = states.get("proj")
            state.proj.append(add_like(store, proj, home, f"{chunk.name}.proj")[0] if proj else None)
    return state


def add_accumulator(store: ChunkStore, state: GroupState, j: int, galore: GaLore, home: str) -> Chunk | None:
    """GaLore's full-gradient accumulator of weight chunk ``j`` of ``state``, registered on ``home`` on first
    use (None when the chunk has no projected weight)."""
    if state.accum[j] is None:
        entries = [(s.name, s.shape, torch.float32) for s in state.weights[j].tensors]
        full = galore.accumulator_entries(entries)
        if full:
            name = f"{state.weights[j].name}.grad_full"
            state.accum[j] = add_like(store, full, home, name)[0]
    return state.accum[j]


def add_like(store: ChunkStore, entries: list, home: str | Tier, name: str) -> list[Chunk]:
    """One chunk holding ``entries`` (the fp32 twin of a weight chunk: never split, whatever its size)."""
    size = sum(math.prod(shape) * 4 for _, shape, _ in entries)
    return store.add(entries, home=home, name=name, chunk_size=max(size, 1) + 256 * len(entries))


def unit_host_bytes(state: GroupState, j: int, twins: bool, device: torch.device) -> int:
    """Host bytes one optimizer unit pins: gradients and sources (or their twins), plus one source
    while it is copied into its twin."""
    on_host = [c for c in (state.grads[j], *state.reads(j)) if cpu_tier(c, device) is Tier.HOST]
    pinned = sum(c.capacity for c in on_host if c.home is not Tier.HOST)
    return pinned + (max((c.capacity for c in on_host[1:]), default=0) if twins else 0)


def add_twins(store: ChunkStore, states: list[GroupState], cfg: EngineConfig, device: torch.device) -> bool:
    """Decide whether the optimizer overlaps backward; add the twin states that needs. Returns the choice.

    Without clipping, updating in place during backward is exact. With clipping, the coefficient is
    known only after the last gradient, so the step runs speculatively with coefficient 1 into twins of
    the master weights and moments, and is confirmed (the twins exchanged in, no copy) or redone from
    the untouched originals with the real coefficient. The twins cost 12 bytes per parameter on the
    optimizer states' tier (plus 4 on the weights' tier when the weights are fp32).
    """
    mode = cfg.overlap_optimizer
    if mode == "off":
        return False
    if not cfg.clips:
        return True
    need: dict[Tier, int] = defaultdict(int)
    for state in states:
        for j in range(len(state.weights)):
            for chunk in state.sources(j):
                need[chunk.home] += chunk.capacity
    short = {t: n for t, n in need.items() if n > store.room(t)}
    # the worker holds one unit on the host (gradients, sources, twins) while backward holds a chunk of
    # gradients there
    unit = max(unit_host_bytes(s, j, True, device) for s in states for j in range(len(s.weights)))
    working = need.get(Tier.HOST, 0) + unit + max(c.capacity for s in states for c in s.grads)
    if working > store.room(Tier.HOST):
        short[Tier.HOST] = working
    if short and mode == "on":
        tier, needed = next(iter(short.items()))
        raise BudgetError(
            tier.value,
            needed,
            store.room(tier),
            BUDGET_SETTING[tier],
            "for the optimizer overlapped with backward: twin optimizer states, and one chunk's optimizer "
            "working set on the host; or set offload.overlap_optimizer: false",
        )
    if short:
        detail = ", ".join(
            f"{format_size(n)} on {t.value} ({format_size(store.room(t))} free)" for t, n in short.items()
        )
        log.info(
            "optimizer after backward, not overlapped: its speculative twin states need %s; "
            "raise the budgets (or offload.optimizer_states: disk) to overlap it",
            detail,
        )
        return False
    for state in states:
        for j in range(len(state.weights)):
            state.twins.append(
                tuple(add_like(store, entries_of(c), c.home, f"{c.name}.twin")[0] for c in state.sources(j))  # type: ignore[misc]
            )
    return True


def entries_of(chunk: Chunk) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(s.name, s.shape, s.dtype) for s in chunk.tensors]


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
