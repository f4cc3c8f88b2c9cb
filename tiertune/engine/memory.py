"""The run's memory plan: what each memory tier must hold for a training step never to fail for room.

A tier holds the chunks homed on it for the whole run, and copies of chunks homed lower while a step uses
them. A copy in use (acquired) cannot be evicted, so the tier must always have room for every chunk that can
be in use on it at once; and the room must be contiguous where it is needed, which a shared arena cannot
promise (copies in use split it into gaps). So the plan reserves *slots*: per size class, as many slots as
chunks of that class can be in use on the tier at once, counted from the engine's step over the run's own
chunk layout. The store places a chunk in a slot of its class when its arena has no room
(``offload.tiers.MemoryTier``); the arena holds the homes and caches what it can beyond them.

Who holds chunks in use at once (the engine's step, ``engine.trainer`` and ``engine.update``):

- the compute thread, on the device: the weights of the groups outside the decoder layers (embeddings,
  final norm, head: bound for the whole wave of micro-batches), one decoder layer's weights (and, with
  GaLore, its projection), and two layer boundaries (the layer's input and output) when those are chunks;
  one rank of several (ZeRO-3) holds those weights as whole chunks gathered into scratch space, and the
  shard it is gathering; on the host: one group's gradients (and GaLore's full-gradient accumulator, and
  its projection passing through) while backward adds to them, or
  one chunk homed on disk passing through to the device;
- the optimizer worker, on the tier it updates on (the host, or the device tier when that is CPU memory):
  one unit's gradients, master weights and moments (their twins and one source being copied into its twin
  when the step speculates), the weights it writes and GaLore's projection.

A thread's count per class is the most any one of its moments needs; the tier's is the sum over the threads.
The checkpoint writer reads one chunk at a time and never waits while holding it: it takes what is free and
needs no slot of its own. ``engine.registered`` reads the chunks from the engine's own build on a ledger;
``finetune.train`` checks the plan against the budgets before the model is loaded and gives the store its
``reserve``; ``estimates.report`` reports it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from tiertune.engine.layout import home_tier_used
from tiertune.offload.chunk import ALIGN, ChunkLayout
from tiertune.offload.disk import slot_bytes
from tiertune.offload.tiers import BUDGET_SETTING, Tier, slot_class
from tiertune.units import format_size, round_up

MEMORY = (Tier.DEVICE, Tier.HOST)
IN_PLACE = "weights, read in place"  # a planned chunk's kind: frozen weights read from the model's own files
QUANT_CACHE = "weights, quantized cache"  # quantized on load (written once), read in place from the cache
CLASS_SPREAD = 1.25
"""Chunks whose sizes are within this factor of a class's smallest share its slots (each slot the size of the
class's largest): fewer classes, so fewer slots summed over classes whose chunks are never in use together."""


@dataclass
class PlannedChunk:
    """One chunk the run registers, as the plan sees it."""

    kind: str  # weights (or read in place / quantized cache), gradients, master, moments, ..., activations
    home: Tier
    capacity: int
    used_on: Tier  # the tier a step uses it on
    changed: bool = False  # written every step (written back home when it cannot stay cached)
    in_place: bool = False  # frozen weights read from files (the model's, or the quantized cache's images)
    layer: bool = False  # weights of a decoder layer (gathered again in backward, which recomputes it)
    layout: ChunkLayout | None = field(default=None, repr=False)  # as the store lays it out
    group: int = -1  # the parameter group it belongs to (-1: none, e.g. a saved layer input)
    role: str = ""  # weights, grads, accum, master, exp_avg, exp_avg_sq, proj, twin, act
    whole: ChunkLayout | None = field(default=None, repr=False)  # ZeRO-3: the chunk a rank's shard is part of


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
        self, budgets: Mapping[Tier, int], lower: str = "", sharing: Mapping[Tier, int] | None = None
    ) -> str:
        """Why ``budgets`` are refused, naming the smallest that work (empty when they work); ``lower``: the
        settings that would place state lower, where some are not at their lowest yet; ``sharing``: per tier,
        the processes that split its setting between them (several ranks on a node: ``budgets`` are one's)."""
        short = self.short(budgets)
        if not short:
            return ""
        sharing = sharing or {}

        def given(t: Tier) -> str:
            n = sharing.get(t, 1)
            if n == 1:
                return f"{BUDGET_SETTING[t]} is {format_size(budgets[t])}"
            return f"each of the node's {n} ranks gets {BUDGET_SETTING[t]} / {n} = {format_size(budgets[t])}"

        parts = "; ".join(
            f"the {t.value} tier needs {format_size(n)} ({format_size(self.home[t])} homed there for the run, "
            f"{format_size(n - self.home[t])} for the chunks in use there at once: {self.describe(t)}) but "
            f"{given(t)}"
            for t, n in short.items()
        )
        smallest = self.smallest(sharing)
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


