"""The collectives of ZeRO-3 over chunks, on flat byte or fp32 buffers: the full chunk gathered from every
rank's shard (``all_gather``), a gradient chunk summed across ranks into this rank's shard
(``reduce_scatter``), and a small tensor summed everywhere (``all_reduce``: norms, replicated adapters'
gradients). Each counts what it puts on the wire in ``Wire``, as ring algorithms move it (NCCL's and gloo's):
``(N - 1) / N`` of the full buffer is sent by each rank for a gather or a scatter, twice that for an
all-reduce; ``bench_zero`` compares the counts with the ZeRO-3 formula.

``GROUP`` runs them over the process group; ``Counting(size)`` is what a ledger replays (``engine.replay``):
the same calls over ``size`` ranks, counting what each would send, moving nothing, joining no group."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from tiertune.errors import RankError, StateError


@dataclass
class Wire:
    """Bytes this rank sent, by collective, cumulative."""

    sent: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


@contextmanager
def guarded(kind: str) -> Iterator[None]:
    """A collective's failure as a ``RankError``: the backend's error (gloo's closed connection, NCCL's
    abort, a timeout) means another rank stopped or cannot be reached, and says so in a line."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, RankError | StateError):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timed out" in detail.lower() or "timeout" in detail.lower()
        why = (
            "another rank did not answer within the collective timeout (TIERTUNE_COLLECTIVE_TIMEOUT seconds, "
            "default 600; it may have stopped, or be far slower)"
            if timed_out
            else "another rank stopped (killed, or stopped by its own error: see its output)"
        )
        raise RankError(f"rank {rank}: {kind} failed: {why} [{detail[:300]}]") from None


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(shard: torch.Tensor, full: torch.Tensor, wire: Wire | None = None) -> None:
    """``full`` (N x the shard's elements, contiguous) becomes every rank's shard in rank order."""
    _sharded("all_gather", shard, full, wire)


def reduce_scatter(full: torch.Tensor, shard: torch.Tensor, wire: Wire | None = None) -> None:
    """``shard`` becomes this rank's part of the sum of every rank's ``full`` (elementwise)."""
    _sharded("reduce_scatter", shard, full, wire)


def _sharded(kind: str, shard: torch.Tensor, full: torch.Tensor, wire: Wire | None) -> None:
    """A collective between a full buffer and this rank's shard of it (``all_gather``: shards into the full
    buffer; ``reduce_scatter``: the sum of the full buffers into the shards); one process copies."""
    import torch.distributed as dist

    n = _group_size()
    if full.numel() != n * shard.numel() or full.dtype != shard.dtype:
        raise StateError(
            f"{kind} over {n} ranks needs a full buffer of {n} x the shard's elements in the shard's dtype; "
            f"got a {shard.numel()}-element {shard.dtype} shard and a {full.numel()}-element {full.dtype} buffer"
        )
    gather = kind == "all_gather"
    if n == 1:
        if gather:
            full.copy_(shard)
        else:
            shard.copy_(full)
        return
    with guarded(kind):
        if gather:  # renamed in torch 2.12 (the old names warn there)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(full, shard)
        else:
            (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(shard, full)
    if wire is not None:  # ring algorithms: each rank sends N - 1 shards either way
        wire.sent[kind] += _sent(kind, shard, n)


def all_reduce(tensor: torch.Tensor, wire: Wire | None = None) -> None:
    """``tensor`` becomes the sum over the ranks, on every rank."""
    import torch.distributed as dist

    n = _group_size()
    if n == 1:
        return
    with guarded("all_reduce"):
        dist.all_reduce(tensor)
    if wire is not None:
        wire.sent["all_reduce"] += _sent("all_reduce", tensor, n)


def _sent(kind: str, tensor: torch.Tensor, n: int) -> int:
    """Bytes one of ``n`` ranks sends in a ring collective: ``tensor`` is its shard (a gather or a scatter:
    N - 1 shards) or the buffer all-reduced (twice (N - 1) / N of it)."""
    nbytes = tensor.numel() * tensor.element_size()
    return (n - 1) * nbytes if kind != "all_reduce" else 2 * (n - 1) * nbytes // n


class Group:
    """The collectives over the process group (``all_gather``, ``reduce_scatter``, ``all_reduce``)."""

    all_gather = staticmethod(all_gather)
    reduce_scatter = staticmethod(reduce_scatter)
    all_reduce = staticmethod(all_reduce)


GROUP = Group()


class Counting(Group):
    """The collectives over ``size`` ranks as a ledger runs them: each counts in ``Wire`` the bytes this rank
    would send, and leaves its buffers as they are (no group is joined, nothing is moved)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def all_gather(self, shard: torch.Tensor, full: torch.Tensor, wire: Wire | None = None) -> None:  # type: ignore[override]
        self._count("all_gather", shard, wire)

    def reduce_scatter(self, full: torch.Tensor, shard: torch.Tensor, wire: Wire | None = None) -> None:  # type: ignore[override]
        self._count("reduce_scatter", shard, wire)

    def all_reduce(self, tensor: torch.Tensor, wire: Wire | None = None) -> None:  # type: ignore[override]
        self._count("all_reduce", tensor, wire)

    def _count(self, kind: str, tensor: torch.Tensor, wire: Wire | None) -> None:
        if wire is not None and self.size > 1:
            wire.sent[kind] += _sent(kind, tensor, self.size)
