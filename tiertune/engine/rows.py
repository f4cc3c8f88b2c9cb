"""A trained input embedding's rows (``InputRows``): what a step reads of it, and the only rows its own
backward gives a gradient.

A full fine-tune trains the input embedding, a [vocabulary, hidden] matrix of which a step's tokens read a
few rows (R: the distinct input ids of the wave). Back-propagated as the model's module does it, its gradient
is a dense [vocabulary, hidden] tensor of zeros but for those rows: on a CPU, where memory that size is mapped
afresh each time, making, summing and copying it was most of a few-token step's compute (64K x 1024: 0.4 s of
a 1.1 s step). Here the rows alone are back-propagated:

- while the embedding is bound for the wave, the prefix gathers its rows R into a small tensor (``gather``);
- the embeddings' recompute in backward binds that tensor as the module's weight and maps each id to its
  position in R (a forward pre-hook; ``padding_idx`` mapped the same way), so the model's own module, scaling
  and all, computes the same values and autograd gives their gradient as [len(R), hidden] (``bound``);
- the wave's row gradients are summed in fp32 (``harvest``) and handed on as ``Rows``, added into a tied
  head's dense gradient on the device or into the host accumulator's rows (``engine.gradients``).

Nothing else changes: the values added are the ones the dense gradient held in those rows. So the embedding
need not be bound for the embeddings' backward: the wave releases it once its last reader is done (the prefix,
or a tied head's loss), and the optimizer may update it meanwhile (``engine.update``'s rows split).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tiertune.methods.optim import AdamStep, adamw

if TYPE_CHECKING:
    from tiertune.engine.binding import Binder
    from tiertune.engine.compute import Compute
    from tiertune.engine.layout import GroupState
    from tiertune.offload.store import ChunkStore


@dataclass
class Rows:
    """A gradient that is zero outside some rows: ``values[k]`` is row ``index[k]`` of a tensor of ``shape``
    (``index`` sorted, distinct, int64; ``values`` fp32, on the device the wave computes on)."""

    index: torch.Tensor
    values: torch.Tensor
    shape: torch.Size

    def dense(self) -> torch.Tensor:
        """The whole gradient (zeros outside the rows), on the values' device."""
        out = self.values.new_zeros(self.shape)
        return out.index_add_(0, self.index.to(out.device), self.values)


