"""One rank of a multi-process test, started by ``tests/distributed`` with the variables torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and ``TT_STORE`` (a FileStore path for the rendezvous). Runs the
case ``TT_CASE`` and writes what it saw as JSON to ``TT_OUT``/rank-<r>.json."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tiertune.distributed.collectives import Wire, all_gather, all_reduce, reduce_scatter
from tiertune.distributed.world import World, init_process_group
from tiertune.offload.chunk import pack_tensors


def chunks_case(world: World) -> dict:
    """A chunk padded for ``world.size`` shards: its bytes gathered from the shards, and a gradient summed
    across ranks into each rank's shard."""
    entries = [("w", (37, 29), torch.float32), ("b", (29,), torch.float32), ("q", (1001,), torch.uint8)]
    [layout] = pack_tensors(entries, 1 << 20, world.size)
    start, end = layout.shard_range(world.rank)
    full_bytes = torch.Generator().manual_seed(0)
    reference = torch.randint(0, 256, (layout.capacity,), dtype=torch.uint8, generator=full_bytes)
    wire = Wire()
    gathered = torch.empty(layout.capacity, dtype=torch.uint8)
    all_gather(reference[start:end].clone(), gathered, wire)
    # a gradient chunk of fp32: every rank's is different; integers, so the sum is exact in any order
    n = layout.capacity // 4
    grad = torch.arange(n, dtype=torch.float32) * (world.rank + 1)
    shard = torch.empty(n // world.size)
    reduce_scatter(grad, shard, wire)
    expected = torch.arange(n, dtype=torch.float32) * sum(r + 1 for r in range(world.size))
    s = n // world.size
    norm = torch.tensor([float(world.rank + 1)])
    all_reduce(norm, wire)
    return {
        "gathered_equal": bool(torch.equal(gathered, reference)),
        "scattered_equal": bool(torch.equal(shard, expected[world.rank * s : (world.rank + 1) * s])),
        "norm": float(norm),
        "capacity": layout.capacity,
        "wire": dict(wire.sent),
        "threads": world.threads(),
        "disk_dir": str(world.disk_dir("/nvme/offload")),
    }


def dies_case(world: World, store: dist.Store) -> dict:
    """Rank 1 exits once the group is up; the others must get an error (in the barrier, if rank 1 left while
    they were still in it, or in the next collective), not wait forever."""
    began = time.perf_counter()
    try:
        init_process_group(world, store)
        dist.barrier()
        if world.rank == 1:
            os._exit(3)
        all_gather(torch.zeros(4), torch.empty(4 * world.size))
        return {"error": None}
    except Exception as exc:  # the backend's error for a peer that went away, or the timeout
        return {"error": type(exc).__name__, "seconds": time.perf_counter() - began}


def main() -> None:
    world = World.from_env()
    store = dist.FileStore(os.environ["TT_STORE"], world.size)
    if os.environ["TT_CASE"] == "dies":
        result = dies_case(world, store)
    else:
        init_process_group(world, store)
        result = chunks_case(world)
        dist.destroy_process_group()
    Path(os.environ["TT_OUT"], f"rank-{world.rank}.json").write_text(json.dumps(result))
    sys.exit(0)


if __name__ == "__main__":
    main()
