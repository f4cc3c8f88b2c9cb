"""A run launched as several processes (``torchrun``, ``accelerate launch``): each rank joins the process group,
takes its share of the node's cores and budgets, and its own rows of every global batch; what concerns the
run directory is decided by rank 0 and shared, so that every rank does the same and an error there stops all
of them with the same message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from tiertune.distributed.collectives import guarded
from tiertune.distributed.world import World, init_process_group
from tiertune.errors import TiertuneError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX
from tiertune.offload.disk import clean_stale

log = logging.getLogger("tiertune.train")

T = TypeVar("T")


def join(world: World) -> None:
    """Join the launch's process group (nothing for one process): this rank's GPU made current, torch's
    threads set to its share of the node's cores (the CPU optimizer of every local rank runs at once)."""
    if world.size == 1:
        return
    stop_with_launcher()
    device = world.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(world.threads())
    backend = init_process_group(world)
    log.info("rank %d of %d (%s), %d threads", world.rank, world.size, backend, world.threads())


def stop_with_launcher() -> None:
    """Ask the kernel to send this rank SIGTERM when the launcher that started it (torchrun, ``accelerate
    launch``) dies, even by ``kill -9``: the rank then stops through its clean-up (the checkpoint being written
    completed within seconds or dropped, the offload files removed) instead of training on unsupervised. Linux
    only (elsewhere a launcher's death leaves its ranks to the collective timeout)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # it died before the request was made: stop now, as it would have
        os.kill(os.getpid(), signal.SIGTERM)


def sweep_other_ranks(disk_path: str | os.PathLike[str], world: World) -> list[Path]:
    """Remove the slot files that launches on another number of processes left in ``disk_path``: ``rank-<r>/``
    directories this launch does not use (a run resumed on fewer processes), or ``disk_path`` itself (one
    process's, under several) or every ``rank-<r>/`` (several processes', under one). Only unlocked files go
    (``offload.disk.clean_stale``: a live store holds its file's lock), and a ``rank-<r>/`` left empty. Call it
    once this launch's stores are open. Returns what was removed."""
    root = Path(disk_path)
    if not root.is_dir():
        return []
    dirs = [root] if world.size > 1 else []
    for path in sorted(root.glob("rank-*")):
        number = path.name.removeprefix("rank-")
        if path.is_dir() and number.isdigit() and not (world.size > 1 and int(number) < world.size):
            dirs.append(path)
    removed: list[Path] = []
    for path in dirs:
        removed += clean_stale(path)
        if path != root:
            with contextlib.suppress(OSError):  # not empty: another live run's, or files that are not ours
                path.rmdir()
    return removed


def launch(launcher_args: list[str], command: list[str]) -> tuple[int, str]:
    """Run ``tiertune COMMAND...`` as the ranks torchrun's launcher starts with ``launcher_args`` (its options:
    ``--nproc_per_node 2``, ``--standalone``, ...), in this process. Returns the exit code and a line saying
    how the launch ended: 0 when every rank finished; a rank's own exit code when one failed (2 for an error to
    fix, each rank having said which); 128 + the signal when the launch was stopped (SIGTERM, Ctrl-C) and its
    ranks stopped through their clean-up. Where torchrun itself ends with its traceback, this ends with that line."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        args = torchrun.parse_args([*launcher_args, "-m", "tiertune.cli", *command])
    except SystemExit as exc:  # argparse said what is wrong with the launcher's options
        return (exc.code if isinstance(exc.code, int) else 2), ""
    scratch = tempfile.TemporaryDirectory(prefix="tiertune-launch-")  # torchrun's error files, removed after
    saved, tempfile.tempdir = tempfile.tempdir, scratch.name
    try:
        torchrun.run(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        return 128 + int(exc.sigval), (
            f"tiertune launch: stopped by {name}; every rank stopped through its clean-up (rank 0 said above "
            "where, and how to resume)"
        )
    except KeyboardInterrupt:
        return 128 + signal.SIGINT, "tiertune launch: stopped by SIGINT; every rank was stopped"
    except ChildFailedError as exc:
        # the rank whose own error it was (exit code > 0), the first to fail; torchrun then stopped the others
        # by SIGTERM, and a rank still exiting with the same error may be among them
        own = {r: f for r, f in exc.failures.items() if f.exitcode > 0} or exc.failures
        rank, failure = min(own.items(), key=lambda item: (item[1].timestamp, item[0]))
        code = failure.exitcode
        if code > 0:
            how = f"exited with code {code}"
        else:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"ended with {code}"
            code = 128 - code
        return code, f"tiertune launch: rank {rank} {how} (its message is above); the other ranks stopped"
    finally:
        tempfile.tempdir = saved
        scratch.cleanup()
    return 0, ""


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
        if "pairs" in batch:  # preference pairs: the rank's run of pairs, their chosen rows and rejected rows
            yield _pairs_of(world, batch)
            continue
        rows = batch["input_ids"].shape[0]
        per = -(-rows // world.size)
        lo, hi = min(world.rank * per, rows), min((world.rank + 1) * per, rows)
        if hi > lo:
            yield {k: v[lo:hi] if v.dim() else v for k, v in batch.items()}
            continue
        part = {k: v[:1].clone() if v.dim() else v for k, v in batch.items()}
        part["labels"] = torch.full_like(part.get("labels", part["input_ids"]), IGNORE_INDEX)
        yield part


def _pairs_of(world: World, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's pairs of a global batch of preference pairs (``data.batches``: its chosen rows, then its
    rejected rows): the r-th of N equal runs of pairs. A rank left with none gets one pair without targets
    (nothing to the loss: ``engine.objective.pair_losses`` counts only pairs with targets)."""
    pairs = int(batch["pairs"])
    per = -(-pairs // world.size)
    lo, hi = min(world.rank * per, pairs), min((world.rank + 1) * per, pairs)
    empty = hi == lo
    if empty:
        lo, hi = 0, 1
    rows = torch.cat([torch.arange(lo, hi), torch.arange(pairs + lo, pairs + hi)])
    part = {
        k: v[rows] if v.dim() and v.shape[0] == 2 * pairs else v[lo:hi] if v.dim() else v
        for k, v in batch.items()
    }
    part["pairs"] = torch.tensor(hi - lo)
    if empty:
        part["labels"] = torch.full_like(part.get("labels", part["input_ids"]), IGNORE_INDEX)
    return part
