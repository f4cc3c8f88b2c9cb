"""Disk I/O of tiertune's async engine against fio on the same directory, and prefetch overlap.

Prints one JSON object (progress goes to stderr):

- ``write_gbps`` / ``read_gbps``: the engine moving ``--size`` bytes between host buffers and a disk
  directory through the disk tier (O_DIRECT, per-block xxh3 checksums written and verified, headers);
- ``fio_write_gbps`` / ``fio_read_gbps``: fio on the same directory, block size and queue depth
  (libaio, direct I/O), rounds interleaved with the engine's so both see the same drive state;
- ``write_fio_ratio`` / ``read_fio_ratio``: the median over rounds of engine / fio, each engine pass paired
  with the fio pass of the same direction run right next to it (the drive's speed drifts);
- ``overlap_ratio``: chunks homed on disk are acquired on the device in a fixed order with a simulated
  compute of length C per chunk (the device is busy, the CPU is free, as with a GPU kernel), where I is the
  cold per-chunk I/O time (disk -> host -> device) measured in the warm-up step and C = I: measured wall
  time / sum over chunks of max(C, I). 1.0 is perfect overlap. ``overlap`` lists C = I/2, I and 2I.

Run: ``python benchmarks/bench_aio.py --disk-path /mnt/nvme/tmp`` (default: ./.tiertune-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from tiertune.offload.aio import AsyncIO
from tiertune.offload.chunk import Chunk, ChunkLayout, TensorSpec
from tiertune.offload.disk import DiskTier, supports_o_direct
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import MemoryTier, Tier
from tiertune.settings import parse_size
from tiertune.units import format_size


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine_pass(disk: DiskTier, chunks: list[Chunk], slots: list, host: list, write: bool) -> float:
    """Move every chunk once (all requests queued at once); returns seconds."""
    start = time.perf_counter()
    handles = []
    for i, chunk in enumerate(chunks):
        buf = host[i % len(host)].tensor
        if write:
            handle, sums = disk.write(chunk, slots[i], buf)
            handles.append((chunk, handle, sums))
        else:
            handles.append((chunk, disk.read(chunk, slots[i], buf, chunk.disk_checksums), None))
    for chunk, handle, sums in handles:
        handle.wait()
        if sums is not None:
            chunk.disk_checksums = tuple(sums)
    return time.perf_counter() - start


def fio_pass(directory: Path, rw: str, size: int, block: int, depth: int, direct: bool) -> float | None:
    """fio's bandwidth in GB/s for the same pattern, or None if fio is not installed."""
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio",
        "--name=tiertune-bench",
        f"--filename={directory / 'fio-bench.tmp'}",
        f"--rw={rw}",
        f"--bs={block}",
        f"--iodepth={depth}",
        "--ioengine=libaio",
        f"--direct={int(direct)}",
        f"--size={size}",
        "--numjobs=1",
        "--output-format=json",
        "--end_fsync=1",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


