"""The three tiers a chunk can live on, and the allocator that enforces each one's byte budget.

- device: the compute device (a CUDA GPU, or the CPU when there is none);
- host: a fixed pool of reusable buffers in host memory, page-locked (pinned) when CUDA is present;
- disk: one slot file in a directory on NVMe (see ``tiertune.offload.disk``).

Every tier hands out space through an ``Arena`` whose capacity *is* the budget, so the accounting
cannot drift from what is really allocated: a tier never holds more than its budget.
"""

from __future__ import annotations

import bisect
import enum
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tiertune.errors import ConfigError
from tiertune.units import format_size, round_up

ALIGN = 4096
"""Byte alignment of every chunk buffer, capacity and shard: what O_DIRECT needs on common filesystems."""

log = logging.getLogger("tiertune.offload")


class Tier(enum.Enum):
    """A place a chunk can live, fastest first."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


BUDGET_SETTING = {
    Tier.DEVICE: "offload.device_budget",
    Tier.HOST: "offload.host_budget",
    Tier.DISK: "offload.disk_path",  # its filesystem's free space (BudgetError says so)
}


AUTO_DEVICE_FRACTION = 0.8  # of free GPU memory: the rest is for activations, workspaces, the CUDA context
AUTO_DEVICE_FRACTION_CPU = 0.25  # of available RAM, when the "device" is the CPU itself
AUTO_HOST_FRACTION = 0.5  # of available RAM


def auto_budget(tier: Tier, device: torch.device) -> int:
    """What ``auto`` means for a tier's budget, from what the machine has free now.

    device: 80% of what this process can still get on the GPU (``cuda_room``; 25% of available RAM when
    computing on the CPU); host: 50% of available RAM. Both leave room for what is not chunks (activations,
    the process, the OS).
    """
    import psutil

    available = psutil.virtual_memory().available
    if tier is Tier.HOST:
        return int(available * AUTO_HOST_FRACTION)
    if tier is not Tier.DEVICE:
        raise ConfigError(f"no automatic budget for the {tier.value} tier")
    if device.type == "cuda":
        return int(cuda_room(device) * AUTO_DEVICE_FRACTION)
    return int(available * AUTO_DEVICE_FRACTION_CPU)


def cuda_cap(device: torch.device) -> int | None:
    """The most this process's caching allocator may hold on ``device`` when a memory fraction caps it
    (``torch.cuda.set_per_process_memory_fraction``: fraction x total, as the allocator computes it), else
    None."""
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    fraction = 1.0 if get_fraction is None else float(get_fraction(device))
    if fraction >= 1.0:
        return None
    _, total = torch.cuda.mem_get_info(device)
    return int(fraction * total)


def cuda_room(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device`` now: the GPU's free memory, and under a memory
    fraction cap no more than the cap less what this process's caching allocator already reserved.

    ``mem_get_info`` reports the device's free memory whatever cap this process runs under: with
    ``set_per_process_memory_fraction`` (how the benchmarks emulate a 24 GiB card on a larger one) an
    ``auto`` budget taken from it alone would ask for more than the allocator will ever hand out.
    """
    free, _ = torch.cuda.mem_get_info(device)
    cap = cuda_cap(device)
    if cap is not None:
        free = min(free, max(0, cap - torch.cuda.memory_reserved(device)))
    return free


