"""The chunk store: registers tensors into chunks, places each chunk on a home tier, and moves chunks
between device, host and disk on demand (``acquire``/``release``) and ahead of demand (prefetch).

Threads. Public methods run on the caller's (compute) thread and take the store's lock. Transfers run on
the I/O engine's threads; their completion callbacks take the same lock to record the new state and wake
waiters. Waiting for a transfer releases the lock.

Placement. A chunk's *home* tier holds it for the store's life (its space is reserved when the chunk is
added). The device holds cached copies of host- and disk-homed chunks; the host holds cached copies of
disk-homed chunks (every disk transfer stages through host memory) and of device-homed chunks acquired on
the host. Caches are evicted furthest-next-use first (LRU without a trace); a modified cached copy is
written towards its home before its space is reused.

Budgets. Each memory tier is one arena of exactly its budget, so no tier ever holds more. When space cannot
be made because everything resident is in use, ``BudgetError`` names the tier, the bytes and the setting.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import BudgetError, ConfigError, IntegrityError, StateError
from tiertune.offload.aio import AsyncIO, IOHandle
from tiertune.offload.chunk import ALIGN, IN_FLIGHT, Chunk, ChunkLayout, ChunkState, Entry, pack_tensors
from tiertune.offload.disk import DiskSlot, DiskTier
from tiertune.offload.inplace import FileReader, FileTensor, InPlace, Window, plan_in_place
from tiertune.offload.schedule import EvictionOrder, Scheduler
from tiertune.offload.tiers import (
    BUDGET_SETTING,
    Allocation,
    MemoryTier,
    Tier,
    auto_budget,
    cuda_cap,
    slot_class,
)
from tiertune.settings import parse_size
from tiertune.units import format_size, round_up

log = logging.getLogger("tiertune.offload")

S = ChunkState
Held = tuple[Tier, str, int]
"""A chunk in use on a memory tier it is not homed on (or scratch space there): (tier, name, capacity)."""
_SETTLED = {Tier.DEVICE: S.ON_DEVICE, Tier.HOST: S.ON_HOST, Tier.DISK: S.ON_DISK}


@dataclass
class StoreConfig:
    """How a ``ChunkStore`` is built, in resolved values: a device, sizes in bytes. ``StoreConfig.resolve``
    takes what a recipe says (``'2GiB'``, ``auto``, ``cuda``) and resolves it."""

    device_budget: int
    host_budget: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # cpu or cuda:N
    disk_path: str | None = None
    disk_budget: int | None = None  # None: the free space at disk_path when the store starts
    chunk_size: int = 64 << 20
    prefetch_depth: int = 2
    host_prefetch_depth: int = 4  # disk reads run further ahead than copies to the device
    queue_depth: int = 16
    block_size: int = 1 << 20
    num_shards: int = 1
    direct: bool | None = None  # None: O_DIRECT when the filesystem supports it
    # the run's plan (engine.memory.Plan.reserve): per memory tier ("device", "host"), {slot size: count} of
    # slots kept for chunks in use there (see MemoryTier); None: no slots, every chunk shares the arena
    reserve: dict[str, dict[int, int]] | None = None
    # a ledger: the same placement, eviction and prefetch, over no bytes (the tiers' arenas on the meta
    # device, each transfer done at the store's next call, no file at disk_path): what ``engine.replay`` runs
    # a step's calls through to count the bytes a run's step holds and moves, without the machine to run it
    ledger: bool = False

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "chunk_size", "block_size", "disk_budget"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):
                raise TypeError(
                    f"StoreConfig.{name} is bytes (an int), got {value!r}: StoreConfig.resolve reads sizes"
                )
        if not isinstance(self.device, torch.device):
            raise TypeError(
                f"StoreConfig.device is a torch.device, got {self.device!r}: StoreConfig.resolve reads names"
            )
        if self.prefetch_depth < 0 or self.host_prefetch_depth < 0:
            raise ConfigError(
                f"offload.prefetch_depth must be >= 0, got {self.prefetch_depth} (host: {self.host_prefetch_depth})"
            )

    @classmethod
    def resolve(
        cls,
        device: str | torch.device = "cpu",
        device_budget: int | str = "auto",
        host_budget: int | str = "auto",
        disk_budget: int | str | None = None,
        chunk_size: int | str = 64 << 20,
        block_size: int | str = 1 << 20,
        prefetch_depth: int = 2,
        host_prefetch_depth: int | None = None,
        **rest: Any,
    ) -> StoreConfig:
        """A config from what a recipe or a caller says: ``device`` cpu, cuda, cuda:N or auto (cuda when there is
        one); budgets as sizes (``'2GiB'``) or ``auto`` (``tiers.auto_budget``); ``disk_budget`` None or
        ``auto`` for the free space at ``disk_path``; ``host_prefetch_depth`` None for twice ``prefetch_depth``.
        Other fields (``rest``) are taken as they are."""
        resolved = _resolve_device(device)

        def budget(value: int | str, tier: Tier, name: str) -> int:
            if value == "auto":
                return auto_budget(tier, resolved)
            number = str(value).strip()
            if isinstance(value, str) and number.replace(".", "", 1).isdigit() and float(number) != 0:
                # a bare number in a recipe: bytes, or a forgotten unit? (0 is 0 in any unit)
                raise ConfigError(
                    f"offload.{name}: {number} has no unit; write e.g. {number}GiB (or {number}B for bytes)"
                )
            return parse_size(value, f"offload.{name}")

        return cls(
            device=resolved,
            device_budget=budget(device_budget, Tier.DEVICE, "device_budget"),
            host_budget=budget(host_budget, Tier.HOST, "host_budget"),
            disk_budget=None
            if disk_budget in (None, "auto")
            else parse_size(disk_budget, "StoreConfig.disk_budget"),
            chunk_size=parse_size(chunk_size, "offload.chunk_size"),
            block_size=parse_size(block_size, "offload.block_size"),
            prefetch_depth=prefetch_depth,
            host_prefetch_depth=2 * prefetch_depth if host_prefetch_depth is None else host_prefetch_depth,
            **rest,
        )


def _resolve_device(value: str | torch.device) -> torch.device:
    """The store's compute device: cpu or an available CUDA device (``auto``: cuda when there is one).

    A CUDA device always gets its index (``cuda`` is the current device now): the store's buffers, streams
    and events are made on its I/O threads too, whose current device is cuda:0 whatever the caller's is.
    """
    if value == "auto":
        value = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"device {value!r} is not a device the store can compute on; use device='cpu', 'cuda', 'cuda:N' "
            "or 'auto' (cuda when available, else cpu)"
        ) from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"device {str(device)!r}: the store computes on the CPU or a CUDA GPU; use device='cpu', 'cuda', "
            "'cuda:N' or 'auto' (cuda when available, else cpu)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {str(device)!r} requested but torch.cuda.is_available() is False (no CUDA GPU is "
                f"visible, or this torch {torch.__version__} is built without CUDA); use device='cpu' or "
                "device='auto' (cuda when available, else cpu)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {str(device)!r} requested but this machine has {torch.cuda.device_count()} CUDA "
                f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}; use one of those or 'auto'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_memory(config: StoreConfig) -> None:
    """Budgets the machine cannot hold at all fail now, not when their memory is first allocated."""
    import psutil

    total = psutil.virtual_memory().total
    device = config.device
    in_ram = [("offload.host_budget", config.host_budget)]
    if device.type == "cpu":
        in_ram.append(("offload.device_budget", config.device_budget))
    for setting, budget in in_ram:
        if budget > total:
            raise ConfigError(
                f"{setting} is {format_size(budget)} but this machine has {format_size(total)} of memory "
                f"in all; lower {setting} (leaving room for the process and the OS) or set it to auto"
            )
    if len(in_ram) == 2 and config.host_budget + config.device_budget > total:
        raise ConfigError(
            f"offload.device_budget ({format_size(config.device_budget)}) and offload.host_budget "
            f"({format_size(config.host_budget)}) both live in host memory when computing on the CPU, and "
            f"together exceed this machine's {format_size(total)}; lower them or set them to auto"
        )
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory
        if config.device_budget > gpu:
            raise ConfigError(
                f"offload.device_budget is {format_size(config.device_budget)} but {device} has "
                f"{format_size(gpu)} of memory in all; lower offload.device_budget or set it to auto"
            )
        cap = cuda_cap(device)
        if cap is not None and config.device_budget > cap:
            raise ConfigError(
                f"offload.device_budget is {format_size(config.device_budget)} but this process may use at "
                f"most {format_size(cap)} of {device} (torch.cuda.set_per_process_memory_fraction); lower "
                "offload.device_budget or set it to auto"
            )


@dataclass
class TierStats:
    """Accounted bytes of one tier: its budget, what is allocated now, and the most ever allocated; and the
    host memory it holds page-locked for CUDA (exactly its budget once allocated, when pinned)."""

    budget: int
    used: int
    peak: int
    pinned: int = 0


@dataclass
class StoreStats:
    tiers: dict[str, TierStats]
    bytes_moved: dict[str, int] = field(default_factory=dict)  # "disk->host": bytes, ...
    divergences: int = 0


class ChunkStore:
    """Chunks of tensors across device, host and disk, with hard budgets, prefetch and eviction.

    Typical use (the training engine does this per layer)::

        store = ChunkStore(StoreConfig.resolve(device_budget="2GiB", host_budget="8GiB", disk_path="/nvme/tt"))
        chunks = store.add({"w": weight, "b": bias}, home="disk")
        for step in range(n):
            for chunk in chunks:
                tensors = store.acquire(chunk)      # on the device, prefetched after the first step
                ...                                 # compute
                store.release(chunk, dirty=False)
            store.mark_step()
        store.close()
    """

    def __init__(self, config: StoreConfig) -> None:
        if not config.ledger:
            _check_memory(config)
        self.config = config
        self.device = config.device
        self.ledger = config.ledger
        pin = (
            self.device if self.device.type == "cuda" and not self.ledger else False
        )  # page-locked for the GPU
        memory = {
            t: torch.device("meta") if self.ledger else d
            for t, d in ((Tier.DEVICE, self.device), (Tier.HOST, torch.device("cpu")))
        }
        reserve = config.reserve or {}
        self._planned = config.reserve is not None  # the run's plan covers staging and use (see _place)
        self._mem = {
            Tier.DEVICE: MemoryTier(
                Tier.DEVICE, config.device_budget, memory[Tier.DEVICE], reserve=reserve.get("device")
            ),
            Tier.HOST: MemoryTier(
                Tier.HOST, config.host_budget, memory[Tier.HOST], pin=pin, reserve=reserve.get("host")
            ),
        }
        if pin:
            # page-lock the host arena now: a budget the OS or CUDA refuses fails here, saying what to
            # change, not at its first use on an I/O thread in the middle of a step
            self._mem[Tier.HOST].allocate()
        self.aio = AsyncIO(config.queue_depth, config.block_size)
        self.disk: DiskTier | None = None
        if config.disk_path is not None and self.ledger:
            self.disk = DiskTier.ledger(config.disk_budget, self.aio)
        elif config.disk_path is not None:
            self.disk = DiskTier(config.disk_path, config.disk_budget, self.aio, direct=config.direct)
            weakref.finalize(self, DiskTier.close, self.disk)
        self.scheduler = Scheduler()
        self._chunks: list[Chunk] = []
        self._slots: dict[int, DiskSlot | InPlace] = {}
        self.files = FileReader(self.aio)  # reads of chunks whose disk copy is an existing file (in place)
        self._reserved = {Tier.DEVICE: 0, Tier.HOST: 0}
        self._largest_cached = {Tier.DEVICE: 0, Tier.HOST: 0}
        self._demand = {Tier.DEVICE: 0, Tier.HOST: 0}  # blocking allocations waiting for room, per tier
        # (chunk id, tier) -> acquires waiting for it there: its copy there (and, for the device, the host
        # copy it is staged through) is never evicted meanwhile; its other copies may be
        self._wanted: dict[tuple[int, Tier], int] = {}
        self._holders: dict[int, dict[int, int]] = {}  # chunk id -> {thread id: pins held}
        self._stalled: set[int] = set()  # threads waiting for room that only other threads' releases make
        self._waiting: dict[int, int] = defaultdict(int)  # thread id -> 1 while it waits on another thread
        self._in_use: dict[tuple[Tier, int], int] = defaultdict(int)  # (tier, class) -> chunks in use there
        self._in_use_peak: dict[tuple[Tier, int], int] = defaultdict(int)
        # a ledger: per holder (``holding``), what it holds in use now, and every set it held at once
        self._holding: dict[str, set[Held]] = defaultdict(set)
        self._moments: dict[str, set[frozenset[Held]]] = defaultdict(set)
        self._holder = threading.local()
        # per memory tier, the chunks that may have a copy there that is not their home (a superset, kept as
        # copies are made; ``_victims`` drops the others): eviction looks at these, not at every chunk
        self._cached: dict[Tier, dict[int, Chunk]] = {Tier.DEVICE: {}, Tier.HOST: {}}
        # the same chunks in the order the scheduler would evict them, as of its epoch ``_order_epoch``
        self._order = {Tier.DEVICE: EvictionOrder(), Tier.HOST: EvictionOrder()}
        self._order_epoch = self.scheduler.epoch
        self._repeating = False  # inside ``repeating``
        # passes that are not steps (``begin_pass``): their own scheduler, kept from one to the next, and the
        # steps' while one runs
        self._passes: Scheduler | None = None
        self._steps: Scheduler | None = None
        self._moved: dict[str, int] = {}
        self._moved_by: dict[int, dict[str, int]] = {}  # chunk id -> link -> bytes
        self._fatal: BaseException | None = None
        self._landing: list[IOHandle] = []  # a ledger's transfers, done at its next call (``_land``)
        # a ledger's record of its transfers and the uses that wait for them (``engine.trace``): set by the
        # replay that keeps one
        self.trace: Any = None
        self._transfers: dict[
            int, IOHandle
        ] = {}  # chunk id -> its newest transfer (``close`` waits for these)
        self._cond = threading.Condition(threading.RLock())
        self._closed = False
        self._closing = False

    # ------------------------------------------------------------------ registration

    def add(
        self,
        tensors: Mapping[str, torch.Tensor] | Sequence[Entry | Sequence[Entry]],
        home: Tier | str,
        name: str | None = None,
        chunk_size: int | None = None,
        in_file: bool = False,
    ) -> list[Chunk]:
        """Register tensors, packed in order into chunks of at most ``chunk_size`` bytes (default: the
        store's), homed on ``home``.

        Given a mapping of tensors, their values are copied in; given ``(name, shape, dtype)`` entries,
        the chunks start EMPTY and read as zeros on first acquire. ``in_file``: frozen chunks homed on disk
        whose disk copy will be a file (``home_in_file``, right after each is written): no slot of the disk
        tier is reserved for them. Raises BudgetError if the home tier cannot hold them, or if a tier cannot
        stage them on their way to the device.
        """
        home = Tier(home)
        entries: list[Entry | Sequence[Entry]] = (
            [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
            if isinstance(tensors, Mapping)
            else list(tensors)
        )
        size = self.config.chunk_size if chunk_size is None else chunk_size
        layouts = pack_tensors(entries, size, self.config.num_shards)
        new = self.add_layouts(layouts, home, name, in_file)
        if isinstance(tensors, Mapping):
            for chunk in new:
                self.write(chunk, {s.name: tensors[s.name] for s in chunk.tensors})
        return new

    def add_layouts(
        self, layouts: Sequence[ChunkLayout], home: Tier | str, name: str | None = None, in_file: bool = False
    ) -> list[Chunk]:
        """Register one EMPTY chunk per layout as it is given (``add`` lays entries out first; a rank's shard
        of a chunk has a layout of its own), homed on ``home``; all or none. Raises as ``add`` does."""
        home = Tier(home)
        prefix = name or f"chunk{len(self._chunks)}"
        new: list[Chunk] = []
        with self._cond:
            self._check_open()
            try:
                for i, layout in enumerate(layouts):
                    chunk = Chunk(
                        len(self._chunks), f"{prefix}.{i}" if len(layouts) > 1 else prefix, layout, home
                    )
                    self._place(chunk, slot=not in_file)
                    self._chunks.append(chunk)
                    new.append(chunk)
            except BaseException:
                for chunk in new:
                    self._unplace(chunk)
                    self._chunks.remove(chunk)
                raise
        return new

    def add_in_place(
        self, tensors: Sequence[FileTensor], name: str, chunk_size: int | None = None
    ) -> list[Chunk]:
        """Register frozen tensors whose bytes stay in the files they are in (``FileTensor``s: a checkpoint's
        or a cache's safetensors): chunks homed on disk, read in place, never written and taking nothing of
        the disk tier's budget. They start ON_DISK. Raises BudgetError if the host or device cannot stage them."""
        size = self.config.chunk_size if chunk_size is None else chunk_size
        return self.add_placed(plan_in_place(tensors, size, stamped=not self.ledger), name)

    def add_placed(self, plans: Sequence[tuple[ChunkLayout, InPlace]], name: str) -> list[Chunk]:
        """Register frozen chunks read in place, each a layout and where its bytes are (``add_in_place`` plans
        them from the files' tensors; a ledger's have no file)."""
        new: list[Chunk] = []
        with self._cond:
            self._check_open()
            try:
                for i, (layout, place) in enumerate(plans):
                    chunk = Chunk(
                        len(self._chunks), f"{name}.{i}" if len(plans) > 1 else name, layout, Tier.DISK
                    )
                    self._place(chunk, place)
                    chunk.valid.add(Tier.DISK)
                    chunk.state = S.ON_DISK  # a new chunk whose bytes are on disk already
                    self._chunks.append(chunk)
                    new.append(chunk)
            except BaseException:
                for chunk in new:
                    self._unplace(chunk)
                    self._chunks.remove(chunk)
                raise
        return new

    def home_in_file(self, chunk: Chunk, path: Path, checksums: tuple[int, ...] | None = None) -> None:
        """Make ``path`` the disk copy of frozen chunk ``chunk`` (homed on disk): a file that holds the chunk's
        image, its bytes in its layout from byte 0 (tiertune's quantized cache writes them so). From now on
        the chunk is read in place from the file and never written, and its slot in the disk tier is freed:
        the file is its only copy on disk. ``checksums`` (one xxh3-64 per ``block_size`` block of the image)
        are checked from the first read on; without them, the first read records them.

        Raises StateError for a chunk that is not homed on disk, already in place or acquired, and
        IntegrityError when the file is shorter than the chunk."""
        with self._cond:
            self._check_open()
            while chunk.state in IN_FLIGHT:
                self._wait()
            if chunk.home is not Tier.DISK or self.in_place(chunk) is not None or chunk.state is S.IN_USE:
                raise StateError(
                    f"chunk {chunk.name!r} cannot be read from {path}: it is not a released chunk homed on disk"
                )
            if self.ledger:  # a file nobody reads
                place = InPlace((), ())
            else:
                st = path.stat()
                if st.st_size < chunk.capacity:
                    raise IntegrityError(
                        f"{path} holds {st.st_size} bytes where chunk {chunk.name!r} has {chunk.capacity}"
                    )
                stamp = ((path, st.st_size, st.st_mtime_ns),)
                place = InPlace((Window(path, 0, 0, chunk.capacity),), stamp)
            slot = self._slots.get(chunk.id)
            self._slots[chunk.id] = place
            if isinstance(slot, DiskSlot) and self.disk is not None:
                self.disk.release(slot)
            chunk.disk_checksums = checksums
            chunk.valid.add(Tier.DISK)
            if chunk.state is S.EMPTY:
                chunk.transition(S.ON_DISK)
            self._cond.notify_all()

    def in_place(self, chunk: Chunk) -> InPlace | None:
        """Where ``chunk``'s bytes are read from when it is read in place (``add_in_place``), else None."""
        slot = self._slots.get(chunk.id)
        return slot if isinstance(slot, InPlace) else None

    def _place(self, chunk: Chunk, in_place: InPlace | None = None, slot: bool = True) -> None:
        """Reserve ``chunk``'s home space (``slot``: on disk too); check every tier above home can stage it.
        All or nothing."""
        home, size = chunk.home, chunk.capacity
        if home is Tier.DISK and self.disk is None and in_place is None and slot:
            raise ConfigError(
                f"chunk {chunk.name!r} is placed on disk but the store has no disk tier; set offload.disk_path"
            )
        # every tier above home must keep room to stage the largest chunk that passes through it
        stages = {Tier.DISK: (Tier.HOST, Tier.DEVICE), Tier.HOST: (Tier.DEVICE,), Tier.DEVICE: ()}[home]
        reserved = dict(self._reserved)
        if home is not Tier.DISK:
            reserved[home] += size
        planned = self._planned
        if planned and home is not Tier.DISK and reserved[home] > self._mem[home].arena.capacity:
            # the plan reserved the room to stage and use chunks: homes have the rest
            mem = self._mem[home]
            raise BudgetError(
                home.value,
                reserved[home] + mem.reserved,
                mem.budget,
                BUDGET_SETTING[home],
                f"placing chunk {chunk.name!r} there for the whole run, beside the "
                f"{format_size(mem.reserved)} the run's plan reserves for chunks in use there",
            )
        for tier in [] if planned else ([home] if home is not Tier.DISK else []) + list(stages):
            largest = max(self._largest_cached[tier], size if tier in stages else 0)
            needed = reserved[tier] + largest
            if needed > self._mem[tier].budget:
                if tier is home:
                    detail = f"placing chunk {chunk.name!r} there for the whole run"
                    if largest:
                        detail += f" while keeping {format_size(largest)} free to stage chunks homed lower"
                else:
                    detail = f"{format_size(reserved[tier])} holds chunks homed there"
                    detail += f" and chunk {chunk.name!r} needs {format_size(size)} to pass through"
                raise BudgetError(tier.value, needed, self._mem[tier].budget, BUDGET_SETTING[tier], detail)
        if in_place is not None:
            self._slots[chunk.id] = in_place
        elif home is Tier.DISK:
            if slot:
                assert self.disk is not None  # checked above
                self._slots[chunk.id] = self.disk.reserve(chunk, self.aio.block_size)
        else:
            alloc = self._alloc_home(home, chunk)
            chunk.copies[home] = alloc
            self._reserved[home] += size
        for tier in stages:
            self._largest_cached[tier] = max(self._largest_cached[tier], size)

    def _unplace(self, chunk: Chunk) -> None:
        if chunk.home is Tier.DISK:
            slot = self._slots.pop(chunk.id, None)
            if isinstance(slot, DiskSlot) and self.disk is not None:
                self.disk.release(slot)
        elif chunk.home in chunk.copies:
            self._mem[chunk.home].free(chunk.copies.pop(chunk.home))
            self._reserved[chunk.home] -= chunk.capacity

    # ------------------------------------------------------------------ use

    def acquire(
        self,
        chunk: Chunk,
        tier: Tier | str = Tier.DEVICE,
        *,
        overwrite: bool = False,
        traced: bool = True,
        copy_from: Chunk | None = None,
    ) -> dict[str, torch.Tensor]:
        """Make ``chunk`` resident on ``tier`` (device or host), pin it there and return its tensors.

        Blocks until any transfer it needs is done. The views are valid until the matching ``release``.
        ``overwrite=True`` promises that the caller writes every tensor before releasing it (dirty): the
        old contents are not fetched (nothing is read from disk) and the views may hold anything.
        ``traced=False`` keeps the access out of the scheduler's trace (work that does not repeat every
        step, such as a redone optimizer step); it is served on demand, without prefetch.
        ``copy_from=src`` fills ``chunk`` with the bytes of ``src`` (same layout), leaving ``src``'s contents
        as they are: when ``src`` has another valid copy (on disk, say), its copy on ``tier`` is handed over
        to ``chunk`` without copying a byte; otherwise the bytes are copied.
        """
        tier = Tier(tier)
        if tier is Tier.DISK:
            raise ConfigError("chunks are acquired on the device or the host, not on disk")
        copy = None
        with self._cond:
            self._land()
            self._check_open()
            if traced:
                self.scheduler.on_access(chunk.id, tier, overwrite or copy_from is not None)
                chunk.last_use = self.scheduler.clock
                self._rekey(chunk)
            if copy_from is not None:
                copy = self._acquire_copy(chunk, tier, copy_from)
            else:
                if overwrite:
                    self._drop_stale_for_overwrite(chunk, tier)
                self._pin(chunk, tier, zero=not overwrite)
            views = chunk.views(chunk.copies[tier].tensor)
            if traced:
                self._prefetch()
            if self.trace is not None:  # what the acquire waited for, and the bytes it copies
                self.trace.op("use", chunk.id)
                if copy is not None:
                    self.trace.op("run", "copy", 0, chunk.capacity)
        if copy is not None:  # outside the lock: other threads' transfers and acquires go on meanwhile
            dst, src = copy
            assert copy_from is not None
            try:
                dst.copy_(src)
            finally:
                self.release(copy_from)
        return views

    def release(self, chunk: Chunk, dirty: bool = False) -> None:
        """Unpin ``chunk``. ``dirty=True`` says its tensors were modified: other copies become stale."""
        with self._cond:
            self._land()
            if chunk.state is not S.IN_USE:
                raise StateError(
                    f"release of chunk {chunk.name!r} that is not acquired ({chunk.state.value})"
                )
            if dirty and self.in_place(chunk) is not None:
                raise StateError(self._read_only(chunk))
            chunk.pins -= 1
            holders = self._holders.get(chunk.id, {})
            me = threading.get_ident()
            holder = me if me in holders else next(iter(holders), None)
            if holder is not None:
                holders[holder] -= 1
                if not holders[holder]:
                    del holders[holder]
            tier = chunk.use_tier
            assert tier is not None
            if dirty:
                for other in list(chunk.valid - {tier}):
                    self._invalidate(chunk, other)
            if tier is Tier.DEVICE and self.device.type == "cuda" and not self.ledger:
                # kernels queued on the compute stream may still read or write the chunk: remember when
                # they finish, so a copy out waits for them and its memory is not reused before
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                chunk.device_event = event
            if chunk.pins == 0:
                chunk.use_tier = None
                self._count_in_use(chunk, tier, -1)
                chunk.transition(_SETTLED[tier])
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self, chunk: Chunk) -> Iterator[dict[str, torch.Tensor]]:
        """Fill or modify ``chunk`` in place: yields its tensors on its home tier (staged on the host for
        disk) and releases them as modified. Outside the scheduler's trace, e.g. for loading weights."""
        tier = Tier.DEVICE if chunk.home is Tier.DEVICE else Tier.HOST
        with self._cond:
            self._land()
            self._check_open()
            if self.in_place(chunk) is not None:
                raise StateError(self._read_only(chunk))
            self._pin(chunk, tier)
            views = chunk.views(chunk.copies[tier].tensor)
            if self.trace is not None:
                self.trace.op("use", chunk.id)
        try:
            yield views
        finally:
            self.release(chunk, dirty=True)

    def buffer(self, chunk: Chunk) -> torch.Tensor:
        """The flat uint8 buffer (``capacity`` bytes) behind an acquired chunk's views, on the tier it is
        acquired on; valid until the matching ``release``. For whole-chunk transfers: a shard gathered into
        a full chunk, bytes copied as they are."""
        with self._cond:
            if chunk.state is not S.IN_USE:
                raise StateError(
                    f"the buffer of chunk {chunk.name!r} that is not acquired ({chunk.state.value})"
                )
            assert chunk.use_tier is not None
            return chunk.copies[chunk.use_tier].tensor

    @contextlib.contextmanager
    def scratch(self, nbytes: int, name: str, tier: Tier | str = Tier.DEVICE) -> Iterator[torch.Tensor]:
        """A uint8 buffer of ``nbytes`` (rounded up to ``ALIGN``) on a memory tier for the block, counted in the
        tier's budget and peak like a chunk (cached chunks are evicted to make room; BudgetError when there is
        none): what a chunk's shards are gathered into for compute. Its contents start undefined."""
        tier = Tier(tier)
        if tier is Tier.DISK:
            raise ConfigError("scratch space is on the device or the host, not on disk")
        standin = Chunk(-1, name, ChunkLayout((), round_up(max(nbytes, 1), ALIGN)), tier)
        with self._cond:
            self._land()
            self._check_open()
            alloc = self._alloc(tier, standin, blocking=True)
            assert alloc is not None  # a blocking allocation returns one or raises
            self._count_in_use(standin, tier, 1, scratch=True)
        try:
            yield alloc.tensor[:nbytes]
        finally:
            # kernels queued on it finish before its memory is reused
            if self._mem[tier].device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            with self._cond:
                self._count_in_use(standin, tier, -1, scratch=True)
                self._mem[tier].free(alloc)
                self._cond.notify_all()

    def write(self, chunk: Chunk, values: Mapping[str, torch.Tensor]) -> None:
        """Copy ``values`` into ``chunk``'s tensors (on its home tier, or staged on the host for disk)."""
        with self.writing(chunk) as views:
            for key, value in values.items():
                views[key].copy_(value)

    def read(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """A copy of ``chunk``'s tensors on the CPU (outside the scheduler's trace)."""
        with self._cond:
            self._land()
            self._check_open()
            self._pin(chunk, Tier.HOST)
            views = chunk.views(chunk.copies[Tier.HOST].tensor)
        try:
            return {k: v.clone() for k, v in views.items()}
        finally:
            self.release(chunk)

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start reading ``chunks`` from disk into host memory now, without waiting (for accesses outside
        the trace that the caller knows are coming, like the optimizer's). Evicts only cached copies that
        the trace does not need within its host lookahead; chunks that cannot get room are skipped."""
        with self._cond:
            self._land()
            self._check_open()
            ahead = self.scheduler.upcoming(self.config.host_prefetch_depth)
            before = max((self.scheduler.next_use(c) for c in ahead), default=math.inf)
            for chunk in chunks:
                if (
                    self._busy(chunk)
                    or chunk.valid & {Tier.HOST, Tier.DEVICE}
                    or Tier.DISK not in chunk.valid
                ):
                    continue
                if not self._start_load(chunk, blocking=False, before=before):
                    break

    def room(self, tier: Tier | str) -> int:
        """Bytes that more chunks homed on ``tier`` can still take (for a memory tier, after keeping room
        to stage the largest chunk passing through)."""
        tier = Tier(tier)
        with self._cond:
            if tier is Tier.DISK:
                return 0 if self.disk is None else self.disk.arena.free_bytes
            mem = self._mem[tier]
            if self._planned:  # the plan reserved the room to stage and use chunks
                return max(0, mem.arena.capacity - self._reserved[tier])
            return max(0, mem.budget - self._reserved[tier] - self._largest_cached[tier])

    def discard(self, chunk: Chunk) -> None:
        """Forget ``chunk``'s contents: no copy of them is written back or read again, and cached copies
        free their space. The chunk is EMPTY afterwards (its next acquire reads zeros)."""
        with self._cond:
            self._land()
            self._check_open()
            while chunk.state in IN_FLIGHT:
                self._wait()
            if chunk.state is S.IN_USE:
                raise StateError(f"discard of chunk {chunk.name!r} while it is acquired; release it first")
            if self.in_place(chunk) is not None:
                raise StateError(self._read_only(chunk))
            self._forget(chunk)

    def exchange(self, a: Chunk, b: Chunk) -> None:
        """Swap the contents of two chunks with the same layout and home, without copying a byte.

        Every copy, its validity and the disk slot move from one chunk to the other, so each chunk keeps
        its place in the scheduler's trace while its bytes change. The training engine writes a step's new
        optimizer states into twin chunks and exchanges them in when the step is confirmed.
        """
        if a.layout != b.layout or a.home is not b.home:
            raise ConfigError(
                f"chunks {a.name!r} and {b.name!r} cannot exchange contents: layouts or homes differ"
            )
        with self._cond:
            self._land()
            self._check_open()
            while a.state in IN_FLIGHT or b.state in IN_FLIGHT:
                self._wait()
            for chunk in (a, b):
                if chunk.state is S.IN_USE:
                    raise StateError(
                        f"exchange of chunk {chunk.name!r} while it is acquired; release it first"
                    )
            for attr in ("state", "copies", "valid", "disk_checksums", "error", "device_event", "last_use"):
                va, vb = getattr(a, attr), getattr(b, attr)
                setattr(a, attr, vb)
                setattr(b, attr, va)
            if a.id in self._slots:
                self._slots[a.id], self._slots[b.id] = self._slots[b.id], self._slots[a.id]
            for chunk in (a, b):
                for tier in list(chunk.copies):
                    self._note_copy(chunk, tier)
                self._rekey(chunk)  # the last uses changed places
            self._cond.notify_all()

    def waiting(self, thread_id: int | None) -> bool:
        """Whether thread ``thread_id`` is blocked in the store on another thread (for room, or for a chunk
        another thread holds): a thread waiting for it must not keep holding what it has acquired. A wait
        for a transfer in flight is not reported: it ends without anyone's help."""
        with self._cond:
            return thread_id is not None and self._waiting.get(thread_id, 0) > 0

    def mark_step(self) -> None:
        """Tell the scheduler a training step ended: the first step's access order becomes the trace."""
        with self._cond:
            self._land()
            self.scheduler.mark_step()
            self._prefetch()

    @contextlib.contextmanager
    def repeating(self) -> Iterator[None]:
        """A pass that repeats, and is not a training step (a decoding: the same weight accesses every token),
        scheduled as steps are: inside, a scheduler of its own records the first pass and replays it for the
        next ones (each ended by ``mark_step``), so that eviction keeps what the next pass needs soonest (a
        pass over more than the tiers hold keeps a part of it cached, not none) and the next chunks are
        prefetched from the disk (copies to the device are made when asked for); on exit the training steps'
        scheduler (its trace, and where the step is in it) is back."""
        with self._cond:
            self._land()
            saved, self.scheduler = self.scheduler, Scheduler()
            self.scheduler.clock = saved.clock  # one clock for the chunks' last uses
            self._order_epoch = -1  # every copy's place among the victims is the new scheduler's
            self._repeating = True
        try:
            yield
        finally:
            with self._cond:
                self._land()
                saved.clock, self.scheduler = self.scheduler.clock, saved
                self._order_epoch = -1
                self._repeating = False

    def begin_pass(self) -> None:
        """A pass over the data that is not a training step begins (an evaluation's, the reference's before
        training; ended by ``forget_pass``): a scheduler of its own, kept from one such pass to the next,
        records the first and replays it for the next ones (passes over the data use the chunks in one order),
        so that they prefetch and evict by their own order, and the steps' trace stays as it was (a pass that
        diverged from it dropped it: the step after ran without prefetching)."""
        with self._cond:
            self._land()
            if self._steps is not None:
                raise StateError("begin_pass inside a pass: end it with forget_pass first")
            passes = self._passes or Scheduler(quiet=True)
            passes.clock = self.scheduler.clock  # one clock for the chunks' last uses
            self._steps, self.scheduler = self.scheduler, passes
            self._order_epoch = -1  # every copy's place among the victims is the pass's scheduler's
            self._prefetch()

    def forget_pass(self) -> None:
        """What ran since the last step boundary (or ``begin_pass``) was not a training step (a pass over the
        data): its chunk accesses leave the steps' scheduler (a pass begun by ``begin_pass`` leaves them with
        the passes' own). Before the first step (a reference's pass, an evaluation on start) every cached copy
        goes (each chunk only at home) and the tiers' peaks start again: the steps run as they would have
        without it. Between steps (an evaluation) the cached copies stay, for the steps' scheduler to keep or
        evict by its trace: a pass over the layers ends keeping what the budgets hold of the first layers, as
        a step does, so the step after reads what it would have read without it (evicting them all made it
        read again every byte the budgets had cached); the peaks stay the run's. The bytes it moved stay
        counted."""
        with self._cond:
            self._land()
            if self._steps is not None:
                self.scheduler.end_pass()
                self._passes, self.scheduler, self._steps = self.scheduler, self._steps, None
                self.scheduler.clock = self._passes.clock
                self._order_epoch = -1
            self.scheduler.forget()
            if self.scheduler.trace is not None:
                return
        for chunk in self._chunks:
            self.evict(chunk)
        self.reset_peaks()

    def flush(self) -> None:
        """Write every chunk's newest bytes back to its home tier and wait (e.g. before a checkpoint)."""
        with self._cond:
            self._check_open()
            for chunk in self._chunks:
                if chunk.state is S.IN_USE:
                    raise StateError(f"flush while chunk {chunk.name!r} is acquired; release it first")
            for chunk in self._chunks:
                if chunk.valid and chunk.home not in chunk.valid:
                    self._make_resident(chunk, chunk.home)

    def evict(self, chunk: Chunk, wait: bool = True) -> None:
        """Write ``chunk`` back to its home tier and drop its cached copies elsewhere (frees their space).

        ``wait=False`` only starts moving the device copy down (it is dropped when the copy is done) and
        returns at once: for data written on the device that is needed again much later.
        """
        with self._cond:
            self._land()
            self._check_open()
            if not wait:
                if chunk.state is S.IN_USE:
                    raise StateError(f"evict of chunk {chunk.name!r} while it is acquired; release it first")
                if (
                    chunk.state not in IN_FLIGHT
                    and Tier.DEVICE in chunk.valid
                    and chunk.home is not Tier.DEVICE
                ):
                    self._evict(chunk, Tier.DEVICE, blocking=False)
                return
            while chunk.state in IN_FLIGHT or chunk.state is S.IN_USE:
                if chunk.state is S.IN_USE:
                    raise StateError(f"evict of chunk {chunk.name!r} while it is acquired; release it first")
                self._wait()
            if chunk.valid and chunk.home not in chunk.valid:
                self._make_resident(chunk, chunk.home)
            for tier in (Tier.DEVICE, Tier.HOST):
                if tier is not chunk.home and tier in chunk.valid:
                    self._drop(chunk, tier)
            if self.trace is not None:
                self.trace.op("use", chunk.id)

    def wait(self) -> None:
        """Block until no transfer is in flight (prefetches and write-backs included)."""
        with self._cond:
            self._land()
            while any(c.state in IN_FLIGHT for c in self._chunks):
                self._wait()

    def stats(self) -> StoreStats:
        """Budgets, current and peak accounted bytes per tier, and bytes moved per link."""
        with self._cond:
            self._land()
            tiers = {
                t.value: TierStats(m.budget, m.used, m.peak, m.pinned_bytes) for t, m in self._mem.items()
            }
            if self.disk is not None:
                a = self.disk.arena
                tiers["disk"] = TierStats(a.capacity, a.used, a.peak)
            return StoreStats(tiers, dict(self._moved), self.scheduler.divergences)

    def in_use_peaks(self) -> dict[str, dict[int, int]]:
        """Per memory tier, the most chunks homed elsewhere (and scratch buffers) that were in use there at
        once (since ``reset_peaks``), by size class: the reserved slot size when the store has a plan, else
        the chunk's capacity. What the plan's ``reserve`` must cover."""
        with self._cond:
            out: dict[str, dict[int, int]] = {}
            for (tier, size), n in self._in_use_peak.items():
                if n:
                    out.setdefault(tier.value, {})[size] = n
            return out

    @contextlib.contextmanager
    def holding(self, holder: str) -> Iterator[None]:
        """This thread's acquires in the block are ``holder``'s (default: ``compute``): on a ledger, where the
        optimizer's units run on the compute thread, its moments stay its own (``moments``)."""
        before = getattr(self._holder, "name", "compute")
        self._holder.name = holder
        try:
            yield
        finally:
            self._holder.name = before

    def moments(self) -> dict[str, list[frozenset[Held]]]:
        """A ledger's record, per holder (the compute thread, the optimizer): every set of chunks it held in use
        at once on memory tiers they are not homed on (scratch space included), and each chunk homed on disk
        staged through the host on its way to the device. What ``engine.memory``'s plan reserves slots for:
        the engine's parts say what they hold by holding it."""
        with self._cond:
            return {holder: list(sets) for holder, sets in self._moments.items()}

    def moved(self, chunk: Chunk) -> dict[str, int]:
        """Bytes of ``chunk`` moved so far, per link ("host->device": bytes, ...)."""
        with self._cond:
            return dict(self._moved_by.get(chunk.id, {}))

    def reset_peaks(self) -> None:
        with self._cond:
            for m in self._mem.values():
                m.reset_peak()
            self._in_use_peak = defaultdict(int, self._in_use)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(self._chunks)

    def close(self) -> None:
        """Wait for transfers in flight, stop the I/O threads and remove the disk tier's file.

        It waits only for transfers an I/O thread is still running (they always end), never for a chunk's
        state: a completion whose callback was cut short (a signal raised on the main thread as a ledger's
        transfer landed) leaves its chunk in flight with nothing left to finish it. A ledger moves no bytes:
        nothing of it is waited for."""
        with self._cond:
            if self._closed:
                return
            self._closing = True  # no prefetch starts from here (``_prefetch``)
            self._landing.clear()
            while (
                self._fatal is None
                and not self.ledger
                and any(not h.done() for h in self._transfers.values())
            ):
                self._cond.wait(0.1)  # woken by ``_done``; the timeout only bounds a lost notification
            self._closed = True
        self.aio.close()
        self.files.close()
        if self.disk is not None:
            self.disk.close()
        if self.device.type == "cuda" and not self.ledger:
            # kernels or copies the caller queued may still use the tiers' memory: unpinning host memory
            # under a copy in flight is undefined, and device memory must not be reused under a kernel
            torch.cuda.synchronize(self.device)
        for mem in self._mem.values():
            mem.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals (lock held)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("the chunk store is closed")

    def _read_only(self, chunk: Chunk) -> str:
        place = self.in_place(chunk)
        files = ", ".join(str(f) for f in place.files) if place is not None else "its file"
        return f"chunk {chunk.name!r} is read in place from {files}: it is frozen and is never written"

    def _make_wanted_resident(self, chunk: Chunk, tier: Tier, zero: bool = True) -> None:
        """``_make_resident`` for an acquire. While it waits, the chunk is not yet pinned, and the trace
        cursor is already past it (so it looks far from its next use): mark it wanted, or a prefetch could
        evict it again."""
        key = (chunk.id, tier)
        self._wanted[key] = self._wanted.get(key, 0) + 1
        try:
            self._make_resident(chunk, tier, zero)
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]

    def _pin(self, chunk: Chunk, tier: Tier, zero: bool = True) -> None:
        self._make_wanted_resident(chunk, tier, zero)
        if chunk.state is S.IN_USE:
            chunk.pins += 1
        else:
            chunk.transition(S.IN_USE)
            chunk.use_tier = tier
            chunk.pins = 1
            self._count_in_use(chunk, tier, 1)
        holders = self._holders.setdefault(chunk.id, {})
        me = threading.get_ident()
        holders[me] = holders.get(me, 0) + 1

    def _count_in_use(self, chunk: Chunk, tier: Tier, change: int, scratch: bool = False) -> None:
        """Count chunks in use on ``tier`` not homed there (and ``scratch`` space), by size class
        (``in_use_peaks``)."""
        if chunk.home is tier and not scratch:
            return
        sizes = self._mem[tier].slot_sizes
        key = (
            tier,
            (slot_class(sizes, chunk.capacity) if sizes else None) or round_up(chunk.capacity, ALIGN),
        )
        self._in_use[key] += change
        if change > 0 and self._in_use[key] > self._in_use_peak[key]:
            self._in_use_peak[key] = self._in_use[key]
        if self.ledger:
            self._hold((tier, chunk.name, chunk.capacity), change > 0, chunk.home)

    def _hold(self, held: Held, on: bool, home: Tier) -> None:
        """A ledger's record of what each holder holds at once (``moments``)."""
        if not on:
            for mine in self._holding.values():
                mine.discard(held)
            return
        holder = getattr(self._holder, "name", "compute")
        mine = self._holding[holder]
        mine.add(held)
        self._moments[holder].add(frozenset(mine))
        if held[0] is Tier.DEVICE and home is Tier.DISK:  # staged through the host on its way
            self._moments[holder].add(frozenset({(Tier.HOST, *held[1:])}))

    def _in_flight(self, label: str, chunk: Chunk, src: Tier, dst: Tier) -> IOHandle:
        """A ledger's transfer of ``chunk`` from ``src`` to ``dst`` (no byte moves): done at the store's next
        call, as a transfer started during one call of a run's step is, most often, by the next (``_land``)."""
        if self.trace is not None:
            self.trace.op("start", chunk.id, f"{src.value}->{dst.value}", chunk.capacity)
        handle = IOHandle(label, parts=1)
        self._landing.append(handle)
        return handle

    def _land(self) -> None:
        """A ledger: finish the transfers started so far, and those their completions start."""
        while self._landing:
            self._landing.pop(0).part_done()

    def _wait(self, on_others: bool = False) -> None:
        """Wait for a notification. ``on_others``: what is waited for may need another thread to act (free
        room, release a chunk it holds); such a wait is what ``waiting`` reports. A wait for a transfer in
        flight ends by itself."""
        if self._fatal is not None:
            raise self._fatal
        if self.ledger:  # nothing happens meanwhile but the transfers started: they finish now
            if not self._landing:
                raise StateError("a ledger waits for another thread: one thread's calls cannot replay this")
            self._land()
            return
        me = threading.get_ident()
        self._waiting[me] += on_others
        try:
            self._cond.wait()
        finally:
            self._waiting[me] -= on_others
        if self._fatal is not None:
            raise self._fatal

    def _acquire_copy(self, chunk: Chunk, tier: Tier, src: Chunk) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pin ``chunk`` on ``tier`` with ``src``'s bytes handed over (returns None), or pin both and return
        the (destination, source) buffers for the caller to copy and then release ``src``."""
        if src.layout != chunk.layout or src is chunk:
            raise ConfigError(f"chunk {chunk.name!r} cannot be filled from {src.name!r}: layouts differ")
        self._drop_stale_for_overwrite(chunk, tier)
        self._make_wanted_resident(src, tier)
        movable = (
            src.state is not S.IN_USE
            and tier is not src.home
            and bool(src.valid - {tier})  # src keeps its bytes elsewhere
            and chunk.state is S.EMPTY
            and tier not in chunk.copies
        )
        if movable:
            chunk.copies[tier] = src.copies.pop(tier)
            self._note_copy(chunk, tier)
            src.valid.discard(tier)
            if tier is Tier.DEVICE:
                chunk.device_event = src.device_event
            self._settle(src)
            chunk.valid.add(tier)
            self._pin(chunk, tier, zero=False)
            return None
        self._pin(src, tier)
        try:
            self._pin(chunk, tier, zero=False)
        except BaseException:
            self.release(src)
            raise
        return chunk.copies[tier].tensor, src.copies[tier].tensor

    def _drop_stale_for_overwrite(self, chunk: Chunk, tier: Tier) -> None:
        """Before an overwriting acquire: forget contents that would otherwise be fetched to ``tier``."""
        while chunk.state in IN_FLIGHT or (chunk.state is S.IN_USE and chunk.use_tier is not tier):
            self._wait(on_others=chunk.state is S.IN_USE)
        if chunk.state is S.IN_USE or chunk.state is S.EMPTY or tier in chunk.valid:
            return
        self._forget(chunk)

    def _forget(self, chunk: Chunk) -> None:
        """Drop every copy's validity (freeing cached copies) and make the resting ``chunk`` EMPTY."""
        for tier in list(chunk.valid):
            self._invalidate(chunk, tier)
        chunk.disk_checksums = None
        chunk.error = None
        if chunk.state is not S.EMPTY:
            chunk.transition(S.EMPTY)
        self._cond.notify_all()

    def _make_resident(self, chunk: Chunk, tier: Tier, zero: bool = True) -> None:
        """Block until ``tier`` holds a valid copy of ``chunk`` and no transfer of it is in flight.
        An EMPTY chunk gets zeros there, or uninitialized bytes when ``zero`` is False."""
        while True:
            if chunk.error is not None:
                raise chunk.error
            if chunk.state in IN_FLIGHT or (chunk.state is S.IN_USE and chunk.use_tier is not tier):
                self._wait(on_others=chunk.state is S.IN_USE)
                continue
            if tier in chunk.valid:
                return
            if chunk.state is S.EMPTY:
                alloc = self._claim(chunk, tier, True, math.inf, lambda: chunk.state is S.EMPTY)
                if alloc is None:
                    continue
                if zero:
                    alloc.tensor.zero_()
                chunk.copies[tier] = alloc
                self._note_copy(chunk, tier)
                chunk.valid.add(tier)
                return
            if tier is Tier.DISK:
                if Tier.HOST not in chunk.valid:
                    self._make_resident(chunk, Tier.HOST)
                self._start_write(chunk, drop_host=False)
            elif tier is Tier.DEVICE:
                if Tier.HOST in chunk.valid:
                    self._start_copy(chunk, Tier.HOST, Tier.DEVICE, blocking=True)
                else:
                    self._make_resident(chunk, Tier.HOST)
            elif Tier.DEVICE in chunk.valid:
                self._start_copy(chunk, Tier.DEVICE, Tier.HOST, blocking=True)
            else:
                self._start_load(chunk, blocking=True)

    def _alloc_home(self, tier: Tier, chunk: Chunk) -> Allocation:
        """Space for ``chunk`` homed on memory tier ``tier``, the lowest that fits: with a plan, after evicting
        the cached copies of the arena (waiting for their write-backs), so that the homes stay one block at
        the bottom and fit as the plan counted them. Registration happens at start-up: nothing is lost."""
        mem = self._mem[tier]
        if self._planned:
            while True:
                for victim in self._victims(tier, exclude=chunk, before=math.inf):
                    if not mem.in_reserve(victim.copies[tier]):
                        self._evict(victim, tier, blocking=True)
                if not any(
                    c.state in IN_FLIGHT and tier in c.copies and not mem.in_reserve(c.copies[tier])
                    for c in self._chunks
                ):
                    break
                self._wait()
        alloc = self._alloc(tier, chunk, blocking=True, home=True)
        assert alloc is not None  # a blocking allocation returns one or raises
        return alloc

    def _alloc(
        self, tier: Tier, chunk: Chunk, blocking: bool, before: float = math.inf, home: bool = False
    ) -> Allocation | None:
        """Space for ``chunk`` on a memory tier, evicting other chunks' cached copies as needed.

        Non-blocking (prefetch): only victims used later than ``before`` are evicted, and None is returned
        when space cannot be made right now. Blocking: a free reserved slot of the chunk's class when the
        arena has no room (``MemoryTier``), else evicts; waits for write-backs, or raises BudgetError.
        ``home``: the chunk's home copy, the lowest range of the arena that fits (never a reserved slot).
        """
        mem = self._mem[tier]
        if not blocking and self._demand[tier]:
            return None  # an acquire is waiting for room here: space freed now is its, not a prefetch's
        # the most the arena can ever give a copy (the homes stay): beyond it only a reserved slot can hold the
        # chunk, and evicting copies from the arena would only lose them (a prefetch evicting them over and
        # over for a chunk that can never fit there would keep another thread's chunk in flight forever)
        beyond = chunk.capacity > mem.arena.capacity - (0 if home else self._reserved[tier])
        slot = slot_class(mem.slot_sizes, chunk.capacity) if not home else None

        def in_class(
            victim: Chunk,
        ) -> bool:  # beyond the arena, only a copy in a slot of its class makes room
            return mem.slot_size(victim.copies[tier]) == slot

        while True:
            alloc = None if beyond else mem.alloc(chunk.capacity, lowest=home)
            if alloc is None and not home:
                alloc = mem.alloc_reserved(chunk.capacity)  # a prefetch too: the copy can be evicted
            if alloc is not None:
                return alloc
            if beyond and slot is None and not blocking:
                return None
            if not blocking and not self._room_can_be_made(tier, chunk, before, beyond, slot):
                # evicting what it may would still leave no room: a prefetch evicting those copies only to
                # fail would lose them, and the next prefetch would bring them back and lose them again
                return None
            # the best victim now: evicting one changes no other's place, and a blocking call may have
            # waited (others' copies came and went), so each look reads the front of the tier's order again
            victims = self._victims(
                tier,
                exclude=chunk,
                before=before,
                limit=1,
                keep=in_class if beyond and slot is not None else None,
            )
            if victims:
                victim = victims[0]
                if self._evict(victim, tier, blocking):
                    continue
                if blocking and victim.state not in IN_FLIGHT:
                    # a blocking eviction returns without starting a transfer only when the victim moved
                    # while it waited for room (a prefetch evicted it first): look again
                    continue
            if not blocking:
                return None  # a write-back may have started; a later prefetch will use the room
            in_flight = any(c.state in IN_FLIGHT for c in self._chunks)
            if in_flight or self._released_elsewhere(tier):
                # room comes from a transfer finishing, or from another thread (the optimizer worker)
                # releasing what it holds; a thread that can only wait for others is "stalled", and when
                # every holder is stalled nobody will release: that is a budget too small, raised below
                me = threading.get_ident()
                if not in_flight:
                    self._stalled.add(me)
                self._demand[tier] += 1
                try:
                    self._wait(on_others=True)
                finally:
                    self._demand[tier] -= 1
                    self._stalled.discard(me)
                continue
            raise BudgetError(
                tier.value,
                chunk.capacity,
                mem.largest_free(),
                BUDGET_SETTING[tier],
                f"for chunk {chunk.name!r}; everything else resident there is in use "
                f"({self._in_use_summary(tier)}; {format_size(mem.free_bytes)} free in all)",
            )

    def _room_can_be_made(
        self, tier: Tier, chunk: Chunk, before: float, beyond: bool, slot: int | None
    ) -> bool:
        """Whether a prefetch evicting the copies it may evict (used later than ``before``) would make room for
        ``chunk`` on ``tier``: a copy in a reserved slot of the chunk's class frees one; copies in the arena
        free their ranges, which must join the free ones into a range the chunk fits."""
        mem = self._mem[tier]
        arena: list[int] = []
        for victim in self._victims(tier, exclude=chunk, before=before):
            where = mem.slot_size(victim.copies[tier])
            if where is not None and where == slot:
                return True
            if where is None:
                arena.append(victim.copies[tier].offset)
        return not beyond and bool(arena) and mem.arena.fits_after(chunk.capacity, arena)

    def _claim(
        self, chunk: Chunk, tier: Tier, blocking: bool, before: float, still_wanted: Callable[[], bool]
    ) -> Allocation | None:
        """Space for ``chunk`` on ``tier``: its existing copy's, or a new allocation.

        Making room may wait (releasing the lock), and meanwhile a completion's prefetch may move this very
        chunk, even give it a copy on ``tier``. So the caller's precondition is checked again afterwards; if
        it no longer holds, or another copy appeared, a new allocation is returned to the arena and None
        returned: a chunk never holds two allocations on one tier.
        """
        existing = chunk.copies.get(tier)
        alloc = existing or self._alloc(tier, chunk, blocking, before)
        if alloc is None:
            return None
        if still_wanted() and chunk.copies.get(tier) is existing:
            return alloc
        if existing is None:
            self._mem[tier].free(alloc)
        return None

    def _in_use_summary(self, tier: Tier, limit: int = 6) -> str:
        used = [c for c in self._chunks if c.state is S.IN_USE and c.use_tier is tier]
        names = ", ".join(f"{c.name} ({format_size(c.capacity)})" for c in used[:limit])
        more = f" and {len(used) - limit} more" if len(used) > limit else ""
        return f"in use: {names or 'nothing'}{more}"

    def _released_elsewhere(self, tier: Tier) -> bool:
        """Whether a thread other than this one, and not itself stalled, holds a chunk in use on ``tier``."""
        me = threading.get_ident()
        for chunk in self._chunks:
            if chunk.state is S.IN_USE and chunk.use_tier is tier:
                for holder in self._holders.get(chunk.id, {}):
                    if holder != me and holder not in self._stalled:
                        return True
        return False

    def _note_copy(self, chunk: Chunk, tier: Tier) -> None:
        """``chunk`` got a copy on ``tier``: one ``_victims`` looks at, unless ``tier`` is its home."""
        if tier is not chunk.home and tier is not Tier.DISK:
            self._cached[tier][chunk.id] = chunk
            self._order[tier].put(self.scheduler.victim_key(chunk.id, chunk.last_use, tier))

    def _rekey(self, chunk: Chunk) -> None:
        """``chunk`` was accessed (its next use and last use moved): its place among each tier's victims."""
        for tier, order in self._order.items():
            if chunk.id in order:
                order.put(self.scheduler.victim_key(chunk.id, chunk.last_use, tier))

    def _victims(
        self,
        tier: Tier,
        exclude: Chunk,
        before: float,
        limit: int | None = None,
        keep: Callable[[Chunk], bool] | None = None,
    ) -> list[Chunk]:
        """The copies on ``tier`` that may be evicted now, best victim first (the scheduler's order), at most
        ``limit`` of them: only those used later than ``before`` accesses from now, and that ``keep`` keeps.

        The tier's copies are kept in that order (``_order``), so this reads the front of it: the copies
        passed over are those that cannot go now (in use, in flight, waited for), not every copy."""
        sched = self.scheduler
        if self._order_epoch != sched.epoch:  # every chunk's next use may have moved: order them again
            self._order_epoch = sched.epoch
            for t, order in self._order.items():
                order.clear()
                for c in self._cached[t].values():
                    order.put(sched.victim_key(c.id, c.last_use, t))
        cached, now = self._cached[tier], sched.now
        out: list[Chunk] = []
        gone: list[int] = []
        for key in self._order[tier]:
            c = cached[key[2]]
            if tier not in c.copies:
                gone.append(c.id)
                continue
            if before != math.inf and -key[0] - now <= before:
                break  # the rest are used sooner still
            if (
                c is not exclude
                and (c.id, tier) not in self._wanted
                and (tier is Tier.DEVICE or (c.id, Tier.DEVICE) not in self._wanted)
                # a chunk in use elsewhere can still give up its copy here: the copy in use holds its bytes
                and (c.state is not S.IN_USE or (c.use_tier is not tier and c.use_tier in c.valid))
                and c.state not in IN_FLIGHT
                and c.error is None
                and (keep is None or keep(c))
            ):
                out.append(c)
                if limit is not None and len(out) == limit:
                    break
        for cid in gone:
            del cached[cid]
            self._order[tier].drop(cid)
        return out

    def _evict(self, victim: Chunk, tier: Tier, blocking: bool) -> bool:
        """Free ``victim``'s copy on ``tier``. True if freed now; False if a write-back was started
        (its completion frees the space) or could not be started."""
        if victim.valid - {tier}:
            self._drop(victim, tier)
            return True
        if tier is Tier.DEVICE:
            self._start_copy(victim, Tier.DEVICE, Tier.HOST, blocking=blocking, then_drop=True)
        elif victim.home is Tier.DEVICE:
            self._start_copy(victim, Tier.HOST, Tier.DEVICE, blocking=blocking, then_drop=True)
        else:
            self._start_write(victim, drop_host=True)
        return False

    def _drop(self, chunk: Chunk, tier: Tier) -> None:
        """Forget ``chunk``'s copy on ``tier`` (another valid copy exists); free it unless it is home."""
        self._invalidate(chunk, tier)
        self._settle(chunk)

    def _invalidate(self, chunk: Chunk, tier: Tier) -> None:
        chunk.valid.discard(tier)
        if tier is not chunk.home and tier in chunk.copies and tier is not Tier.DISK:
            if tier is Tier.DEVICE and chunk.device_event is not None:
                chunk.device_event.synchronize()  # kernels done with it
            self._mem[tier].free(chunk.copies.pop(tier))

    def _settle(self, chunk: Chunk) -> None:
        """Set a resting chunk's state to where its newest copy is."""
        if chunk.state is S.IN_USE or chunk.state in IN_FLIGHT or not chunk.valid:
            return
        top = min(chunk.valid, key=lambda t: list(Tier).index(t))
        if chunk.state is not _SETTLED[top]:
            chunk.transition(_SETTLED[top])
        self._cond.notify_all()

    def _start_copy(
        self,
        chunk: Chunk,
        src: Tier,
        dst: Tier,
        blocking: bool,
        before: float = math.inf,
        then_drop: bool = False,
    ) -> bool:
        alloc = self._claim(
            chunk,
            dst,
            blocking,
            before,
            lambda: (
                chunk.state not in IN_FLIGHT
                and chunk.state is not S.IN_USE
                and src in chunk.valid
                and dst not in chunk.valid
            ),
        )
        if alloc is None:
            return False
        chunk.copies[dst] = alloc
        self._note_copy(chunk, dst)
        chunk.transition(S.TO_DEVICE if dst is Tier.DEVICE else S.TO_HOST)
        # the copy stream waits for the compute stream's last use of the chunk's device memory both ways: a
        # copy out must not read it before the kernels writing it are done, and a copy in (into the home
        # copy of a device-homed chunk, after its host copy changed) must not overwrite it under kernels
        # still reading it; a fresh device range was synchronized with its previous user when freed
        label = f"{src.value}->{dst.value} {chunk.name}"
        if self.ledger:
            handle = self._in_flight(label, chunk, src, dst)
        else:
            handle = self.aio.copy(alloc.tensor, chunk.copies[src].tensor, label, chunk.device_event)
        ok, fail = (S.ON_DEVICE, S.ON_HOST) if dst is Tier.DEVICE else (S.ON_HOST, S.ON_DEVICE)
        drop = src if then_drop else None
        self._then(chunk, handle, lambda h: self._done(chunk, h, src, dst, ok, fail, drop=drop))
        return True

    def _start_load(self, chunk: Chunk, blocking: bool, before: float = math.inf) -> bool:
        slot = self._slots[chunk.id]
        assert isinstance(slot, InPlace) or (self.disk is not None and chunk.disk_checksums is not None)
        alloc = self._claim(chunk, Tier.HOST, blocking, before, lambda: chunk.state is S.ON_DISK)
        if alloc is None:
            return False
        chunk.copies[Tier.HOST] = alloc
        self._note_copy(chunk, Tier.HOST)
        chunk.transition(S.LOADING)
        sums: list[int] = []
        try:
            if self.ledger:
                handle = self._in_flight(f"read {chunk.name}", chunk, Tier.DISK, Tier.HOST)
            elif isinstance(slot, InPlace):
                handle = self.files.read(chunk.name, slot, alloc.tensor, chunk.disk_checksums, sums)
            else:
                assert self.disk is not None and chunk.disk_checksums is not None
                handle = self.disk.read(chunk, slot, alloc.tensor, chunk.disk_checksums)
        except BaseException:
            chunk.transition(S.ON_DISK)
            self._invalidate(chunk, Tier.HOST)
            raise

        def done(h: IOHandle) -> None:
            if h.error is None and chunk.disk_checksums is None:  # an in-place chunk's first read
                chunk.disk_checksums = tuple(sums)
            self._done(chunk, h, Tier.DISK, Tier.HOST, S.ON_HOST, S.ON_DISK)

        self._then(chunk, handle, done)
        return True

    def _start_write(self, chunk: Chunk, drop_host: bool) -> None:
        if self.in_place(chunk) is not None:
            raise StateError(self._read_only(chunk))
        if chunk.id not in self._slots:
            raise StateError(
                f"chunk {chunk.name!r} has no disk copy yet: its file was to be given (home_in_file)"
            )
        assert self.disk is not None
        chunk.transition(S.WRITING)
        slot = self._slots[chunk.id]
        assert isinstance(slot, DiskSlot)  # a chunk read in place is never written (above)
        sums: list[int] = []
        if self.ledger:
            handle = self._in_flight(f"write {chunk.name}", chunk, Tier.HOST, Tier.DISK)
        else:
            handle, sums = self.disk.write(chunk, slot, chunk.copies[Tier.HOST].tensor)

        def done(h: IOHandle) -> None:
            if h.error is None:
                chunk.disk_checksums = tuple(sums)
            self._done(
                chunk, h, Tier.HOST, Tier.DISK, S.ON_HOST, S.ON_HOST, drop=Tier.HOST if drop_host else None
            )

        self._then(chunk, handle, done)

    def _then(self, chunk: Chunk, handle: IOHandle, done: Callable[[IOHandle], None]) -> None:
        """``done`` when ``chunk``'s transfer ``handle`` completes; an I/O thread's transfer is also what
        ``close`` waits for (a ledger's is finished by the store's next call, ``_land``)."""
        if not self.ledger:
            self._transfers[chunk.id] = handle
        handle.add_done_callback(done)

    def _done(
        self,
        chunk: Chunk,
        handle: IOHandle,
        src: Tier,
        dst: Tier,
        ok: ChunkState,
        fail: ChunkState,
        drop: Tier | None = None,
    ) -> None:
        """Completion of a transfer (on an I/O thread): record the new state and wake waiters."""
        with self._cond:
            try:
                if handle.error is not None:
                    chunk.error = handle.error
                    if (src, dst) != (Tier.DISK, Tier.HOST):
                        # a failed write-back or copy-out may lose data: stop the run, not just this chunk
                        self._fatal = self._fatal or handle.error
                    chunk.transition(fail)
                    self._invalidate(chunk, dst)  # the half-filled destination holds nothing valid
                else:
                    link = f"{src.value}->{dst.value}"
                    self._moved[link] = self._moved.get(link, 0) + chunk.capacity
                    per_chunk = self._moved_by.setdefault(chunk.id, {})
                    per_chunk[link] = per_chunk.get(link, 0) + chunk.capacity
                    chunk.valid.add(dst)
                    chunk.transition(ok)
                    if drop is not None and chunk.valid - {drop}:
                        self._drop(chunk, drop)
                    self._settle(chunk)
                    # a finished load may be the next step of a device prefetch (disk -> host -> device),
                    # and freed space may let a waiting prefetch start: plan again (never blocks)
                    self._prefetch()
            except BaseException as exc:  # never leave waiters hanging on a chunk that will not settle
                self._fatal = self._fatal or exc
                raise
            finally:
                self._cond.notify_all()

    def _prefetch(self) -> None:
        """Start transfers of the chunks the trace says come next, without blocking or evicting sooner uses.

        Runs on the compute thread after each acquire and on I/O threads after each completed transfer.
        """
        sched = self.scheduler
        if not sched.replaying or self._closing:
            return
        # a repeating pass's copies to the device are made when asked for: a device tier a few layers deep,
        # prefetching ahead along it, evicted layers the next pass needed and copied some twice a pass
        depth = 0 if self._repeating else self.config.prefetch_depth
        for cid in sched.upcoming(depth, Tier.DEVICE):
            chunk = self._chunks[cid]
            if self._busy(chunk) or Tier.DEVICE in chunk.valid:
                continue
            if Tier.HOST in chunk.valid:
                self._start_copy(
                    chunk, Tier.HOST, Tier.DEVICE, blocking=False, before=sched.next_use(cid, Tier.DEVICE)
                )
        for cid in sched.upcoming(self.config.host_prefetch_depth):
            chunk = self._chunks[cid]
            if self._busy(chunk) or chunk.valid & {Tier.HOST, Tier.DEVICE} or Tier.DISK not in chunk.valid:
                continue
            self._start_load(chunk, blocking=False, before=sched.next_use(cid))

    @staticmethod
    def _busy(chunk: Chunk) -> bool:
        return chunk.state in IN_FLIGHT or chunk.state is S.IN_USE or chunk.error is not None
