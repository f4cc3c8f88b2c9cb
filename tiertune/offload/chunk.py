"""Chunks: contiguous, aligned flat buffers that hold many tensors and move between tiers as one.

A chunk's bytes are laid out once (``pack_tensors``); every tensor registered in it is a view at a fixed
offset and never spans two chunks. The capacity is a multiple of ``ALIGN * num_shards`` so that it splits
into equal, aligned shards for ZeRO sharding and satisfies O_DIRECT on every shard.

The chunk's life is a state machine (``ChunkState`` and the ``TRANSITIONS`` table). The state says where
the newest copy is and which transfer, if any, is in flight; which other tiers also hold a valid copy is
kept in ``Chunk.valid``. Only the store changes states, always under its lock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from tiertune.errors import ConfigError, StateError
from tiertune.offload.tiers import ALIGN, Allocation, Tier
from tiertune.units import round_up

if TYPE_CHECKING:
    from concurrent.futures import Future

Entry = tuple[str, Sequence[int], torch.dtype]  # a tensor: its name, shape and dtype

TENSOR_ALIGN = 256
"""Byte alignment of each tensor inside a chunk, so that kernels can use wide vector loads."""

SHARDED_TENSOR_ALIGN = 1024
"""Byte alignment of each tensor inside a chunk split into several shards: a shard boundary inside a tensor
then falls on a multiple of 256 elements of 4 bytes (512 of 2), so that a rank's part of a tensor starts a
block of bitsandbytes' 8-bit optimizer states (256 elements) and every block is the one-process run's."""


def tensor_align(num_shards: int) -> int:
    """Byte alignment of tensors in a chunk of ``num_shards`` shards."""
    return TENSOR_ALIGN if num_shards == 1 else SHARDED_TENSOR_ALIGN


class ChunkState(enum.Enum):
    """Where a chunk's newest bytes are, or which transfer of them is in flight."""

    EMPTY = "empty"  # registered and never written, or discarded: no valid bytes anywhere
    ON_DISK = "on_disk"  # newest copy only on disk
    LOADING = "loading"  # disk -> host read in flight
    ON_HOST = "on_host"  # newest copy on host (disk may hold a valid copy too)
    TO_DEVICE = "to_device"  # host -> device copy in flight
    ON_DEVICE = "on_device"  # newest copy on the device (host/disk may hold valid copies too)
    TO_HOST = "to_host"  # device -> host copy in flight (eviction of a modified chunk)
    WRITING = "writing"  # host -> disk write in flight
    IN_USE = "in_use"  # acquired by compute on one tier; never moved or evicted while in use


S = ChunkState
TRANSITIONS: Mapping[ChunkState, frozenset[ChunkState]] = {
    # any resting state -> EMPTY: the contents were discarded (``ChunkStore.discard``)
    # EMPTY -> ON_DISK: a frozen chunk's bytes found in a file as they are (``ChunkStore.home_in_file``)
    S.EMPTY: frozenset({S.IN_USE, S.ON_DISK}),
    S.ON_DISK: frozenset({S.LOADING, S.EMPTY}),
    # a failed read rolls back to ON_DISK
    S.LOADING: frozenset({S.ON_HOST, S.ON_DISK}),
    # ON_HOST -> ON_DISK/ON_DEVICE: the host copy was dropped while another valid copy remains
    S.ON_HOST: frozenset({S.TO_DEVICE, S.WRITING, S.IN_USE, S.ON_DISK, S.ON_DEVICE, S.EMPTY}),
    # a failed copy rolls back to ON_HOST
    S.TO_DEVICE: frozenset({S.ON_DEVICE, S.ON_HOST}),
    # ON_DEVICE -> ON_HOST/ON_DISK drops a device copy while a lower copy is still valid;
    # ON_DEVICE -> WRITING writes a valid host copy to disk while the device copy stays valid
    S.ON_DEVICE: frozenset({S.IN_USE, S.TO_HOST, S.ON_HOST, S.ON_DISK, S.WRITING, S.EMPTY}),
    S.TO_HOST: frozenset({S.ON_HOST, S.ON_DEVICE}),
    S.WRITING: frozenset({S.ON_HOST}),
    S.IN_USE: frozenset({S.ON_DEVICE, S.ON_HOST}),
}
del S

IN_FLIGHT = frozenset({ChunkState.LOADING, ChunkState.TO_DEVICE, ChunkState.TO_HOST, ChunkState.WRITING})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor's place in a chunk: name, shape, dtype and byte offset."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class ChunkLayout:
    """The byte layout of one chunk: its tensors and its padded capacity."""

    tensors: tuple[TensorSpec, ...]
    capacity: int
    num_shards: int = 1

    @property
    def used(self) -> int:
        """Bytes up to the end of the last tensor (the rest is padding)."""
        return max((t.offset + t.nbytes for t in self.tensors), default=0)

    def shard_range(self, rank: int, world_size: int | None = None) -> tuple[int, int]:
        """Byte range [start, end) of shard ``rank`` out of ``world_size`` (default: ``num_shards``)."""
        world = self.num_shards if world_size is None else world_size
        if self.capacity % (world * ALIGN):
            raise ConfigError(
                f"chunk of {self.capacity} bytes was padded for {self.num_shards} shards and cannot be split "
                f"into {world}; build the store with num_shards={world}"
            )
        size = self.capacity // world
        return rank * size, (rank + 1) * size