def add_rows(into: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``into[index] += values`` (rows), ``index`` and ``values`` moved to ``into``'s device and dtype."""
    into.index_add_(0, index.to(into.device), values.to(device=into.device, dtype=into.dtype))


def gather_rows(into: torch.Tensor, source: torch.Tensor, index: torch.Tensor) -> None:
    """``into = source[index]`` (rows)."""
    torch.index_select(source, 0, index.to(source.device), out=into)


class InputRows:
    """The trained input embedding of a model (``module``, whose weight is parameter ``name`` of the group
    ``state``) back-propagated through its wave's rows alone (the module docstring). ``of`` says whether a
    model's embedding can be: a plain ``nn.Embedding`` (or a subclass: Gemma's scaled one), trained, its weight
    the group's only tensor, no ``max_norm`` (which rewrites the weight in forward)."""

    def __init__(
        self, module: nn.Embedding, name: str, state: GroupState, binder: Binder, compute: Compute
    ) -> None:
        self.module, self.name, self.state, self.binder, self.compute = module, name, state, binder, compute
        self.index: torch.Tensor | None = None  # the wave's rows R, sorted (``start``)
        self.weight: torch.Tensor | None = None  # their weights, gathered while the embedding is bound
        self.summed: torch.Tensor | None = None  # the wave's gradient of those rows, fp32
        self._leaf: torch.Tensor | None = None  # the rows bound as the module's weight in backward

    @classmethod
    def of(
        cls, module: nn.Module, states: Sequence[GroupState], binder: Binder, compute: Compute
    ) -> InputRows | None:
        """The rows of ``module`` (the model's input embedding) when its group is trained and the module is
        one this can stand in for; None otherwise (its backward then runs as the module's own)."""
        state = next((s for s in states if s.group.kind == "embed" and s.trainable), None)
        if state is None or not isinstance(module, nn.Embedding) or module.max_norm is not None:
            return None
        if module.sparse or len(state.group.params) != 1:
            return None
        (name,) = state.group.params
        slots = binder.slots.get(name, [])
        if not any(slot.module is module and slot.attr == "weight" for slot in slots):
            return None
        return cls(module, name, state, binder, compute)

    @property
    def count(self) -> int:
        """How many rows the wave reads."""
        return 0 if self.index is None else int(self.index.numel())

    def start(self, ids: Sequence[torch.Tensor]) -> None:
        """A wave begins: its rows are the distinct ids of its micro-batches (``ids``)."""
        flat = torch.cat([t.reshape(-1) for t in ids])
        if flat.is_meta:  # a ledger's ids hold no values: as many rows as ids, at most the vocabulary
            vocab = self.state.group.params[self.name].shape[0]
            self.index = flat.new_empty((min(flat.numel(), vocab),))
        else:
            self.index = torch.unique(flat)
        self.weight = self.summed = self._leaf = None

    def gather(self, weight: torch.Tensor) -> None:
        """Keep the wave's rows of the bound embedding weight ``weight`` (before it is released)."""
        assert self.index is not None
        rows = weight.new_empty((self.count, *weight.shape[1:]))
        self.compute.run(gather_rows, rows, weight.detach(), self.index)
        self.weight = rows

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The block runs the embedding on the gathered rows: they are bound as its weight (a leaf whose
        gradient ``harvest`` takes), each id it is called with mapped to its row's position."""
        assert self.index is not None and self.weight is not None
        module, index = self.module, self.index
        leaf = self.binder.bind({self.name: self.weight}, requires_grad=True)[self.name]
        self._leaf = leaf
        padding = module.padding_idx
        if padding is not None:  # its position among the rows, if it is one (a ledger's rows have no values)
            hit = None if index.is_meta else (index == padding).nonzero()
            module.padding_idx = int(hit[0, 0]) if hit is not None and hit.numel() else None

        def positions(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (torch.searchsorted(index.to(args[0].device), args[0]), *args[1:]), kwargs
            ids = kwargs["input"]
            return args, {**kwargs, "input": torch.searchsorted(index.to(ids.device), ids)}

        hook = module.register_forward_pre_hook(positions, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()
            module.padding_idx = padding
            self.binder.unbind([self.name])
            self._leaf = None

    def harvest(self) -> None:
        """Add the gradient a micro-batch's backward left on the bound rows into the wave's fp32 sum."""
        leaf = self._leaf
        if leaf is None or leaf.grad is None:
            return
        if self.summed is None:
            self.summed = leaf.grad.float()
        else:
            self.summed.add_(leaf.grad)
        leaf.grad = None

    def take(self) -> Rows | None:
        """The wave's gradient of the embedding as ``Rows`` (None: no micro-batch gave one)."""
        if self.summed is None or self.index is None:
            return None
        shape = self.state.group.params[self.name].shape
        rows = Rows(self.index.to(self.summed.device), self.summed, shape)
        self.summed = self.weight = None
        return rows

    def into(self, dense: torch.Tensor | None) -> torch.Tensor | Rows | None:
        """The wave's gradient of the embedding added into ``dense`` (a tied head's, on the device), or as
        ``Rows`` when there is none."""
        rows = self.take()
        if rows is None or dense is None:
            return rows if rows is not None else dense
        self.compute.run(add_rows, dense, rows.index, rows.values)
        return dense


PIECE_ELEMENTS = 1 << 23
"""The most elements of a tensor one background piece of a split update updates (32 MiB of fp32 a state): a
unit submitted meanwhile waits for at most one piece."""


@dataclass(frozen=True)
class Outside:
    """A background piece of a split update: rows ``ranges`` ([lo, hi) pairs) of tensor ``name``, none of the
    rows whose gradient comes last."""

    name: str
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Inside:
    """The rest of a split update: rows ``index`` (sorted, on the CPU) of tensor ``name`` with their whole
    gradient ``values`` (fp32, on the CPU; the gradient chunk holds them too)."""

    name: str
    index: torch.Tensor
    values: torch.Tensor


def outside_ranges(rows: int, index: list[int], per_piece: int) -> list[list[tuple[int, int]]]:
    """Rows 0..``rows`` but those in ``index`` (sorted, distinct) as pieces of at most ``per_piece`` rows, each
    a list of [lo, hi) ranges; a piece with no row left is not listed."""
    pieces: list[list[tuple[int, int]]] = []
    k = 0
    for a in range(0, rows, per_piece):
        b = min(a + per_piece, rows)
        ranges, lo = [], a
        while k < len(index) and index[k] < b:
            if index[k] > lo:
                ranges.append((lo, index[k]))
            lo = index[k] + 1
            k += 1
        if lo < b:
            ranges.append((lo, b))
        if ranges:
            pieces.append(ranges)
    return pieces


def outside_pieces(state: GroupState, name: str, index: torch.Tensor) -> list[Outside]:
    """The background pieces of a split update of tensor ``name`` (``state``'s, chunk 0): its rows but
    ``index`` (sorted), ``PIECE_ELEMENTS`` elements a piece at most."""
    shape = state.group.params[name].shape
    per_row = math.prod(shape[1:])
    # (a ledger's rows have no values: its pieces cover every row, a few more than a run's)
    rows = [] if index.is_meta else index.tolist()
    pieces = outside_ranges(shape[0], rows, max(1, PIECE_ELEMENTS // max(per_row, 1)))
    return [Outside(name, tuple(r)) for r in pieces]


def _adamw_views(
    grads: dict[str, torch.Tensor], views: list[dict[str, torch.Tensor]], hp: AdamStep, decayed: bool
) -> None:
    """``adamw`` on views of one tensor's rows (``grads`` and the master weights and moments in ``views``,
    keyed alike), weight decay on all of them or none."""
    names = list(grads)
    adamw(names, views[0], grads, views[1], views[2], hp, set(names) if decayed else set())


def put_rows(into: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``into[index] = values`` (rows, in ``into``'s dtype)."""
    into.index_copy_(0, index.to(into.device), values.to(device=into.device, dtype=into.dtype))


def update_part(
    compute: Compute,
    store: ChunkStore,
    hp: AdamStep,
    state: GroupState,
    j: int,
    part: Outside | Inside,
    grads: dict[str, torch.Tensor],
    views: list[dict[str, torch.Tensor]],
) -> None:
    """One part of a split speculative update (``Updater.splits``) of chunk ``j`` of ``state`` (coefficient 1,
    the step's ``hp``; on the optimizer worker) into ``views``
    (master weights and moments, or their twins): an ``Outside`` piece's rows from the gradient chunk
    (``grads``), or the ``Inside`` rows from their gradient (which the worker runs after every piece)."""
    name, decayed = part.name, part.name in state.decayed
    if isinstance(part, Inside):
        rows = [v[name].new_empty((part.index.numel(), *v[name].shape[1:])) for v in views]
        for into, v in zip(rows, views, strict=True):
            compute.run(gather_rows, into, v[name], part.index)
        compute.run(_adamw_views, {name: part.values}, [{name: r} for r in rows], hp, decayed)
        for into, v in zip(rows, views, strict=True):
            compute.run(put_rows, v[name], part.index, into)
        if state.master:
            with store.writing(state.weights[j]) as weights:
                compute.run(put_rows, weights[name], part.index, rows[0])
        return

    def sub(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"{name}[{lo}:{hi}]": d[name][lo:hi] for lo, hi in part.ranges}

    compute.run(_adamw_views, sub(grads), [sub(v) for v in views], hp, decayed)
    if state.master:
        with store.writing(state.weights[j]) as weights:
            compute.run(_copy_views, sub(weights), sub(views[0]))


def _copy_views(into: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """Each tensor of ``into`` from ``source``'s of its name (the compute-dtype weights from the new master's)."""
    for name, t in into.items():
        t.copy_(source[name])


__all__ = [
    "Inside",
    "InputRows",
    "Outside",
    "Rows",
    "add_rows",
    "gather_rows",
    "outside_pieces",
    "outside_ranges",
    "put_rows",
    "update_part",
]
