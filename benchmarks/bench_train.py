"""Full fine-tuning throughput of the streamed engine: states on disk next to the same model in memory.

Writes a Llama-shaped checkpoint with random weights (default ~1.04 B parameters), then trains it for a few
steps in two fresh processes, in the same invocation:

- ``disk``: weights and AdamW states homed on disk, fp32 gradients on the host, budgets ``--device-budget``
  and ``--host-budget``;
- ``memory``: weights on the device tier and everything else on the host, budgets large enough for all.

Prints one JSON object: per mode, tokens/s and the split of step time into compute (the rest), waiting on
I/O (blocked in acquire) and optimizer time not hidden, averaged over the steps after the first (which
records the trace). ``optimizer_hidden_share`` is the share of optimizer time overlapped with compute:
the optimizer now runs after backward on the caller's thread, so it is 0 until the overlapped optimizer
lands; the figure is here so that change is measured against this baseline.

Run: ``python benchmarks/bench_train.py --dir /mnt/nvme/tmp``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import peak_rss, write_checkpoint

from tiertune.units import parse_size


def run_mode(model_dir: str, disk_dir: str, mode: str, args: argparse.Namespace) -> dict:
    """The measured part, in a fresh process."""
    from tiertune.finetune.engine import EngineConfig, StreamedTrainer
    from tiertune.offload.store import StoreConfig

    if mode == "disk":
        store = StoreConfig(device_budget=args.device_budget, host_budget=args.host_budget, disk_path=disk_dir,
                            chunk_size=1 << 40, prefetch_depth=2)  # fmt: skip
        engine = EngineConfig(params="disk", optimizer_states="disk", gradients="host", max_steps=args.steps)
    else:
        store = StoreConfig(device_budget=args.memory_device_budget, host_budget=args.memory_host_budget,
                            chunk_size=1 << 40, prefetch_depth=2)  # fmt: skip
        engine = EngineConfig(
            params="device", optimizer_states="host", gradients="host", max_steps=args.steps
        )
    engine.learning_rate = 1e-5
    began = time.perf_counter()
    trainer = StreamedTrainer(model_dir, store, engine)
    load_s = time.perf_counter() - began
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    batch = [
        {"input_ids": torch.randint(0, vocab, (args.batch, args.seq), generator=gen)}
        for _ in range(args.accum)
    ]
    tokens = args.batch * args.seq * args.accum
    try:
        trainer.step(batch)  # records the trace
        trainer.times.clear()
        losses = [trainer.step(batch) for _ in range(args.steps - 1)]
        n = args.steps - 1
        times = {k: v / n for k, v in trainer.times.items()}
        stats = trainer.store.stats()
    finally:
        trainer.close()
    step = times["step"]
    return {
        "load_s": load_s,
        "step_s": step,
        "tokens_per_second": tokens / step,
        "compute_s": step - times.get("io_wait", 0.0) - times.get("optimizer", 0.0),
        "io_wait_s": times.get("io_wait", 0.0),
        "optimizer_not_hidden_s": times.get("optimizer", 0.0),
        "optimizer_hidden_share": 0.0,
        "losses": losses,
        "peak_bytes": {k: v.peak for k, v in stats.tiers.items()},
        "bytes_moved_per_step": {k: v / args.steps for k, v in stats.bytes_moved.items()},
        "peak_rss_bytes": peak_rss(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".tiertune-bench")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3, help="including the first, which records the trace")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--host-budget", default="7GiB")
    p.add_argument("--memory-device-budget", default="6GiB")
    p.add_argument("--memory-host-budget", default="14GiB")
    p.add_argument("--modes", default="disk,memory")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "DISK", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("device_budget", "host_budget", "memory_device_budget", "memory_host_budget"):
        setattr(args, name, parse_size(getattr(args, name), f"--{name.replace('_', '-')}"))
    if args.child:
        print(json.dumps(run_mode(*args.child, args)))
        return
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "train", "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                      "torch": torch.__version__}}  # fmt: skip
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        result["parameters"] = write_checkpoint(model_dir, args.layers, args.hidden, args.intermediate, args.heads,
                                                args.kv_heads, args.vocab)  # fmt: skip
        result["tokens_per_step"] = args.batch * args.seq * args.accum
        for mode in args.modes.split(","):
            cmd = [
                sys.executable,
                __file__,
                *sys.argv[1:],
                "--child",
                str(model_dir),
                str(Path(tmp) / "disk"),
                mode,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                result[mode] = {"error": out.stderr.strip().splitlines()[-1]}
            else:
                result[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{mode}: {json.dumps(result[mode])[:300]}", file=sys.stderr, flush=True)
    if "tokens_per_second" in result.get("disk", {}) and "tokens_per_second" in result.get("memory", {}):
        result["disk_over_memory_throughput"] = (
            result["disk"]["tokens_per_second"] / result["memory"]["tokens_per_second"]
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
