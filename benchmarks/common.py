"""What the benchmarks share: the model-shape arguments, the machine's description, and running one mode in
a fresh process (so each mode's peak RSS and allocator state are its own)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def add_model_args(p: argparse.ArgumentParser, **defaults: int) -> None:
    """``--dir`` and the Llama-shaped model's dimensions (``layers``, ``hidden``, ... given as defaults)."""
    p.add_argument("--dir", default=".tiertune-bench", help="where the checkpoint and the disk tier go")
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=defaults[name])
    p.add_argument("--child", nargs=3, metavar=("MODEL", "DISK", "MODE"), help=argparse.SUPPRESS)


def proc_status_bytes(key: str) -> int | None:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes; None
    where there is no such file or line."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    return None


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}


def run_child(script: str, model_dir: Path, disk_dir: Path, mode: str) -> dict:
    """Run ``script`` again (same arguments) as ``--child MODEL DISK MODE``; its last stdout line is the JSON
    result, its stderr (progress, errors) passes through. A failure becomes ``{"error": "exit N"}``."""
    cmd = [sys.executable, script, *sys.argv[1:], "--child", str(model_dir), str(disk_dir), mode]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        result = {"error": f"exit {out.returncode} (its stderr is above)"}
    else:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{mode}: {json.dumps(result)[:300]}", file=sys.stderr, flush=True)
    return result


def moved_per_step(reports: list) -> dict[str, float]:
    """Bytes moved per link, averaged over the steps whose ``StepReport``s are ``reports``."""
    links = {k for r in reports for k in r.moved}
    return {k: sum(r.moved.get(k, 0) for r in reports) / max(len(reports), 1) for k in sorted(links)}
