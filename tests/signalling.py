"""A tiertune command that sends itself a signal at a chosen point: the signal tests' process.

    python tests/signalling.py --at tiertune.offload.store:ChunkStore._done:40 --signal TERM --stamp F -- estimate R

runs ``tiertune estimate R`` through the console script's entry point, with ``ChunkStore._done`` wrapped so that
its 40th call first sends SIGTERM to this process (the handler runs as that call begins: the signal lands
inside it, as one from outside can), and writes the wall-clock time of the signal to ``F``. Where an outside
signal lands is chance; this lands it where it was meant to, every time. The exit code is the command's.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import signal
import sys
import time


def arm(where: str, signum: int, stamp: str) -> None:
    """Wrap ``module:Qual.name:N`` so that its Nth call sends ``signum`` to this process first."""
    module_name, qualname, nth = where.split(":")
    owner: object = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth):
            with open(f"{stamp}.tmp", "w") as f:  # renamed into place whole: a reader never sees it empty
                f.write(repr(time.time()))
            os.replace(f"{stamp}.tmp", stamp)
            os.kill(os.getpid(), signum)
        return original(*args, **kwargs)

    setattr(
        owner, name, staticmethod(wrapper) if isinstance(vars(owner).get(name), staticmethod) else wrapper
    )


def killed_run(at: str, recipe, stamp):
    """``tiertune train RECIPE`` in a process of its own, sent SIGKILL at ``at`` (``module:Qual.name:N``);
    returns the finished process (its ``returncode`` -9 when the kill landed)."""
    import subprocess

    command = [sys.executable, __file__, "--at", at, "--signal", "KILL", "--stamp", str(stamp)]
    return subprocess.run([*command, "--", "train", str(recipe)], capture_output=True, text=True, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--at", required=True, help="module:Qual.name:N")
    parser.add_argument("--signal", default="TERM", choices=("TERM", "INT", "KILL"))
    parser.add_argument("--stamp", required=True, help="the file that gets the signal's wall-clock time")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    arm(args.at, getattr(signal, f"SIG{args.signal}"), args.stamp)
    sys.argv = ["tiertune", *command]
    from tiertune.cli.app import main as tiertune

    tiertune()


if __name__ == "__main__":
    main()
