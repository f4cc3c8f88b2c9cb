"""A run launched as several processes (``torchrun``, ``accelerate launch``): each rank joins the process group,
takes its share of the node's cores and budgets, and its own rows of every global batch; what concerns the
run directory is decided by rank 0 and shared, so that every rank does the same and an error there stops all
of them with the same message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from tiertune.distributed.collectives import guarded
from tiertune.distributed.world import World, init_process_group
from tiertune.errors import TiertuneError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

log = logging.getLogger("tiertune.train")

T = TypeVar("T")


def join(world: World) -> None:
    """Join the launch's process group (nothing for one process): this rank's GPU made current, torch's
    threads set to its share of the node's cores (the CPU optimizer of every local rank runs at once)."""
    if world.size == 1:
        return
    device = world.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(world.threads())
    backend = init_process_group(world)
    log.info("rank %d of %d (%s), %d threads", world.rank, world.size, backend, world.threads())


def launch_notes(world: World, env: dict[str, str]) -> list[str]:
    """What to tell a user about how the run was launched: ``accelerate launch --cpu`` starts one process
    whatever ``--num_processes`` says (its CPU launcher runs several only under MPI)."""
    if world.size == 1 and env.get("ACCELERATE_USE_CPU", "").lower() == "true":
        return [
            "one process: `accelerate launch --cpu` starts one whatever --num_processes says; for N processes "
            "on CPUs, `accelerate launch --multi_gpu --num_processes N -m tiertune.cli train RECIPE` (gloo) "
            "or `torchrun --nproc_per_node N -m tiertune.cli train RECIPE`"
        ]
    return []


def decided_by_main(world: World, decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0, its result (or its error: a ``TiertuneError`` is raised on every rank, with its
    message) given to every rank."""
    if world.size == 1:
        return decide()
    import torch.distributed as dist

    box: list[object] = [None]
    if world.is_main:
        try:
            box[0] = decide()
        except TiertuneError as exc:
            box[0] = exc
            with guarded("broadcast"):
                dist.broadcast_object_list(box, src=0)
            raise
    with guarded("broadcast"):
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], TiertuneError):
        raise box[0]
    return box[0]  # type: ignore[return-value]


def rows_of(world: World, stream: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's rows of each global batch of ``stream`` (batches of per-device size x ranks): rank r takes
    the r-th of N equal runs of rows. A last, short batch of an epoch leaves a rank with no rows its own: it
    gets one row of padding without targets (nothing to its loss or gradients; the collectives still need
    it). ``num_tokens`` stays the global batch's: the log's tokens per second are the whole launch's. For one
    process, the batches as they are."""
    if world.size == 1:
        yield from stream
        return
    for batch in stream:
        rows = batch["input_ids"].shape[0]
        per = -(-rows // world.size)
        lo, hi = min(world.rank * per, rows), min((world.rank + 1) * per, rows)
        if hi > lo:
            yield {k: v[lo:hi] if v.dim() else v for k, v in batch.items()}
            continue
        part = {k: v[:1].clone() if v.dim() else v for k, v in batch.items()}
        part["labels"] = torch.full_like(part.get("labels", part["input_ids"]), IGNORE_INDEX)
        yield part
