"""Launching ``tiertune train`` as one process or as several (torchrun: CPUs, gloo, loopback rendezvous, a
timeout on every collective), and reading what a run logged."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launching import TIMEOUT, launch_env, torchrun


@pytest.fixture
def launch():
    """``launch(recipe, *overrides, ranks=1)``: ``tiertune train`` as ``ranks`` processes (one: plainly, more:
    torchrun); asserts it succeeded and returns the finished process."""

    def run(recipe: Path, *overrides: str, ranks: int = 1, command: list[str] | None = None):
        head = command or ([sys.executable] if ranks == 1 else torchrun(ranks))
        done = subprocess.run(
            [*head, "-m", "tiertune.cli", "train", str(recipe), *overrides],
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return done

    return run


@pytest.fixture
def losses():
    """``losses(run_dir, field="loss")``: step -> the field, from the run's ``trainer_log.jsonl``."""

    def read(run: Path, field: str = "loss") -> dict[int, float]:
        records = [json.loads(line) for line in (run / "trainer_log.jsonl").read_text().splitlines()]
        return {r["step"]: r[field] for r in records if field in r}  # (an evaluation has a record of its own)

    return read
