"""How a process holds the model's chunks among its ranks: ``Local`` for one process (every chunk whole here),
``Zero`` for one rank of several (ZeRO-3 over the store's chunks). The trainer always holds one and never asks
which: one process is the sharding of world size 1, where each collective is the identity.

Every weight chunk is laid out as one process lays it out, padded so that it splits into N equal shards, and
this rank's store holds only shard r of it (``loading.model.load_shards``): its views are the elements the
rank owns, the fp32 gradients, master weights and moments registered beside it (``layout.add_states``) hold
those elements only, so the CPU optimizer updates the rank's part of every tensor and writes the new weights
into its own shard. Nothing is held N times.

- A group bound for compute reads this rank's shard through the tiers (prefetched along the trace, as a
  whole chunk is in one process) and all-gathers the whole chunk into scratch space on the device, counted
  in the device budget; the shard is released at once, the whole chunk freed when the group is.
- A micro-batch's weight gradients of a chunk are packed by owner and reduce-scattered: each rank receives
  the sum over the ranks of the elements it owns, which the gradient hand-off adds into its fp32 gradients.
- The gradient norm for clipping is the square root of the all-reduced sum of the ranks' squared norms; the
  step's token count and loss are all-reduced, so every rank's loss is divided by the tokens of the whole
  global batch and the sum of the ranks' gradients is the token-weighted mean over all of them.
- Replicated tensors (LoRA's adapters) have their gradients all-reduced before their optimizer steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from tiertune.distributed.collectives import GROUP, Group, Wire
from tiertune.distributed.ownership import Slice, owned_slices, pack_by_owner, run_length, views_of_run
from tiertune.distributed.world import World
from tiertune.engine.rows import Rows
from tiertune.offload.chunk import Chunk, ChunkLayout, layout_views
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier

GATHERED = ".gathered"
"""What the scratch space a shard's whole chunk is gathered into is named after (``{chunk}.gathered``)."""


