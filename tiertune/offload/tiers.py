"""The three tiers a chunk can live on, and the allocator that enforces each one's byte budget.

- device: the compute device (a CUDA GPU, or the CPU when there is none);
- host: a fixed pool of reusable buffers in host memory, pinned when CUDA is present;
- disk: one slot file in a directory on NVMe (see ``tiertune.offload.disk``).

Every tier hands out space through an ``Arena`` whose capacity *is* the budget, so the accounting
cannot drift from what is really allocated: a tier never holds more than its budget.
"""

from __future__ import annotations

import bisect
import enum
import threading
from dataclasses import dataclass

import torch

from tiertune.errors import ConfigError
from tiertune.offload.chunk import ALIGN
from tiertune.units import round_up


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

    device: 80% of the GPU's free memory (25% of available RAM when computing on the CPU);
    host: 50% of available RAM. Both leave room for what is not chunks (activations, the process, the OS).
    """
    import psutil

    available = psutil.virtual_memory().available
    if tier is Tier.HOST:
        return int(available * AUTO_HOST_FRACTION)
    if tier is not Tier.DEVICE:
        raise ConfigError(f"no automatic budget for the {tier.value} tier")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * AUTO_DEVICE_FRACTION)
    return int(available * AUTO_DEVICE_FRACTION_CPU)


class Arena:
    """Best-fit allocator of aligned byte ranges in ``[0, capacity)``, with coalescing and peak tracking.

    Thread-safe. ``alloc`` returns None when no free range is large enough; it never exceeds capacity.
    """

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity < 0:
            raise ConfigError(f"arena capacity cannot be negative, got {capacity}")
        self.capacity = capacity - capacity % align
        self.align = align
        self._free: list[tuple[int, int]] = (
            [(0, self.capacity)] if self.capacity else []
        )  # sorted (off, size)
        self._used: dict[int, int] = {}
        self.used = 0
        self.peak = 0
        self.high_water = 0  # largest end offset ever handed out (how far a backing file must reach)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free range of ``nbytes`` (rounded up to the alignment), or None if none fits."""
        size = round_up(max(nbytes, 1), self.align)
        with self._lock:
            best = -1
            for i, (_, free_size) in enumerate(self._free):
                if free_size >= size and (best < 0 or free_size < self._free[best][1]):
                    best = i
                    if free_size == size:
                        break
            if best < 0:
                return None
            offset, free_size = self._free[best]
            if free_size == size:
                del self._free[best]
            else:
                self._free[best] = (offset + size, free_size - size)
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


class MemoryTier:
    """Device or host memory: one aligned buffer of ``budget`` bytes, carved up by an ``Arena``.

    The buffer is allocated on first use and then reused for the store's life: no transfer allocates.
    On the host it is pinned when CUDA is available, so host<->device copies can run asynchronously.
    """

    def __init__(self, tier: Tier, budget: int, device: torch.device, pin: bool = False) -> None:
        self.tier = tier
        self.device = device
        self.pin = pin
        self.arena = Arena(budget)
        self._base: torch.Tensor | None = None
        self._base_lock = threading.Lock()

    @property
    def budget(self) -> int:
        return self.arena.capacity

    def _buffer(self) -> torch.Tensor:
        with self._base_lock:
            if self._base is None:
                self._base = aligned_empty(self.arena.capacity, self.device, pin=self.pin)
            return self._base

    def alloc(self, nbytes: int) -> Allocation | None:
        """An allocation of ``nbytes`` or None when the budget has no contiguous room for it."""
        offset = self.arena.alloc(nbytes)
        if offset is None:
            return None
        return Allocation(offset, _window(self._buffer(), offset, nbytes))

    def free(self, allocation: Allocation) -> None:
        self.arena.free(allocation.offset)

    def close(self) -> None:
        self._base = None


def _window(base: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """``base[offset:offset + nbytes]`` as a tensor of its own, not a view.

    Views share their base's autograd version counter: a copy into one chunk's memory would then look like
    an in-place change of every other chunk's tensors, and a backward pass that saved a chunk's weights
    would fail when a prefetch lands elsewhere in the arena. A tensor set on the same storage has its own.
    """
    window = torch.empty(0, dtype=torch.uint8, device=base.device)
    return window.set_(base.untyped_storage(), base.storage_offset() + offset, (nbytes,), (1,))


def aligned_empty(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """An uninitialized uint8 tensor of ``nbytes`` whose address is a multiple of ``ALIGN``."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)  # CUDA allocations are 512B+ aligned
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift : shift + nbytes]
