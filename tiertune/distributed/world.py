"""The ranks of a launch: read from the variables torchrun and ``accelerate launch`` set, and the process group
made from them, with a timeout on every collective so that a rank that dies stops the others instead of
leaving them waiting."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tiertune.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
"""Seconds a collective may wait for the other ranks before the run stops (``TIERTUNE_COLLECTIVE_TIMEOUT``)."""


@dataclass(frozen=True)
class World:
    """This process among the ranks of a launch (one process, rank 0 of 1, when nothing launched several)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """The world torchrun / ``accelerate launch`` describe in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
        ``LOCAL_WORLD_SIZE``; a ConfigError naming the variable when one is not a number or out of range."""
        env = dict(os.environ) if env is None else env

        def number(name: str, default: int) -> int:
            value = env.get(name)
            if value is None or value == "":
                return default
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a number (it is set by the launcher)") from None

        size = number("WORLD_SIZE", 1)
        rank = number("RANK", 0)
        local_size = number("LOCAL_WORLD_SIZE", size)
        local_rank = number("LOCAL_RANK", rank % max(local_size, 1))
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={size}")
        if not 0 <= local_rank < local_size <= size:
            raise ConfigError(
                f"LOCAL_RANK={local_rank} is not a rank of LOCAL_WORLD_SIZE={local_size} (<= {size})"
            )
        return cls(rank, size, local_rank, local_size)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, shows progress and writes the run's shared files."""
        return self.rank == 0

    def threads(self, cores: int | None = None) -> int:
        """torch threads for this rank: the node's cores shared by its local ranks (never oversubscribed)."""
        cores = cores or os.cpu_count() or 1
        return max(1, cores // self.local_size)

    def disk_dir(self, disk_path: str | os.PathLike[str]) -> Path:
        """This rank's own directory for its disk tier (``disk_path/rank-r``; ``disk_path`` for one process)."""
        return Path(disk_path) if self.size == 1 else Path(disk_path) / f"rank-{self.rank}"

    def device(self) -> torch.device:
        """The device this rank computes on: its local GPU where there are GPUs, else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def collective_timeout() -> datetime.timedelta:
    """How long a collective waits for the other ranks (``TIERTUNE_COLLECTIVE_TIMEOUT`` seconds, default 600)."""
    value = os.environ.get("TIERTUNE_COLLECTIVE_TIMEOUT", "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ConfigError(f"TIERTUNE_COLLECTIVE_TIMEOUT={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ConfigError(f"TIERTUNE_COLLECTIVE_TIMEOUT must be > 0 seconds, got {value}")
    return datetime.timedelta(seconds=seconds)


def init_process_group(world: World, store: torch.distributed.Store | None = None) -> str:
    """Join the launch's process group (NCCL on GPUs, gloo on CPUs), rendezvous from the launcher's
    ``MASTER_ADDR``/``MASTER_PORT`` or the given ``store`` (a FileStore in tests). Returns the backend. A
    group that already exists (``accelerate`` may have made one) is used as it is."""
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    backend = "nccl" if world.device().type == "cuda" else "gloo"
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(
        backend, rank=world.rank, world_size=world.size, timeout=collective_timeout(), **kwargs
    )
    return backend
