"""Run a command on a busy machine: a disk writer and a CPU burner beside it, as a user's machine is.

The writer writes a file of ``--file-size`` in 64 MiB blocks into ``--dir`` (the disk the command uses: the
free space it sees changes all the time), fsyncs it, deletes it, and starts again; each of ``--burners``
processes keeps one core busy. Prints one JSON object: the command's exit code and seconds, and how much the
writer wrote meanwhile. Exits with the command's exit code.

    python benchmarks/under_load.py --dir /tmp -- .venv/bin/python -m pytest -q -n auto --dist loadfile
    python benchmarks/under_load.py --repeat 20 -- .venv/bin/python -m pytest -q tests/finetune/test_estimate.py \
        -k test_estimate_for_several_processes
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 64 << 20


def write_and_delete(directory: str, size: int, written: multiprocessing.Value) -> None:  # type: ignore[type-arg]
    """Write ``size`` bytes to a file in ``directory``, fsync, delete it; forever."""
    block = os.urandom(BLOCK)
    while True:
        fd, name = tempfile.mkstemp(prefix="under-load-", dir=directory)
        try:
            done = 0
            while done < size:
                done += os.write(fd, block[: min(BLOCK, size - done)])
                with written.get_lock():
                    written.value += BLOCK
            os.fsync(fd)
        except OSError:  # the disk filled up: free it and go on
            time.sleep(0.5)
        finally:
            os.close(fd)
            os.unlink(name)


def burn() -> None:
    """Keep one core busy."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the writer writes (the tested disk)"
    )
    parser.add_argument("--file-size", default="2GiB", help="the writer's file, written then deleted")
    parser.add_argument("--burners", type=int, default=1, help="processes that each keep a core busy")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the command this many times; stop at a failure"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    size = next(
        (int(float(args.file_size[:-3]) * u) for s, u in units.items() if args.file_size.endswith(s)), None
    )
    size = size if size is not None else int(args.file_size)

    written = multiprocessing.Value("q", 0)
    load = [multiprocessing.Process(target=write_and_delete, args=(args.dir, size, written), daemon=True)]
    load += [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for p in load:
        p.start()
    runs = []
    rc = 0
    try:
        for _ in range(args.repeat):
            start = time.monotonic()
            rc = subprocess.call(command)
            runs.append({"rc": rc, "seconds": round(time.monotonic() - start, 1)})
            if rc != 0:
                break
    finally:
        for p in load:
            p.terminate()
        for p in load:
            p.join()
        for leftover in Path(args.dir).glob("under-load-*"):
            leftover.unlink(missing_ok=True)
    print(
        json.dumps(
            {
                "bench": "under_load",
                "command": command,
                "runs": runs,
                "passed": sum(r["rc"] == 0 for r in runs),
                "writer_dir": args.dir,
                "writer_file_bytes": size,
                "writer_bytes_written": written.value,
                "burners": args.burners,
                "cpus": os.cpu_count(),
            }
        )
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