def make_plan(chunks: list[PlannedChunk], on_cpu: bool) -> Plan:
    """The plan for a run registering ``chunks`` (``on_cpu``: the device tier is CPU memory)."""
    home = {t: sum(round_up(c.capacity, ALIGN) for c in chunks if c.home is t) for t in MEMORY}
    threads = _in_use(chunks, on_cpu)
    reserve: dict[Tier, dict[int, int]] = {}
    for tier in MEMORY:
        moments = [[c for t, c in moment if t is tier] for thread in threads for moment in thread]
        sizes = size_classes(c for moment in moments for c in moment)
        counts: Counter[int] = Counter()
        for thread in threads:
            most: Counter[int] = Counter()
            for moment in thread:
                here = Counter(slot_class(sizes, c) for t, c in moment if t is tier)
                most |= here  # the most of each class at any one moment of this thread
            counts += most
        reserve[tier] = {size: n for size, n in counts.items() if size is not None and n}  # type: ignore[misc]
    return Plan(home, reserve)


def fit_wave(
    chunks: list[PlannedChunk],
    k: int,
    boundaries: Callable[[int], list[PlannedChunk]],
    budgets: Mapping[Tier, int],
    on_cpu: bool,
) -> tuple[list[PlannedChunk], int]:
    """The micro-batches a wave of a ``k``-micro-batch step runs with the layer boundaries on the host: the
    most whose boundary chunks (``boundaries(slots)``, in place of ``chunks``' own) fit the budgets beside
    the other chunks but the twins (which take the room left); then as many waves, of even sizes, so the
    boundaries take no more than they need. Returns ``chunks`` with those boundaries, and the wave."""
    rest = [c for c in chunks if c.role not in ("act", "twin")]
    m = k
    while m > 1 and make_plan(rest + boundaries(m), on_cpu).short(budgets):
        m -= 1
    m = -(-k // -(-k // m))
    return [c for c in chunks if c.role != "act"] + boundaries(m), m


def fit_twins(
    chunks: list[PlannedChunk], budgets: Mapping[Tier, int], on_cpu: bool, disk_free: int, block: int
) -> list[PlannedChunk]:
    """``chunks`` with the speculative step's twins when the plan fits the budgets with them and the disk's
    ``disk_free`` bytes take their slots (blocks of ``block`` bytes); else without them."""
    if not make_plan(chunks, on_cpu).short(budgets) and slot_bytes_of(chunks, block) <= disk_free:
        return chunks
    return [c for c in chunks if c.role != "twin"]


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


Moment = list[tuple[Tier, int]]
"""Chunks in use at one moment of a thread: (tier, capacity) of each chunk not homed on that tier."""


def _in_use(chunks: list[PlannedChunk], on_cpu: bool) -> list[list[Moment]]:
    """Per thread (compute, optimizer), its moments of most chunks in use (see the module docstring)."""
    groups: dict[int, dict[str, list[PlannedChunk]]] = {}
    for c in chunks:
        if c.group >= 0:
            groups.setdefault(c.group, {}).setdefault(c.role, []).append(c)

    def on(tier: Tier, cs: Iterable[PlannedChunk]) -> Moment:
        return [(tier, c.capacity) for c in cs if c.home is not tier]

    acts = [c for c in chunks if c.role == "act"]
    others = [c for g in groups.values() for c in g.get("weights", []) if not c.layer]
    layers = [g for g in groups.values() if any(c.layer for c in g.get("weights", []))]
    device: list[Moment] = []
    sharded = any(c.whole is not None for c in chunks)
    for g in layers or [{}]:
        weights = others + g.get("weights", [])
        # forward reads one layer boundary and writes the next (``engine.schedule``); backward reads one
        used = on(Tier.DEVICE, g.get("proj", [])[:1] + acts[:2])
        if not sharded:
            device.append(on(Tier.DEVICE, weights) + used)
            continue
        # ZeRO-3 (``engine.sharding.Zero.gathered``): each bound chunk whole in scratch space on the device, and
        # the shard being gathered (released once gathered); the others are gathered first, then each layer
        wholes = [(Tier.DEVICE, c.whole.capacity) for c in weights if c.whole is not None]
        device.append(wholes + _largest(on(Tier.DEVICE, g.get("weights", []))) + used)
        device.append(wholes[: len(others)] + _largest(on(Tier.DEVICE, others)) + used)
    host: list[Moment] = []
    for g in groups.values():  # backward adds to one group's gradients
        held = g.get("grads", [])[:1] + g.get("accum", [])[:1]
        passing = [c for c in g.get("proj", [])[:1] if c.home is Tier.DISK]
        if held:
            host.append(on(Tier.HOST, held + passing))
    for c in chunks:  # a chunk homed on disk passes through the host to the device
        if c.home is Tier.DISK and c.used_on is Tier.DEVICE:
            host.append([(Tier.HOST, c.capacity)])
    optimizer = [
        m for g in groups.values() for j in range(len(g.get("grads", []))) for m in _unit(g, j, on_cpu)
    ]
    # the compute thread's device moments (layers bound) and host moments (a chunk staged for them, gradients
    # added) coincide: counted as two threads, each on its own tier
    return [device, host, optimizer]


def _largest(moment: Moment) -> Moment:
    """The largest chunk of ``moment`` (none when it is empty)."""
    return sorted(moment, key=lambda held: held[1])[-1:]


def _unit(g: dict[str, list[PlannedChunk]], j: int, on_cpu: bool) -> list[Moment]:
    """What the optimizer worker holds in use for weight chunk ``j`` of group ``g`` (``Updater.unit``): one
    moment, or with twins one per source, held while it is copied into its twin (any of them)."""
    moment: Moment = []
    device = torch.device("cpu" if on_cpu else "cuda")

    def use(c: PlannedChunk | None, tier: Tier | None = None, into: Moment = moment) -> None:
        if c is not None:
            t = tier or home_tier_used(c.home, device)
            if c.home is not t:
                into.append((t, c.capacity))

    use(_at(g, "grads", j))
    sources = [_at(g, "master", j) or _at(g, "weights", j), _at(g, "exp_avg", j), _at(g, "exp_avg_sq", j)]
    twins = g.get("twin", [])[3 * j : 3 * j + 3]
    for c in twins or sources:
        use(c)
    weights = _at(g, "weights", j)
    if _at(g, "master", j) is not None and weights is not None:  # written from the new master weights
        use(weights, Tier.DEVICE if weights.home is Tier.DEVICE else Tier.HOST)
    use(_at(g, "proj", j))
    if not twins:
        return [moment]
    moments = []
    for source in sources:  # one source held while it is copied into its twin
        held = list(moment)
        use(source, into=held)
        moments.append(held)
    return moments


def _at(group: dict[str, list[PlannedChunk]], role: str, j: int) -> PlannedChunk | None:
    chunks = group.get(role, [])
    return chunks[j] if j < len(chunks) else None
