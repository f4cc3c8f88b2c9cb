"""Disk-tier layout choice: one preallocated slot file vs a file per chunk, same threads, blocks and data.

Prints one JSON object: write and read GB/s of each layout over ``--rounds`` alternating rounds (medians),
moving ``--size`` bytes in ``--chunk-size`` chunks with O_DIRECT, ``--queue-depth`` threads and
``--block-size`` requests. This is the measurement behind ``tiertune.offload.disk``'s one-file design.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from tiertune.offload.aio import buffer_of
from tiertune.offload.tiers import aligned_empty
from tiertune.settings import parse_size


def run(
    fds_and_offsets: list[tuple[int, int]], chunk: int, block: int, depth: int, src: memoryview, write: bool
) -> float:
    """Move every chunk once with ``depth`` threads each issuing one ``block``-sized request at a time."""
    per_chunk = chunk // block
    jobs = itertools.count()
    lock = threading.Lock()
    total = len(fds_and_offsets) * per_chunk

    def worker() -> None:
        while True:
            with lock:
                j = next(jobs)
            if j >= total:
                return
            fd, base = fds_and_offsets[j // per_chunk]
            a = (j % per_chunk) * block
            view = src[a : a + block]
            n = os.pwritev(fd, [view], base + a) if write else os.preadv(fd, [view], base + a)
            assert n == block

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--disk-path", default=".tiertune-bench")
    p.add_argument("--size", default="4GiB")
    p.add_argument("--chunk-size", default="64MiB")
    p.add_argument("--block-size", default="1MiB")
    p.add_argument("--queue-depth", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    size, chunk, block = (parse_size(v) for v in (args.size, args.chunk_size, args.block_size))
    n = size // chunk
    directory = Path(args.disk_path).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    buf = aligned_empty(chunk, torch.device("cpu"))
    buf.view(torch.int32).random_()
    src = buffer_of(buf)
    flags = os.O_RDWR | os.O_CREAT | os.O_DIRECT
    one = os.open(directory / "layout-one.tmp", flags, 0o600)
    os.posix_fallocate(one, 0, size)
    many = [os.open(directory / f"layout-many-{i}.tmp", flags, 0o600) for i in range(n)]
    for fd in many:
        os.posix_fallocate(fd, 0, chunk)
    layouts = {"one_file": [(one, i * chunk) for i in range(n)], "file_per_chunk": [(fd, 0) for fd in many]}
    results: dict[str, dict[str, list[float]]] = {k: {"write": [], "read": []} for k in layouts}
    try:
        for r in range(args.rounds):
            names = list(layouts) if r % 2 == 0 else list(layouts)[::-1]
            for rw in ("write", "read"):
                for name in names:
                    seconds = run(layouts[name], chunk, block, args.queue_depth, src, rw == "write")
                    results[name][rw].append(size / seconds / 1e9)
    finally:
        for fd in [one, *many]:
            os.close(fd)
        for f in directory.glob("layout-*.tmp"):
            f.unlink()
    out = {
        "benchmark": "disk_layout",
        "size": size,
        "chunk_size": chunk,
        "block_size": block,
        "queue_depth": args.queue_depth,
    }
    for name, by in results.items():
        for rw, values in by.items():
            out[f"{name}_{rw}_gbps"] = statistics.median(values)
    out["rounds"] = results
    print(json.dumps(out))


if __name__ == "__main__":
    main()
