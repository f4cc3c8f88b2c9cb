"""ZeRO-3 over chunks on this machine's CPUs (gloo): bytes on the wire per step against the ZeRO-3 formula, and
the node's host-tier peak and offload bytes against one process with the same model, budgets and global
batch, in one invocation.

A random Llama (``--hidden``, ``--layers``; fp32 weights, full fine-tuning with weights and optimizer states on
disk) trains ``--steps`` steps as one process with the whole global batch, then as ``--ranks`` processes (a
FileStore rendezvous), each with its rows of every micro-batch and 1/N of the host budget; once for each count of
``--micro-batches`` per step (default 1 and 4). Every rank counts the bytes it sends (``Zero.wire``: ring
algorithms send (N - 1)/N of a buffer per gather or scatter).

The formula, per rank and step, for W waves of micro-batches (the layer-major step, ``engine.schedule``: one
wave holds every micro-batch of the step when their boundary hidden states fit, so W = 1 here), weights of b
bytes, Ψ parameters of which Ψ_L are in the decoder layers: forward gathers every weight once per wave,
backward gathers each layer again (it recomputes), and every gradient is reduce-scattered once per wave in fp32
(summed at full precision): ``all_gather = W (N-1)/N (Ψ + Ψ_L) b``, ``reduce_scatter = W (N-1)/N Ψ 4``,
whatever the micro-batches. The measured counts exceed it by the chunks' padding (each chunk splits into N
shards of whole 4 KiB pages).

Run: ``python benchmarks/bench_zero.py --dir /tmp/bench-zero [--ranks 2] [--hidden 512] [--layers 4]
[--micro-batches 1,4]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402


def make_model(path: Path, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        vocab_size=4096,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    """One process of a run (a rank, or the whole run): trains, writes its figures as JSON."""
    import torch.distributed as dist

    from tiertune.distributed.world import World, init_process_group
    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.offload.store import StoreConfig

    world = World.from_env()
    if world.size > 1:
        init_process_group(world, dist.FileStore(str(args.dir / "rendezvous"), world.size))
    torch.set_num_threads(world.threads())
    store_cfg = StoreConfig.resolve(
        device="cpu",
        device_budget=args.budget // world.size,
        host_budget=args.budget // world.size,
        disk_path=str(world.disk_dir(args.dir / f"nvme-{world.size}")),
        chunk_size=1 << 40,
        num_shards=world.size,
    )
    cfg = EngineConfig(
        dtype=torch.float32,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        max_steps=args.steps,
        kernels="none",
        params="disk",
        optimizer_states="disk",
        gradients="disk",
        gradient_accumulation_steps=args.accum,
    )
    trainer = StreamedTrainer(str(args.dir / "model"), store_cfg, cfg, world=world)
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    rows = args.rows // world.size
    losses, seconds, wire_steps = [], [], []
    for _ in range(args.steps):
        micro = []
        for _ in range(args.accum):
            ids = torch.randint(0, vocab, (args.rows, args.seq), generator=g)
            micro.append({"input_ids": ids[world.rank * rows : (world.rank + 1) * rows]})
        began = time.perf_counter()
        losses.append(trainer.step(micro))
        seconds.append(time.perf_counter() - began)
        if world.size > 1:
            wire_steps.append(trainer.last_report.wire)
    stats = trainer.store_stats()
    counts = trainer.parameter_counts()
    psi, psi_layers = counts["total"], counts.get("layer", 0)
    result = {
        "losses": losses,
        "step_seconds": seconds,
        "host_peak": stats.tiers["host"].peak,
        "device_peak": stats.tiers["device"].peak,
        "disk_used": stats.tiers["disk"].used,
        "wire_per_step": wire_steps[-1] if wire_steps else {},
        "params": psi,
        "layer_params": psi_layers,
        "waves": len(trainer.schedule.waves(args.accum)),
    }
    trainer.close()
    (args.dir / f"result-{world.size}-{args.accum}-{world.rank}.json").write_text(json.dumps(result))
    if world.size > 1:
        dist.destroy_process_group()


def launch(args: argparse.Namespace, size: int) -> list[dict]:
    """Run ``size`` processes of the worker as torchrun would start them; their results by rank."""
    procs = []
    for rank in range(size):
        env = dict(os.environ, OMP_NUM_THREADS="1", TIERTUNE_COLLECTIVE_TIMEOUT="300")
        if size > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--dir",
            str(args.dir),
            "--steps",
            str(args.steps),
            "--rows",
            str(args.rows),
            "--seq",
            str(args.seq),
            "--budget",
            str(args.budget),
            "--accum",
            str(args.accum),
        ]
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a process of the {size}-process run failed: exit codes {codes}")
    return [json.loads((args.dir / f"result-{size}-{args.accum}-{r}.json").read_text()) for r in range(size)]


def _run(args: argparse.Namespace, accum: int) -> dict:
    """One process, then ``--ranks`` processes, at ``accum`` micro-batches per step: their figures."""
    one = launch(args, 1)[0]
    ranks = launch(args, args.ranks)
    n, psi, psi_l, waves = args.ranks, one["params"], one["layer_params"], ranks[0]["waves"]
    formula = {
        "all_gather": waves * (n - 1) / n * (psi + psi_l) * 4,
        "reduce_scatter": waves * (n - 1) / n * psi * 4,
    }
    measured = ranks[0]["wire_per_step"]
    node_host = sum(r["host_peak"] for r in ranks)
    return {
        "params": psi,
        "global_batch": {"rows": args.rows, "seq": args.seq, "micro_batches": accum, "waves": waves},
        "wire_bytes_per_step_rank0": measured,
        "zero3_formula_bytes_per_step": formula,
        "wire_over_formula": {k: measured.get(k, 0) / v for k, v in formula.items()},
        "host_peak": {
            "one_process": one["host_peak"],
            "ranks": [r["host_peak"] for r in ranks],
            "node_over_one_process": node_host / one["host_peak"],
        },
        "offload_bytes": {"one_process": one["disk_used"], "ranks": [r["disk_used"] for r in ranks]},
        "losses": {"one_process": one["losses"], "ranks": ranks[0]["losses"]},
        "loss_rel_gap": max(
            abs(a - b) / abs(b) for a, b in zip(ranks[0]["losses"], one["losses"], strict=True)
        ),
        "step_seconds_median": {
            "one_process": sorted(one["step_seconds"])[len(one["step_seconds"]) // 2],
            "ranks": sorted(ranks[0]["step_seconds"])[len(ranks[0]["step_seconds"]) // 2],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4, help="rows of each global micro-batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--budget", type=int, default=512 << 20, help="host (and device) budget of the node, bytes"
    )
    parser.add_argument(
        "--micro-batches", default="1,4", help="micro-batches per step, comma-separated: a run each"
    )
    parser.add_argument("--accum", type=int, default=1, help=argparse.SUPPRESS)  # a worker's micro-batches
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    if args.rows % args.ranks:
        raise SystemExit(f"--rows {args.rows} must split evenly over --ranks {args.ranks}")
    if not (args.dir / "model" / "config.json").is_file():
        make_model(args.dir / "model", args.hidden, args.layers)
    report: dict = {"benchmark": "zero", "machine": machine(), "ranks": args.ranks, "runs": []}
    for accum in [int(x) for x in args.micro_batches.split(",")]:
        args.accum = accum
        report["runs"].append(_run(args, accum))
    report["model"] = {
        "hidden": args.hidden,
        "layers": args.layers,
        "params": report["runs"][0]["params"],
        "dtype": "float32",
    }
    first = report["runs"][0]["wire_bytes_per_step_rank0"]
    report["wire_over_first_run"] = [  # each run's bytes on the wire per step over the first's
        {
            "micro_batches": r["global_batch"]["micro_batches"],
            **{k: v / first[k] for k, v in r["wire_bytes_per_step_rank0"].items() if first.get(k)},
        }
        for r in report["runs"]
    ]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