def layout_views(layout: ChunkLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed tensor views of ``layout``'s tensors over ``flat``, a uint8 buffer of its ``capacity`` bytes."""
    out: dict[str, torch.Tensor] = {}
    for spec in layout.tensors:
        raw = flat[spec.offset : spec.offset + spec.nbytes]
        out[spec.name] = raw.view(spec.dtype).view(spec.shape)
    return out


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def pack_tensors(
    entries: Iterable[Entry | Sequence[Entry]],
    chunk_size: int,
    num_shards: int = 1,
) -> list[ChunkLayout]:
    """Lay tensors out in order into chunks of at most ``chunk_size`` bytes (before padding).

    An entry is ``(name, shape, dtype)``, or a list of them that stays in one chunk (a quantized weight and
    its statistics). A tensor never spans two chunks: one larger than ``chunk_size`` gets a chunk of its
    own. Each tensor starts at a multiple of ``tensor_align(num_shards)``; each capacity is a multiple of
    ``ALIGN * num_shards``.
    """
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    if num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    layouts: list[ChunkLayout] = []
    current: list[TensorSpec] = []
    offset = 0
    seen: set[str] = set()
    align = tensor_align(num_shards)

    def close() -> None:
        nonlocal current, offset
        if current:
            layouts.append(_layout(current, num_shards))
        current, offset = [], 0

    def place(unit: list, start: int) -> list[TensorSpec]:
        specs = []
        for name, shape, dtype in unit:
            start = round_up(start, align)
            shape = tuple(int(s) for s in shape)
            specs.append(TensorSpec(name, shape, dtype, start))
            start += math.prod(shape) * itemsize(dtype)
        return specs

    for entry in entries:
        unit = _unit(entry)
        for name, _, _ in unit:
            if name in seen:
                raise ConfigError(f"tensor {name!r} registered twice")
            seen.add(name)
        specs = place(unit, offset)
        if current and specs[-1].offset + specs[-1].nbytes > chunk_size:
            close()
            specs = place(unit, 0)
        current.extend(specs)
        offset = specs[-1].offset + specs[-1].nbytes
    close()
    return layouts


def _unit(entry: Entry | Sequence[Entry]) -> list[Entry]:
    """The tensors of ``entry``: one tensor's ``(name, shape, dtype)``, or a unit of several."""
    if isinstance(entry[0], str):
        return [cast(Entry, entry)]
    return list(cast(Sequence[Entry], entry))


def _layout(tensors: list[TensorSpec], num_shards: int) -> ChunkLayout:
    used = max(t.offset + t.nbytes for t in tensors)
    capacity = round_up(max(used, 1), ALIGN * num_shards)
    return ChunkLayout(tuple(tensors), capacity, num_shards)


@dataclass(eq=False)
class Chunk:
    """A chunk registered in a store: its layout, home tier, state and the copies that exist.

    ``copies`` maps a tier to the allocation holding this chunk there (a memory allocation or a disk
    slot); ``valid`` is the set of tiers whose copy holds the newest bytes. The state machine and the
    bookkeeping are changed only by the owning ``ChunkStore`` under its lock.
    """

    id: int
    name: str
    layout: ChunkLayout
    home: Tier
    state: ChunkState = ChunkState.EMPTY
    copies: dict[Tier, Allocation] = field(
        default_factory=dict
    )  # a memory tier's (the disk's: the store's slots)
    valid: set[Tier] = field(default_factory=set)
    pins: int = 0
    use_tier: Tier | None = None
    pending: Future[None] | None = None
    error: BaseException | None = None
    disk_checksums: tuple[int, ...] | None = None
    last_use: int = 0
    device_event: torch.cuda.Event | None = None  # the compute stream's last use of the device copy

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.layout.tensors

    def transition(self, new: ChunkState) -> None:
        """Move to ``new``; raises StateError if the table does not allow it."""
        if new not in TRANSITIONS[self.state]:
            raise StateError(f"chunk {self.name!r}: illegal transition {self.state.value} -> {new.value}")
        self.state = new

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensor views of this chunk's tensors over ``flat``, a uint8 buffer of ``capacity`` bytes."""
        return layout_views(self.layout, flat)

    def __repr__(self) -> str:
        valid = ",".join(sorted(t.value for t in self.valid))
        return f"Chunk({self.name!r}, {self.capacity}B, home={self.home.value}, {self.state.value}, valid={{{valid}}})"
