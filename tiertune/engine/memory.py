"""The run's memory plan: what each memory tier must hold for a training step never to fail for room.

A tier holds the chunks homed on it for the whole run, and copies of chunks homed lower while a step uses
them. A copy in use (acquired) cannot be evicted, so the tier must always have room for every chunk that can
be in use on it at once; and the room must be contiguous where it is needed, which a shared arena cannot
promise (copies in use split it into gaps). So the plan reserves *slots*: per size class, as many slots as
chunks of that class can be in use on the tier at once, counted from the engine's step over the run's own
chunk layout. The store places a chunk in a slot of its class when its arena has no room
(``offload.tiers.MemoryTier``); the arena holds the homes and caches what it can beyond them.

Who holds chunks in use at once is what the engine's parts hold on a step: ``engine.registered`` builds the
run's ``StreamedTrainer`` on a ledger store and runs a step, and the store records, per holder (the compute
thread; the optimizer, whose units the ledger runs inline), every set of chunks it held in use at once on a
memory tier they are not homed on, scratch space included, and each chunk homed on disk staged through the
host to the device (``ChunkStore.moments``). A holder's count per class is the most any one of its moments
needs; the tier's is the sum over the holders (their moments may coincide). The checkpoint writer reads one
chunk at a time and never waits while holding it: it takes what is free and needs no slot of its own.
``finetune.train`` checks the plan against the budgets before the model is loaded and gives the store its
``reserve``; ``estimates.report`` reports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tiertune.offload.chunk import ALIGN, Chunk
from tiertune.offload.disk import slot_bytes
from tiertune.offload.store import Held
from tiertune.offload.tiers import BUDGET_SETTING, Tier, slot_class
from tiertune.units import format_size, round_up

MEMORY = (Tier.DEVICE, Tier.HOST)
IN_PLACE = "weights, read in place"  # a planned chunk's kind: frozen weights read from the model's own files
QUANT_CACHE = "weights, quantized cache"  # quantized on load (written once), read in place from the cache
Moments = Mapping[str, Iterable[frozenset[Held]]]
"""Per holder (the compute thread, the optimizer), every set of chunks it holds in use at once on a step
(``ChunkStore.moments``, recorded on a ledger)."""
CLASS_SPREAD = 1.25
"""Chunks whose sizes are within this factor of a class's smallest share its slots (each slot the size of the
class's largest): fewer classes, so fewer slots summed over classes whose chunks are never in use together."""


@dataclass
class PlannedChunk:
    """One chunk the run registers, as the plan sees it."""

    kind: str  # weights (or read in place / quantized cache), gradients, master, moments, ..., activations
    role: str  # weights, grads, accum, master, exp_avg, exp_avg_sq, proj, twin, act
    name: str  # the store's name for it (what ``ChunkStore.moments`` records)
    home: Tier
    capacity: int
    used_on: Tier  # the tier a step uses it on
    in_place: bool = False  # frozen weights read from files (the model's, or the quantized cache's images)

    @classmethod
    def of(cls, chunk: Chunk, kind: str, role: str, used_on: Tier, **more: Any) -> PlannedChunk:
        """``chunk`` of the store as the plan sees it."""
        return cls(kind, role, chunk.name, chunk.home, chunk.capacity, used_on, **more)


@dataclass
class Plan:
    """Per memory tier: the bytes of the chunks homed there, and the reserved slots ({size: count})."""

    home: dict[Tier, int]
    reserve: dict[Tier, dict[int, int]]

    def needed(self, tier: Tier) -> int:
        """The smallest budget ``tier`` works with: its homes and its reserved slots."""
        return self.home[tier] + sum(size * n for size, n in self.reserve[tier].items())

    def short(self, budgets: Mapping[Tier, int]) -> dict[Tier, int]:
        """The memory tiers whose budget is below what they need, with what they need."""
        return {t: self.needed(t) for t in MEMORY if self.needed(t) > budgets[t]}

    def store_reserve(self) -> dict[str, dict[int, int]]:
        """``StoreConfig.reserve``."""
        return {t.value: dict(r) for t, r in self.reserve.items() if r}

    def refusal(
        self,
        budgets: Mapping[Tier, int],
        lower: str = "",
        sharing: Mapping[Tier, int] | None = None,
        beside: int = 1,
    ) -> str:
        """Why ``budgets`` are refused, naming the smallest that work (empty when they work); ``lower``: the
        settings that would place state lower, where some are not at their lowest yet; ``sharing``: per tier,
        the processes that split its setting between them (several ranks on a node: ``budgets`` are one's);
        ``beside``: the stores each process splits it into (2: a frozen model beside the trained one)."""
        short = self.short(budgets)
        if not short:
            return ""
        sharing = sharing or {}

        def given(t: Tier) -> str:
            n = sharing.get(t, 1)
            split = f"{BUDGET_SETTING[t]} / {n * beside} = {format_size(budgets[t])}"
            if beside > 1:
                each = f"each of the node's {n} ranks' " if n > 1 else "the "
                return f"{each}trained model gets {split} (the frozen model beside it as much)"
            if n == 1:
                return f"{BUDGET_SETTING[t]} is {format_size(budgets[t])}"
            return f"each of the node's {n} ranks gets {split}"

        parts = "; ".join(
            f"the {t.value} tier needs {format_size(n)} ({format_size(self.home[t])} homed there for the run, "
            f"{format_size(n - self.home[t])} for the chunks in use there at once: {self.describe(t)}) but "
            f"{given(t)}"
            for t, n in short.items()
        )
        smallest = self.smallest({t: sharing.get(t, 1) * beside for t in MEMORY})
        return f"{parts}. The smallest budgets that work: {smallest}" + (
            f" (or set {lower})" if lower else ""
        )

    def smallest(self, sharing: Mapping[Tier, int] | None = None) -> str:
        """The smallest budgets that work, as settings (rounded up to whole MiB; ``sharing``: per tier, the
        processes that split its setting, as in ``refusal``)."""
        sharing = sharing or {}
        return ", ".join(
            f"{BUDGET_SETTING[t]}: {-(-self.needed(t) // (1 << 20)) * sharing.get(t, 1)}MiB" for t in MEMORY
        )

    def as_json(self) -> dict:
        """Per memory tier: the bytes it needs, its homes, and its reserved slots ({size: count})."""
        return {
            t.value: {
                "needed": self.needed(t),
                "home": self.home[t],
                "reserved_slots": {str(size): n for size, n in sorted(self.reserve[t].items())},
            }
            for t in MEMORY
        }

    def describe(self, tier: Tier) -> str:
        """The reserved slots of ``tier`` in words."""
        slots = sorted(self.reserve[tier].items(), reverse=True)
        return ", ".join(f"{n} x {format_size(size)}" for size, n in slots) or "none"


