"""Which rank owns which elements of a sharded chunk's tensors, and the gradient buffer one reduce-scatter
hands out by owner.

A chunk is sharded as bytes: rank r keeps bytes ``layout.shard_range(r, N)`` of its padded image. A rank owns
the elements whose bytes lie in its shard; shard boundaries are multiples of 4096 bytes and tensors start at
aligned offsets, so no element is split. The fp32 optimizer state of a rank holds its owned elements only,
and the new weights it computes lie in its own byte shard. For the gradients, backward's full fp32 gradients
are packed rank by rank (each rank's owned elements in chunk order, every rank's run padded to the longest),
so that one reduce-scatter leaves each rank the sum of its own run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiertune.errors import StateError
from tiertune.offload.chunk import ChunkLayout, TensorSpec, itemsize


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, end)`` of tensor ``name`` (flattened), of a tensor with ``ndim`` dimensions."""

    name: str
    start: int
    end: int
    ndim: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def owned_slices(layout: ChunkLayout, world_size: int) -> list[list[Slice]]:
    """For each rank, the element ranges of ``layout``'s tensors whose bytes lie in its byte shard, in chunk
    order. Every element of every tensor is owned by exactly one rank."""
    shards = [layout.shard_range(r, world_size) for r in range(world_size)]
    owned: list[list[Slice]] = [[] for _ in range(world_size)]
    for t in layout.tensors:
        size = itemsize(t.dtype)
        if t.offset % size:
            raise StateError(
                f"tensor {t.name!r} starts at byte {t.offset}, not a multiple of its {size}-byte elements"
            )
        for rank, (a, b) in enumerate(shards):
            lo, hi = max(a, t.offset), min(b, t.offset + t.nbytes)
            if lo < hi:
                owned[rank].append(
                    Slice(t.name, (lo - t.offset) // size, (hi - t.offset) // size, len(t.shape))
                )
    return owned


def run_length(owned: list[list[Slice]]) -> int:
    """Elements of the longest rank's run: the length every run is padded to."""
    return max((sum(s.numel for s in slices) for slices in owned), default=0)


def pack_by_owner(
    values: dict[str, torch.Tensor],
    owned: list[list[Slice]],
    out: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """One flat fp32 buffer of ``len(owned) * run_length(owned)`` elements (``out``, or a new one on ``device``,
    by default the values'): rank r's run is its owned elements of ``values`` (full tensors by name; a missing
    one counts as zeros) in chunk order, then zeros."""
    run = run_length(owned)
    if device is None:
        first = next(iter(values.values()), None)
        device = first.device if first is not None else torch.device("cpu")
    if out is None:
        out = torch.empty(len(owned) * run, dtype=torch.float32, device=device)
    for rank, slices in enumerate(owned):
        at = rank * run
        for s in slices:
            value = values.get(s.name)
            piece = out[at : at + s.numel]
            if value is None:
                piece.zero_()
            else:
                piece.copy_(value.detach().reshape(-1)[s.start : s.end])
            at += s.numel
        out[at : (rank + 1) * run].zero_()
    return out


def views_of_run(run: torch.Tensor, slices: list[Slice]) -> list[tuple[Slice, torch.Tensor]]:
    """Each owned slice's part of a rank's run (views, in chunk order)."""
    out, at = [], 0
    for s in slices:
        out.append((s, run[at : at + s.numel]))
        at += s.numel
    return out


def shard_layout(layout: ChunkLayout, rank: int, world_size: int) -> ChunkLayout:
    """The layout of rank ``rank``'s shard of a chunk laid out as ``layout``: its byte range of the chunk's
    image (``shard_range``), in which each owned part of a tensor is a flat tensor of that name at the offset
    its bytes have there. What the rank keeps on its tiers is this shard; its views are the elements it owns
    (the optimizer updates them), its buffer is what the all-gather sends."""
    start, end = layout.shard_range(rank, world_size)
    specs = []
    whole = {t.name: t for t in layout.tensors}
    for s in owned_slices(layout, world_size)[rank]:
        t = whole[s.name]
        specs.append(TensorSpec(s.name, (s.numel,), t.dtype, t.offset + s.start * itemsize(t.dtype) - start))
    return ChunkLayout(tuple(specs), end - start)