def bench_engine(args: argparse.Namespace, directory: Path) -> dict:
    size, chunk_size, block = args.size, args.chunk_size, args.block_size
    n_chunks = max(1, size // chunk_size)
    n_host = max(1, min(n_chunks, args.host_bytes // chunk_size))
    aio = AsyncIO(args.queue_depth, block)
    header = 2 * 4096 + 8 * (chunk_size // block)
    disk = DiskTier(directory, n_chunks * (chunk_size + header) + (1 << 20), aio)
    host_tier = MemoryTier(Tier.HOST, n_host * chunk_size, torch.device("cpu"))
    host = [host_tier.alloc(chunk_size) for _ in range(n_host)]
    for a in host:
        a.tensor.view(torch.int32).random_()  # real data: zeros can hide unwritten bytes
    layout = ChunkLayout((TensorSpec("x", (chunk_size,), torch.uint8, 0),), chunk_size)
    chunks = [Chunk(i, f"bench{i}", layout, Tier.DISK) for i in range(n_chunks)]
    slots = [disk.reserve(c, block) for c in chunks]
    moved = n_chunks * chunk_size
    say(
        f"engine: {n_chunks} chunks of {format_size(chunk_size)} = {format_size(moved)}, "
        f"block {format_size(block)}, queue depth {args.queue_depth}, O_DIRECT={disk.direct}"
    )
    rounds: dict[str, list[float]] = {"write": [], "read": [], "fio_write": [], "fio_read": []}
    try:
        for r in range(args.rounds):
            # The drive's speed drifts by 2x within minutes (bursts, throttling). So each engine pass runs
            # right next to a fio pass of the same direction, who goes first alternates, and the ratio is
            # the median of the per-round ratios.
            for rw in ("write", "read"):
                order = ("fio", "engine") if r % 2 == 0 else ("engine", "fio")
                for who in order:
                    if who == "engine":
                        seconds = engine_pass(disk, chunks, slots, host, write=rw == "write")
                        rounds[rw].append(moved / seconds / 1e9)
                    elif not args.no_fio:
                        gbps = fio_pass(directory, rw, moved, block, args.queue_depth, disk.direct)
                        if gbps is not None:
                            rounds[f"fio_{rw}"].append(gbps)
            say(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} GB/s" for k, v in rounds.items() if v))
    finally:
        (directory / "fio-bench.tmp").unlink(missing_ok=True)
        disk.close()
        aio.close()
    result = {
        "bytes_moved": moved,
        "chunk_size": chunk_size,
        "block_size": block,
        "queue_depth": args.queue_depth,
        "o_direct": disk.direct,
        "write_gbps": statistics.median(rounds["write"]),
        "read_gbps": statistics.median(rounds["read"]),
        "rounds": rounds,
    }
    if rounds["fio_write"]:
        result["fio_write_gbps"] = statistics.median(rounds["fio_write"])
        result["fio_read_gbps"] = statistics.median(rounds["fio_read"])
        for rw in ("write", "read"):
            paired = [e / f for e, f in zip(rounds[rw], rounds[f"fio_{rw}"])]
            result[f"{rw}_fio_ratio"] = statistics.median(paired)
            result[f"{rw}_fio_ratios"] = paired
            result[f"{rw}_fio_ratio_of_medians"] = result[f"{rw}_gbps"] / result[f"fio_{rw}_gbps"]
    else:
        result["fio"] = (
            "skipped: fio is not installed (apt-get install fio)" if not args.no_fio else "skipped"
        )
    return result


def bench_overlap(args: argparse.Namespace, directory: Path) -> dict:
    chunk_size = args.overlap_chunk_size
    n = args.overlap_chunks
    cfg = StoreConfig.resolve(
        device_budget=4 * chunk_size,
        host_budget=8 * chunk_size,
        disk_path=str(directory),
        chunk_size=chunk_size,
        prefetch_depth=2,
        queue_depth=args.queue_depth,
        block_size=args.block_size,
    )
    with ChunkStore(cfg) as store:
        chunks = []
        for i in range(n):
            (chunk,) = store.add(
                [(f"layer{i}", (chunk_size // 4,), torch.float32)], home="disk", name=f"layer{i}"
            )
            store.write(chunk, {f"layer{i}": torch.full((chunk_size // 4,), float(i))})
            chunks.append(chunk)
        for chunk in chunks:
            store.evict(chunk)
        cold = []
        for (
            chunk
        ) in chunks:  # warm-up step: records the trace; every acquire is a cold disk->host->device load
            t = time.perf_counter()
            store.acquire(chunk)
            cold.append(time.perf_counter() - t)
            store.release(chunk)
        store.mark_step()
        io = statistics.median(cold)
        # the stricter I: per-chunk time of a prefetching step with no compute (pure streaming)
        t = time.perf_counter()
        for chunk in chunks:
            store.acquire(chunk)
            store.release(chunk)
        store.mark_step()
        io_stream = (time.perf_counter() - t) / n
        out = {
            "chunks": n,
            "chunk_size": chunk_size,
            "io_s_per_chunk": io,
            "stream_io_s_per_chunk": io_stream,
        }
        out["overlap"] = []
        for factor in (0.5, 1.0, 2.0):
            compute = factor * io
            walls = []
            for _ in range(args.overlap_steps):
                t = time.perf_counter()
                for chunk in chunks:
                    tensors = store.acquire(chunk)
                    time.sleep(compute)  # the device computes; the host is free to move data
                    store.release(chunk)
                    assert tensors is not None
                store.mark_step()
                walls.append(time.perf_counter() - t)
            wall = statistics.median(walls)
            bound = n * max(compute, io)
            strict = n * max(compute, io_stream)
            out["overlap"].append(
                {
                    "compute_over_io": factor,
                    "wall_s": wall,
                    "bound_s": bound,
                    "ratio": wall / bound,
                    "stream_bound_s": strict,
                    "stream_ratio": wall / strict,
                }
            )
            say(
                f"overlap C={factor}I: wall {wall:.3f}s vs sum max(C,I) {bound:.3f}s -> {wall / bound:.3f} "
                f"(vs streaming I: {wall / strict:.3f})"
            )
        at_one = next(o for o in out["overlap"] if o["compute_over_io"] == 1.0)
        out["overlap_ratio"] = at_one["ratio"]
        out["overlap_ratio_streaming"] = at_one["stream_ratio"]
        out["divergences"] = store.stats().divergences
        return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--disk-path", default=".tiertune-bench", help="directory on the drive to measure")
    p.add_argument("--size", default="4GiB", help="bytes the engine moves each way per round")
    p.add_argument("--chunk-size", default="64MiB")
    p.add_argument("--block-size", default="1MiB", help="bytes per request (fio --bs)")
    p.add_argument("--queue-depth", type=int, default=16, help="requests in flight (fio --iodepth)")
    p.add_argument("--host-bytes", default="1GiB", help="host buffer pool the chunks cycle through")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-fio", action="store_true", help="skip the fio reference")
    p.add_argument("--overlap-chunks", type=int, default=16)
    p.add_argument("--overlap-chunk-size", default="64MiB")
    p.add_argument("--overlap-steps", type=int, default=3)
    args = p.parse_args(argv)
    for name in ("size", "chunk_size", "block_size", "host_bytes", "overlap_chunk_size"):
        setattr(args, name, parse_size(getattr(args, name), f"--{name.replace('_', '-')}"))
    directory = Path(args.disk_path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "aio",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "disk_path": str(directory),
            "disk_o_direct": supports_o_direct(directory),
        },
    }
    result.update(bench_engine(args, directory))
    result.update(bench_overlap(args, directory))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