class Local:
    """One process: every chunk whole in its own store. Binding acquires a chunk on the device, gradients are
    kept as they are, totals and norms are this process's, nothing goes on the wire."""

    def __init__(self, store: ChunkStore, times: dict[str, float]) -> None:
        self.store, self.times = store, times
        self.full: dict[int, ChunkLayout] = {}  # no chunk is a shard of another
        self.wire = Wire()  # never sent on

    @contextmanager
    def gathered(self, chunk: Chunk, traced: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """``chunk``'s tensors on the device for the block (acquired and released)."""
        began = time.perf_counter()
        views = self.store.acquire(chunk, Tier.DEVICE, traced=traced)
        self.times["io_wait"] += time.perf_counter() - began
        try:
            yield views
        finally:
            self.store.release(chunk)

    def read_whole(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """A CPU copy of ``chunk``'s tensors (read through the host, outside the trace)."""
        return self.store.read(chunk)

    def reduce(
        self, chunk: Chunk, grads: dict[str, torch.Tensor | Rows | None]
    ) -> dict[str, torch.Tensor | Rows | None]:
        """A micro-batch's gradients of ``chunk``: this process's are the sum."""
        return grads

    def global_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The gradient norm over all elements: this process's."""
        return local

    def total(self, value: float | int, dtype: torch.dtype = torch.float64) -> float | int:
        """``value`` summed over the ranks: ``value``."""
        return value

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Nothing to sum: the adapters' gradients are this process's."""

    def read_part(
        self, name: str, read: Callable[[torch.Tensor], None], view: torch.Tensor, shape: tuple
    ) -> None:
        """Fill ``view`` with tensor ``name`` (of ``shape``) as ``read(tensor)`` reads it: the whole tensor."""
        read(view)

    def part(self, name: str) -> tuple[int, int] | None:
        """The elements [start, end) of tensor ``name`` this process owns, None for all of it."""
        return None

    @property
    def whole(self) -> bool:
        """Whether every tensor of a chunk is whole here (its rows are rows of the tensor)."""
        return True


class Zero:
    """This rank's side of ZeRO-3: ``full`` maps each shard chunk's id to the whole chunk's layout. ``wire``
    counts the bytes this rank sends; ``times`` (the engine's) gets ``gather`` and ``reduce_scatter``
    seconds. ``collectives``: the process group's, or on a ledger ``Counting`` ones (bytes counted, none
    moved)."""

    def __init__(
        self,
        store: ChunkStore,
        world: World,
        full: dict[int, ChunkLayout],
        times: dict[str, float],
        collectives: Group = GROUP,
    ) -> None:
        self.store, self.world, self.full, self.times = store, world, full, times
        self.collectives = collectives
        self.owned = {cid: owned_slices(layout, world.size) for cid, layout in full.items()}
        # the part of each tensor this rank owns (a tensor is never split between two chunks)
        self.mine: dict[str, Slice] = {s.name: s for owned in self.owned.values() for s in owned[world.rank]}
        self.device = store.device
        self.wire = Wire()

    @contextmanager
    def gathered(self, chunk: Chunk, traced: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """The whole chunk of which ``chunk`` is this rank's shard, on the device for the block: its tensors'
        views over scratch space. Every rank must enter it for the same chunk (a collective)."""
        layout = self.full[chunk.id]
        began = time.perf_counter()
        self.store.acquire(chunk, Tier.DEVICE, traced=traced)
        held = True
        try:
            self.times["io_wait"] += time.perf_counter() - began
            with self.store.scratch(layout.capacity, f"{chunk.name}{GATHERED}") as flat:
                began = time.perf_counter()
                self.collectives.all_gather(self.store.buffer(chunk), flat, self.wire)
                self.times["gather"] += time.perf_counter() - began
                self.store.release(chunk)
                held = False
                yield layout_views(layout, flat)
        finally:
            if held:
                self.store.release(chunk)

    def read_whole(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """A CPU copy of the whole chunk of which ``chunk`` is this rank's shard, by tensor name (a collective:
        every rank must call it for the same chunk)."""
        with self.gathered(chunk, traced=False) as views:
            return {n: v.cpu().clone() for n, v in views.items()}

    def reduce(self, chunk: Chunk, grads: dict[str, torch.Tensor | Rows | None]) -> dict[str, torch.Tensor]:
        """The sum over the ranks of a micro-batch's gradients of ``chunk``'s tensors (whole tensors by name;
        None counts as zeros), for the elements this rank owns: flat fp32 tensors by name, one for each tensor
        of the shard, on the device. Every rank must call it for the same chunk (a collective)."""
        owned = self.owned[chunk.id]
        began = time.perf_counter()
        # (an embedding's rows, ``engine.rows``, whole: each rank's rows are its own tokens')
        present = {n: g.dense() if isinstance(g, Rows) else g for n, g in grads.items() if g is not None}
        device = torch.device("meta") if self.store.ledger else self.device  # a ledger's hold no bytes
        packed = pack_by_owner(present, owned, device=device)
        run = torch.empty(run_length(owned), dtype=torch.float32, device=device)
        self.collectives.reduce_scatter(packed, run, self.wire)
        self.times["reduce_scatter"] += time.perf_counter() - began
        return {s.name: view for s, view in views_of_run(run, owned[self.world.rank])}

    def global_norm(self, local: torch.Tensor) -> torch.Tensor:
        """The norm over all ranks' elements, from this rank's norm of its own (fp32, on the CPU)."""
        squared = (local.float() ** 2).reshape(1).to(self.device)
        self.collectives.all_reduce(squared, self.wire)
        return squared.sqrt().cpu().reshape(())

    def total(self, value: float | int, dtype: torch.dtype = torch.float64) -> float | int:
        """``value`` summed over the ranks (a step's loss or its token count)."""
        t = torch.tensor([value], dtype=dtype, device=self.device)
        self.collectives.all_reduce(t, self.wire)
        return t.item()

    def all_reduce_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Replicated parameters' gradients summed over the ranks (one all-reduce; a missing one counts as
        zeros and is made)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not params:
            return
        flat = torch.cat([p.grad.reshape(-1).float() for p in params])  # type: ignore[union-attr]
        self.collectives.all_reduce(flat, self.wire)
        at = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[at : at + n].view_as(p.grad))  # type: ignore[union-attr]
            at += n

    def read_part(
        self, name: str, read: Callable[[torch.Tensor], None], view: torch.Tensor, shape: tuple
    ) -> None:
        """Fill ``view`` (this rank's flat part of tensor ``name`` in a shard) with its elements of the tensor
        of ``shape`` that ``read(tensor)`` reads whole."""
        whole = torch.empty(shape, dtype=view.dtype)
        read(whole)
        s = self.mine[name]
        view.copy_(whole.reshape(-1)[s.start : s.end])

    def part(self, name: str) -> tuple[int, int] | None:
        """The elements [start, end) of tensor ``name`` this rank owns."""
        s = self.mine[name]
        return s.start, s.end

    @property
    def whole(self) -> bool:
        """Whether every tensor of a chunk is whole here: no, a rank holds flat parts of them."""
        return False


Sharding = Local | Zero
"""What the trainer holds: one process's (``Local``) or one rank's of several (``Zero``)."""