def make_plan(chunks: list[PlannedChunk], moments: Moments) -> Plan:
    """The plan for a run registering ``chunks`` whose step's holders held ``moments`` (``ChunkStore.moments``,
    recorded on a ledger; a chunk held takes its capacity in ``chunks``, where the wave resized it)."""
    home = {t: sum(round_up(c.capacity, ALIGN) for c in chunks if c.home is t) for t in MEMORY}
    capacity = {c.name: c.capacity for c in chunks}
    held = [[[(t, capacity.get(name, size)) for t, name, size in m] for m in ms] for ms in moments.values()]
    reserve: dict[Tier, dict[int, int]] = {}
    for tier in MEMORY:
        sizes = size_classes(size for ms in held for m in ms for t, size in m if t is tier)
        counts: Counter[int] = Counter()
        for ms in held:  # per holder, the most of each class at any one moment; summed over the holders
            most: Counter[int] = Counter()
            for m in ms:
                most |= Counter(slot_class(sizes, size) for t, size in m if t is tier)
            counts += most
        reserve[tier] = {size: n for size, n in counts.items() if size is not None and n}  # type: ignore[misc]
    return Plan(home, reserve)


def fit_wave(
    chunks: list[PlannedChunk],
    moments: Moments,
    k: int,
    boundaries: Callable[[int], list[PlannedChunk]],
    budgets: Mapping[Tier, int],
) -> tuple[list[PlannedChunk], int]:
    """The micro-batches a wave of a ``k``-micro-batch step runs with the layer boundaries on the host: the
    most whose boundary chunks (``boundaries(slots)``, in place of ``chunks``' own) fit the budgets beside
    the other chunks but the twins (which take the room left); then as many waves, of even sizes, so the
    boundaries take no more than they need. Returns ``chunks`` with those boundaries, and the wave."""
    rest, alone = without_twins(chunks, moments)
    rest = [c for c in rest if c.role != "act"]
    m = k
    while m > 1 and make_plan(rest + boundaries(m), alone).short(budgets):
        m -= 1
    m = -(-k // -(-k // m))
    return [c for c in chunks if c.role != "act"] + boundaries(m), m


def fit_twins(
    chunks: list[PlannedChunk],
    moments: Moments,
    budgets: Mapping[Tier, int],
    disk_free: int,
    block: int,
) -> tuple[list[PlannedChunk], Moments]:
    """``chunks`` and ``moments`` with the speculative step's twins when the plan fits the budgets with them
    and the disk's ``disk_free`` bytes take their slots (blocks of ``block`` bytes); else without them."""
    if not make_plan(chunks, moments).short(budgets) and slot_bytes_of(chunks, block) <= disk_free:
        return chunks, moments
    return without_twins(chunks, moments)


def without_twins(chunks: list[PlannedChunk], moments: Moments) -> tuple[list[PlannedChunk], Moments]:
    """``chunks`` and ``moments`` of the run without the speculative step's twins: the optimizer holds each
    source where it held its twin (``{source}.twin``, ``engine.layout``)."""
    twins = {c.name for c in chunks if c.role == "twin"}
    alone = {
        h: [
            frozenset((t, n.removesuffix(".twin") if n in twins else n, size) for t, n, size in m) for m in ms
        ]
        for h, ms in moments.items()
    }
    return [c for c in chunks if c.role != "twin"], alone


def slot_bytes_of(chunks: Iterable[PlannedChunk], block: int) -> int:
    """Bytes of the disk tier's slots for the disk-homed ``chunks`` (a header with a checksum per ``block``,
    then the chunk); chunks read in place from files take none."""
    return sum(slot_bytes(c.capacity, block) for c in chunks if c.home is Tier.DISK and not c.in_place)


def size_classes(capacities: Iterable[int]) -> list[int]:
    """Slot sizes for chunks of ``capacities``: sorted, each the largest of the chunks within
    ``CLASS_SPREAD`` of the smallest one it serves."""
    sizes: list[int] = []
    low = 0
    for cap in sorted({round_up(max(c, 1), ALIGN) for c in capacities}):
        if sizes and cap <= low * CLASS_SPREAD:
            sizes[-1] = cap
        else:
            sizes.append(cap)
            low = cap
    return sizes