class Arena:
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)``, with coalescing and peak tracking.

    Thread-safe. ``alloc`` returns None when no free range is large enough; it never exceeds capacity.
    """

    def __init__(self, capacity: int, align: int = ALIGN, top: bool = False) -> None:
        if capacity < 0:
            raise ConfigError(f"arena capacity cannot be negative, got {capacity}")
        self.capacity = capacity - capacity % align
        self.align = align
        self.top = top  # best fit from the top end (see ``alloc``)
        self._free: list[tuple[int, int]] = (
            [(0, self.capacity)] if self.capacity else []
        )  # sorted (off, size)
        self._used: dict[int, int] = {}
        self.used = 0
        self.peak = 0
        self.high_water = 0  # largest end offset ever handed out (how far a backing file must reach)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int, lowest: bool = False) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up to the alignment), or None if none fits.

        Best fit: the smallest free range that fits, from its bottom end (an arena made ``top=True``: the
        highest of the smallest, from its top end). ``lowest``: the lowest range that fits, from its bottom
        end. A memory tier places the chunks homed on it lowest and cached copies best fit from the top: the
        homes stay one block at the bottom, and copies evicted around them leave the rest in one piece."""
        size = round_up(max(nbytes, 1), self.align)
        with self._lock:
            best = -1
            for i, (_, free_size) in enumerate(self._free):
                if free_size < size:
                    continue
                if lowest:
                    best = i
                    break
                if (
                    best < 0
                    or free_size < self._free[best][1]
                    or (self.top and free_size == self._free[best][1])
                ):
                    best = i
                    if free_size == size and not self.top:
                        break
            if best < 0:
                return None
            start, free_size = self._free[best]
            offset = start + free_size - size if self.top and not lowest else start
            if free_size == size:
                del self._free[best]
            elif offset == start:
                self._free[best] = (start + size, free_size - size)
            else:
                self._free[best] = (start, free_size - size)
            self._used[offset] = size
            self.used += size
            self.peak = max(self.peak, self.used)
            self.high_water = max(self.high_water, offset + size)
            return offset

    def free(self, offset: int) -> None:
        """Return the range starting at ``offset`` to the free list, merging neighbours."""
        with self._lock:
            size = self._used.pop(offset)
            self.used -= size
            i = bisect.bisect_left(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev_off, prev_size = self._free[i - 1]
                self._free[i - 1] = (prev_off, prev_size + self._free[i][1])
                del self._free[i]

    def largest_free(self) -> int:
        """Size of the largest free range: the largest allocation that would succeed now."""
        with self._lock:
            return max((s for _, s in self._free), default=0)

    def fits_after(self, nbytes: int, freed: Iterable[int]) -> bool:
        """Whether an allocation of ``nbytes`` would succeed once the ranges starting at offsets ``freed`` are
        freed (they and the free ranges next to them join, as ``free`` joins them)."""
        size = round_up(max(nbytes, 1), self.align)
        with self._lock:
            ranges = sorted([*self._free, *((o, self._used[o]) for o in freed if o in self._used)])
        run_start, run_end = -1, -1
        for start, length in ranges:
            if start != run_end:
                run_start = start
            run_end = start + length
            if run_end - run_start >= size:
                return True
        return False

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.used

    def check(self) -> None:
        """Verify the invariants (no overlap, sizes add up). For tests."""
        with self._lock:
            ranges = sorted([(o, s) for o, s in self._free] + list(self._used.items()))
            end = 0
            for off, size in ranges:
                assert off >= end, f"overlapping ranges at {off}"
                end = off + size
            assert end <= self.capacity
            assert sum(s for _, s in ranges) == self.capacity
            assert self.used == sum(self._used.values()) <= self.capacity


@dataclass(frozen=True)
class Allocation:
    """A chunk-sized, aligned range of a memory tier: ``tensor`` is its uint8 view."""

    offset: int
    tensor: torch.Tensor


def slot_class(sizes: Sequence[int], nbytes: int) -> int | None:
    """The reserved slot size a chunk of ``nbytes`` may use among ``sizes`` (sorted): the smallest that holds
    it, so each size serves the chunks between the next smaller size and itself; None when none does."""
    i = bisect.bisect_left(sizes, round_up(max(nbytes, 1), ALIGN))
    return sizes[i] if i < len(sizes) else None


class MemoryTier:
    """Device or host memory: one aligned buffer of ``budget`` bytes, carved up by an ``Arena``.

    The buffer is allocated on first use and then reused for the store's life: no transfer allocates.
    In host memory (the host tier, and the device tier when computing on the CPU) it is a ``HostMemory`` of
    exactly the budget, page-locked for CUDA when ``pin`` is set (True: for the current CUDA device; a
    ``torch.device``: for that one), so host<->device copies can run asynchronously.

    ``reserve`` ({slot size: count}) sets slots apart at the top of the budget: the run's plan reserves, per
    size class, as many slots as chunks of that class can be in use there at once (``engine.memory``). The
    rest is the arena, shared by the chunks homed here and cached copies, where fragmentation can leave no
    range large enough; a chunk that must be placed now then takes a slot of its class (``alloc_reserved``),
    which only chunks of its class use. So the chunks in use can never fragment the tier into a failure:
    at most one fewer than the slots of a class hold chunks of that class in use, and the others hold copies
    that can be evicted.
    """

    def __init__(
        self,
        tier: Tier,
        budget: int,
        device: torch.device,
        pin: bool | torch.device = False,
        reserve: Mapping[int, int] | None = None,
    ) -> None:
        self.tier = tier
        self.device = device
        self.pin = pin
        total = budget - budget % ALIGN
        wanted = {round_up(size, ALIGN): n for size, n in (reserve or {}).items() if n > 0}
        reserved = sum(size * n for size, n in wanted.items())
        if reserved > total:
            raise ConfigError(
                f"{BUDGET_SETTING[tier]} is {format_size(total)} but the run's plan reserves {format_size(reserved)} "
                "there for the chunks in use at once"
            )
        self.capacity = total
        self.arena = Arena(total - reserved, top=True)
        self.slot_sizes = sorted(wanted)
        self._slots: dict[int, int] = {}  # offset -> size, the reserved slots
        self._slot_used: dict[int, int] = {}  # offset -> bytes allocated there (the free slots are absent)
        offset = self.arena.capacity
        for size in self.slot_sizes:
            for _ in range(wanted[size]):
                self._slots[offset] = size
                offset += size
        self._peak = 0
        self._base: torch.Tensor | None = None
        self._host: HostMemory | None = None
        self._base_lock = threading.Lock()

    @property
    def budget(self) -> int:
        return self.capacity

    @property
    def reserved(self) -> int:
        """Bytes set apart in reserved slots."""
        return self.capacity - self.arena.capacity

    @property
    def used(self) -> int:
        """Bytes allocated now, in the arena and the reserved slots."""
        return self.arena.used + sum(self._slot_used.values())

    @property
    def peak(self) -> int:
        """The most bytes ever allocated at once (since ``reset_peak``)."""
        return max(self._peak, self.arena.peak)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        """The largest allocation that would succeed now, in the arena or a free reserved slot."""
        free_slots = [size for off, size in self._slots.items() if off not in self._slot_used]
        return max([self.arena.largest_free(), *free_slots])

    def reset_peak(self) -> None:
        self.arena.reset_peak()
        self._peak = self.used

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory this tier holds page-locked now: its budget once its buffer exists (never
        a rounded-up size), 0 before, after ``close`` and when not pinned."""
        host = self._host
        return 0 if host is None else host.pinned_bytes

    def _buffer(self) -> torch.Tensor:
        with self._base_lock:
            if self._base is None:
                if self.device.type == "cpu":
                    pin_device = _pin_device(self.pin)
                    self._host = HostMemory(self.capacity, pin_device, BUDGET_SETTING[self.tier])
                    self._base = self._host.tensor
                else:
                    self._base = aligned_empty(self.capacity, self.device)
            return self._base

    def allocate(self) -> None:
        """Allocate (and pin) the buffer now rather than on first use, so that memory the OS or CUDA refuses
        fails here."""
        self._buffer()

    def alloc(self, nbytes: int, lowest: bool = False) -> Allocation | None:
        """An allocation of ``nbytes`` in the arena, or None when it has no contiguous room for it
        (``lowest``: the lowest range that fits, for a chunk homed here)."""
        offset = self.arena.alloc(nbytes, lowest)
        if offset is None:
            return None
        self._peak = max(self._peak, self.used)
        return Allocation(offset, _window(self._buffer(), offset, nbytes))

    def alloc_reserved(self, nbytes: int) -> Allocation | None:
        """A free reserved slot of ``nbytes``' class (``slot_class``), or None when all of them are taken."""
        size = slot_class(self.slot_sizes, nbytes)
        for offset, slot in self._slots.items():
            if slot == size and offset not in self._slot_used:
                self._slot_used[offset] = round_up(max(nbytes, 1), ALIGN)
                self._peak = max(self._peak, self.used)
                return Allocation(offset, _window(self._buffer(), offset, nbytes))
        return None

    def in_reserve(self, allocation: Allocation) -> bool:
        """Whether ``allocation`` is a reserved slot."""
        return allocation.offset in self._slots

    def slot_size(self, allocation: Allocation) -> int | None:
        """The size of the reserved slot ``allocation`` is, or None for a range of the arena."""
        return self._slots.get(allocation.offset)

    def free(self, allocation: Allocation) -> None:
        if allocation.offset in self._slots:
            del self._slot_used[allocation.offset]
        else:
            self.arena.free(allocation.offset)

    def close(self) -> None:
        """Give the buffer back: host memory is unpinned now and unmapped once no allocation's tensor refers
        to it any more (see ``HostMemory``). No copy into or out of it may still be in flight."""
        with self._base_lock:
            host, self._host, self._base = self._host, None, None
        if host is not None:
            host.close()


def _pin_device(pin: bool | torch.device) -> torch.device | None:
    if isinstance(pin, torch.device):
        return pin if pin.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", torch.cuda.current_device()) if pin else None


def _window(base: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """``base[offset:offset + nbytes]`` as a tensor of its own, not a view.

    Views share their base's autograd version counter: a copy into one chunk's memory would then look like
    an in-place change of every other chunk's tensors, and a backward pass that saved a chunk's weights
    would fail when a prefetch lands elsewhere in the arena. A tensor set on the same storage has its own.
    """
    window = torch.empty(0, dtype=torch.uint8, device=base.device)
    return window.set_(base.untyped_storage(), base.storage_offset() + offset, (nbytes,), (1,))


def aligned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` whose address is a multiple of ``ALIGN`` (small pageable
    buffers such as the disk tier's headers; a tier's arena is a ``HostMemory``)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # CUDA allocations are 512B+ aligned
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]


HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own
# torch.cuda._pin_memory_utils registers memory (cudaHostRegisterDefault, 0, pins it for the current one only)


def host_pinned_bytes(budget: int, caching_allocator: bool = False) -> int:
    """Bytes page-locked for a host tier of ``budget``.

    ``HostMemory`` pins exactly the arena's capacity (the budget rounded down to ``ALIGN``). The former
    ``torch.empty(capacity + ALIGN, pin_memory=True)`` (``caching_allocator=True``) went through torch's
    caching host allocator, which rounds every request up to the next power of two (CachingHostAllocator.h,
    ``c10::llvm::PowerOf2Ceil``, unless ``pinned_max_round_threshold_mb`` is configured): a 40 GiB budget
    pinned 64 GiB, and a 32 GiB one, plus the alignment slack, 64 GiB as well.
    """
    capacity = budget - budget % ALIGN
    if not caching_allocator:
        return capacity
    return 1 << (capacity + ALIGN - 1).bit_length()  # PowerOf2Ceil(capacity + ALIGN)


class HostMemory:
    """``nbytes`` of page-aligned anonymous host memory (an ``mmap``) as the uint8 tensor ``tensor``,
    page-locked for CUDA with ``cudaHostRegister`` when ``pin_device`` is a CUDA device.

    Exactly ``nbytes`` are mapped and pinned, unlike ``torch.empty(pin_memory=True)``, whose caching host
    allocator rounds up to a power of two (``host_pinned_bytes``) and keeps the block pinned in its cache
    after the tensor is gone. Registered memory is what ``is_pinned()`` reports (the pointer's CUDA memory
    type is host) and what ``copy_(non_blocking=True)`` copies asynchronously by DMA.

    Lifetime: ``tensor`` and every tensor on its storage hold a reference to the mapping, and it is unmapped
    only when the last of them is gone: a view never outlives its memory. ``close`` (or garbage collection
    of this object) unregisters the memory from CUDA; views still alive then stay valid as ordinary pageable
    memory (copies from them become synchronous). Unregistering while a copy into or out of the memory is
    in flight is undefined in CUDA: synchronize first (``ChunkStore.close`` does). The mapping is never
    ``mmap.close``d explicitly, since that would unmap it under live views.

    Pages are not populated up front (no ``MAP_POPULATE``, no huge pages): registration faults every page in
    anyway, and without CUDA an untouched page costs nothing, as with ``torch.empty``. ``MAP_HUGETLB`` would
    need huge pages reserved by the administrator and fails without them.
    """

    def __init__(
        self, nbytes: int, pin_device: torch.device | None = None, setting: str = "offload.host_budget"
    ) -> None:
        self.nbytes = nbytes
        self.pinned_bytes = 0
        self._unregister: Callable[[], None] | None = None
        self._mapping: Callable[[], mmap.mmap | None] = lambda: None  # alive while mapped (for tests)
        if nbytes == 0:  # mmap refuses a length of 0
            self.tensor = torch.empty(0, dtype=torch.uint8)
            return
        try:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise ConfigError(
                f"{setting} is {format_size(nbytes)} but the OS refused to map that much memory ({exc}); "
                f"lower {setting} or set it to auto"
            ) from exc
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` while any view lives
        self._mapping = weakref.ref(mapping)
        if pin_device is not None:
            self._pin(mapping, pin_device, setting)

    def _pin(self, mapping: mmap.mmap, device: torch.device, setting: str) -> None:
        ptr, nbytes = self.tensor.data_ptr(), self.nbytes
        began = time.perf_counter()
        code = _on_own_thread(
            lambda: int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, HOST_REGISTER_PORTABLE)), device
        )
        if code != 0:
            raise ConfigError(
                f"{setting} is {format_size(nbytes)} but CUDA could not page-lock that much host memory "
                f"({_cuda_error(code)}{_memlock_limit()}); lower {setting}, raise the limit on locked memory "
                "(ulimit -l, or LimitMEMLOCK= for a systemd service, --ulimit memlock=-1 for docker) or "
                "free host memory"
            )
        self.pinned_bytes = nbytes
        # the finalizer holds `mapping`: it cannot be unmapped before it is unregistered, even when this
        # object is collected without close()
        self._unregister = finalizer = weakref.finalize(self, _unregister, ptr, device, mapping)
        finalizer.atexit = False  # the process's exit releases it; CUDA may be gone by then
        seconds = time.perf_counter() - began
        log.info("host memory: %s page-locked for %s in %.2f s", format_size(nbytes), device, seconds)

    def close(self) -> None:
        """Unregister from CUDA and drop ``tensor`` (the memory itself goes when the last view of it does)."""
        unregister, self._unregister = self._unregister, None
        self.pinned_bytes = 0
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if unregister is not None:
            unregister()


