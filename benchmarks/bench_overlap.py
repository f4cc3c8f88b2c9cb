"""Whether the CPU optimizer hides behind backward, in each regime the streamed engine meets, in one JSON.

Runs ``bench_train.py`` (each mode in a fresh process) on these cases, each with the optimizer after backward
(``host-serial``) beside the overlapped run (``host``: weights, states and gradients homed on the host):

- ``few_tokens``: 8 tokens through 8 wide layers (on a CPU the compute thread's own work a parameter, weights into
  the device tier and gradients into their host accumulators, still outweighs AdamW's: the regime where a
  layer's update takes longer than its backward needs a GPU, or ``gpu_like_updates_longer``);
- ``large_vocab_tied``: 2 layers and a 64,000-token tied embedding at 8 tokens, whose update lands last;
- ``large_vocab_untied``: the same with a head of its own;
- ``compute_longer``: many tokens, so backward takes longer than the updates;
- ``gpu_like``: a stand-in GPU (``bench_train.py --fast-compute``: each layer's work launched on a thread of its
  own), 8 / 24 ms a layer, at ``--handoff-lag`` 0 and 1; ``gpu_like_updates_longer``: 3 / 9 ms a layer, a
  backward faster than the layers' updates.

Per case: ``step_s``, ``compute_s``, ``io_wait_s``, ``optimizer_busy_s``, ``optimizer_hidden_share`` (kept from
``bench_train``), ``bound_s`` = max(compute + I/O wait, optimizer busy) (for ``gpu_like``: max(the device's
busy seconds, optimizer busy)), ``step_over_bound`` and ``hidden_by_step_time`` = (serial step - overlapped
step) / serial optimizer busy. ``--quick`` runs smaller shapes (the test's).

Run: ``python benchmarks/bench_overlap.py --dir /tmp/bo``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

BENCH = Path(__file__).resolve().parent / "bench_train.py"

SHAPE = ("--heads", "16", "--kv-heads", "16", "--intermediate", "2752", "--hidden", "1024")
CASES: dict[str, tuple[str, ...]] = {
    "few_tokens": (*SHAPE, "--layers", "8", "--vocab", "8000", "--seq", "8", "--host-budget", "6GiB"),
    "large_vocab_tied": (*SHAPE, "--layers", "2", "--vocab", "64000", "--seq", "8", "--host-budget", "6GiB"),
    "large_vocab_untied": (
        *SHAPE,
        *("--layers", "2", "--vocab", "64000", "--seq", "8", "--untied", "--host-budget", "6GiB"),
    ),
    "compute_longer": (*SHAPE, "--layers", "4", "--vocab", "8000", "--seq", "256", "--host-budget", "6GiB"),
    "gpu_like_lag0": (
        *SHAPE,
        *("--layers", "12", "--vocab", "8000", "--seq", "8", "--host-budget", "6GiB", "--dtype", "bfloat16"),
        *("--fast-compute", "8,24", "--max-grad-norm", "0", "--handoff-lag", "0"),
    ),
    "gpu_like_lag1": (
        *SHAPE,
        *("--layers", "12", "--vocab", "8000", "--seq", "8", "--host-budget", "6GiB", "--dtype", "bfloat16"),
        *("--fast-compute", "8,24", "--max-grad-norm", "0", "--handoff-lag", "1"),
    ),
    "gpu_like_updates_longer": (
        *SHAPE,
        *("--layers", "12", "--vocab", "8000", "--seq", "8", "--host-budget", "6GiB", "--dtype", "bfloat16"),
        *("--fast-compute", "3,9", "--max-grad-norm", "0", "--handoff-lag", "1"),
    ),
}
QUICK = {  # the same regimes on shapes a test runs in seconds
    "--hidden": "256",
    "--intermediate": "688",
    "--heads": "4",
    "--kv-heads": "4",
    "--host-budget": "512MiB",
    "--fast-compute": "2,6",
}
KEPT = (
    "step_s",
    "compute_s",
    "io_wait_s",
    "optimizer_busy_s",
    "optimizer_not_hidden_s",
    "optimizer_hidden_share",
)


def quick(args: tuple[str, ...]) -> list[str]:
    """``args`` with the shapes of ``QUICK``."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a in QUICK:
            out[i + 1] = QUICK[a]
    vocab = out.index("--vocab") + 1
    out[vocab] = str(min(int(out[vocab]), 16000))
    return out


def run_case(name: str, args: list[str], base: Path, steps: int) -> dict:
    """One case: ``bench_train.py`` with the overlapped and the serial mode; the kept fields and the ratios."""
    cmd = [
        sys.executable,
        str(BENCH),
        "--dir",
        str(base / name),
        "--steps",
        str(steps),
        "--modes",
        "host,host-serial",
    ]
    out = subprocess.run([*cmd, *args], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        return {"error": f"exit {out.returncode} (its stderr is above)", "args": args}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    host, serial = result["host"], result["host-serial"]
    case: dict = {
        "args": args,
        "parameters": result["parameters"],
        "tokens_per_step": result["tokens_per_step"],
    }
    for mode, r in (("overlapped", host), ("serial", serial)):
        case[mode] = {k: r[k] for k in KEPT} | {"device_busy_s": r.get("device_busy_s")}
    device = host.get("device_busy_s")
    bound = max(
        device if device is not None else host["compute_s"] + host["io_wait_s"], host["optimizer_busy_s"]
    )
    case["same_losses"] = host["losses"] == serial["losses"]  # the overlap changes when, not what
    case["bound_s"] = bound
    case["step_over_bound"] = host["step_s"] / bound if bound else None
    case["hidden_by_step_time"] = (
        (serial["step_s"] - host["step_s"]) / serial["optimizer_busy_s"]
        if serial["optimizer_busy_s"]
        else None
    )
    return case


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".tiertune-bench")
    p.add_argument("--steps", type=int, default=6, help="each run's steps, the first (the trace) not counted")
    p.add_argument(
        "--cases", default=",".join(CASES), help="a comma-separated subset of: " + ", ".join(CASES)
    )
    p.add_argument("--quick", action="store_true", help="small shapes (seconds a case): the test's")
    args = p.parse_args()
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    out: dict = {"benchmark": "overlap", "machine": machine(), "steps": args.steps, "quick": args.quick}
    for name in args.cases.split(","):
        if name not in CASES:
            p.error(f"--cases: no case {name!r}; the cases are {', '.join(CASES)}")
        case_args = quick(CASES[name]) if args.quick else list(CASES[name])
        out[name] = run_case(name, case_args, base, args.steps)
        print(f"{name}: {json.dumps(out[name])[:300]}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
