"""The stash of a wave: the hidden states at the layer boundaries that wait between forward and backward
(``engine.schedule``): device tensors (``DeviceStash``) or chunks of the store, homed on the host, with a slot
per micro-batch (``ChunkStash``)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tiertune.errors import ConfigError
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig


def stash_slots(cfg: EngineConfig) -> int:
    """The micro-batches a boundary chunk has slots for, with activations on the host: ``wave_size``, else the
    step's ``gradient_accumulation_steps``."""
    return cfg.wave_size or cfg.gradient_accumulation_steps


class Stash:
    """A wave's hidden states at the layer boundaries: boundary i is decoder layer i's input (0: the
    embeddings' output), boundary L the last layer's output. ``open(i, shapes, write)`` gives a view on the
    device per micro-batch (``shapes``); ``close(i, keep)`` ends its use (``keep``: read again in backward;
    else its content is dropped); ``settle()``, called before each layer's weights are acquired, waits for
    what the stash sent home a layer ago."""

    def open(self, index: int, shapes: Sequence[torch.Size], write: bool) -> list[torch.Tensor]:
        raise NotImplementedError

    def close(self, index: int, keep: bool) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """Nothing to wait for (a stash that sends nothing home)."""

    def abandon(self) -> None:
        """Let go of every boundary still open (a wave that stopped midway: a signal, an error)."""


class DeviceStash(Stash):
    """Activations on the device: the boundaries are tensors there, outside the chunk store."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._held: dict[int, list[torch.Tensor]] = {}

    def open(self, index: int, shapes: Sequence[torch.Size], write: bool) -> list[torch.Tensor]:
        if write:
            self._held[index] = [torch.empty(s, dtype=self.dtype, device=self.device) for s in shapes]
        return self._held[index]

    def close(self, index: int, keep: bool) -> None:
        if not keep:
            del self._held[index]

    def abandon(self) -> None:
        self._held.clear()


class ChunkStash(Stash):
    """Activations in the chunk store: one chunk per boundary, homed on the host, with ``slots`` slots of a
    micro-batch's hidden states (the largest micro-batch's). Backward's acquire finds each boundary prefetched
    back along the trace. Seconds blocked go to ``times["io_wait"]``.

    Forward sends a boundary home one layer after it was read: while layer i runs, boundary i-1 goes down
    (started once boundary i+1 has its room), and the next layer waits for it to land before it acquires
    anything. The device then holds three boundaries a moment, the copy overlaps a whole layer's compute, and
    every allocation happens at a point the transfers have landed by: the peaks are those the replay counts
    (``engine.replay``). The last layer's input is not sent down: backward reads it first."""

    def __init__(self, store: ChunkStore, chunks: list[Chunk], slots: int, times: dict[str, float]) -> None:
        self.store, self.chunks, self.slots, self.times = store, chunks, slots, times
        self._written: set[int] = set()
        self._open: set[int] = set()
        self._done: int | None = (
            None  # read in forward, still on the device: sent down when the next is opened
        )
        self._leaving: int | None = None  # being sent down: landed by ``settle``

    @classmethod
    def add(
        cls,
        store: ChunkStore,
        layers: int,
        slot: int,
        slots: int,
        dtype: torch.dtype,
        times: dict[str, float],
    ) -> ChunkStash:
        """Register the ``layers + 1`` boundary chunks of ``slots`` slots of ``slot`` elements in ``store``."""
        chunks = [
            store.add(cls.entries(slot, slots, dtype), home=Tier.HOST, name=f"boundary.{i}")[0]
            for i in range(layers + 1)
        ]
        return cls(store, chunks, slots, times)

    @staticmethod
    def entries(slot: int, slots: int, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """A boundary chunk's tensor: ``slots`` slots of ``slot`` elements."""
        return [("x", (slot * slots,), dtype)]

    @property
    def slot(self) -> int:
        """Elements of a slot: the largest micro-batch's hidden states."""
        return self.chunks[0].tensors[0].numel // self.slots

    def open(self, index: int, shapes: Sequence[torch.Size], write: bool) -> list[torch.Tensor]:
        chunk, slot = self.chunks[index], self.slot
        for shape in shapes:
            if math.prod(shape) > slot:
                raise ConfigError(
                    f"a micro-batch's hidden states ({tuple(shape)}) do not fit the activation chunk's slots "
                    f"({slot} elements); set activation_tokens to the largest batch x sequence length"
                )
        began = time.perf_counter()
        x = self.store.acquire(chunk, Tier.DEVICE, overwrite=write)["x"]
        self.times["io_wait"] += time.perf_counter() - began
        self._open.add(index)
        if write:
            self._written.add(index)
            if self._done is not None:
                self.store.evict(self.chunks[self._done], wait=False)
                self._leaving, self._done = self._done, None
        elif self._done == index:
            self._done = None
        return [x[j * slot : j * slot + math.prod(s)].view(s) for j, s in enumerate(shapes)]

    def close(self, index: int, keep: bool) -> None:
        chunk = self.chunks[index]
        self.store.release(chunk, dirty=index in self._written)
        self._written.discard(index)
        self._open.discard(index)
        if keep:
            self._done = index
        else:
            self.store.discard(chunk)

    def abandon(self) -> None:
        for index in sorted(self._open):
            self.store.release(self.chunks[index])
            self.store.discard(self.chunks[index])
        self._open.clear()
        self._written.clear()
        self._done = self._leaving = None

    def settle(self) -> None:
        if self._leaving is not None:
            began = time.perf_counter()
            self.store.evict(self.chunks[self._leaving], wait=True)
            self.times["io_wait"] += time.perf_counter() - began
            self._leaving = None


__all__ = ["ChunkStash", "DeviceStash", "Stash", "stash_slots"]