def _unregister(ptr: int, device: torch.device, mapping: mmap.mmap) -> None:
    size = format_size(len(mapping))
    try:
        code = _on_own_thread(lambda: int(torch.cuda.cudart().cudaHostUnregister(ptr)), device)
    except RuntimeError as exc:  # e.g. no thread can start while the interpreter exits
        log.warning("could not unregister %s of page-locked host memory: %s", size, exc)
        return
    if code != 0:
        log.warning("cudaHostUnregister of %s of page-locked host memory failed: %s", size, _cuda_error(code))


def _on_own_thread(call: Callable[[], int], device: torch.device) -> int:
    """``call()`` (a CUDA runtime call returning its error code) on a short-lived thread whose current device
    is ``device``.

    A failed runtime call leaves its error as the calling thread's "last error", and torch's next kernel
    launch check on that thread (``cudaGetLastError``) would then raise it as if that kernel had failed;
    torch's binding does not clear it. Here it ends with the thread. Setting the device keeps the runtime
    from creating a context on GPU 0 for a process that computes on another one.
    """
    result: list[int | BaseException] = []

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            result.append(call())
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run, name="tiertune-pin", daemon=True)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _cuda_error(code: int) -> str:
    try:
        return str(torch.cuda.CudaError(code))
    except Exception:  # only the message: the code is what matters
        return f"cudaError {code}"


def _memlock_limit() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f"; this process's limit on locked memory (ulimit -l) is {format_size(soft)}"
