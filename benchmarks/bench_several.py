"""Several LoRA adapters over one base (``engine.several``): bytes read from disk a step and the step's time for
N adapters against one, where the step is bound by reading and dequantizing the base, in one JSON.

The base is a real model's shapes (``--config``, by default Command R+ 104B's) cut to ``--layers`` decoder layers,
written as a pre-quantized NF4 checkpoint (``bench_scale.write_nf4_checkpoint``) and read in place from disk (the
first step reads it whole; later steps read what the budgets do not hold); each adapter trains a rank-16 LoRA of
every linear layer on its own random rows. The reference in the same run is one adapter's step over the same base::

    python benchmarks/bench_several.py --dir /tmp/bsv --layers 4 --adapters 1,4 --steps 2 \
        --host-budget 7GiB --device-budget 8GiB

The JSON has, per N, every step's seconds, bytes read from disk and parts, the median of the steps after the first
(which also reads what the later ones find in memory), and its ratios to N = 1; the checkpoint is removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

CONFIG = (
    Path(__file__).resolve().parents[1]
    / "tiertune/recipes/models/CohereForAI/c4ai-command-r-plus/config.json"
)


def _batches(count: int, rows: int, seq: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def _run(base: Path, disk: Path, n: int, a: argparse.Namespace, vocab: int) -> dict:
    from tiertune.config.plan import plan
    from tiertune.config.recipe import Recipe
    from tiertune.engine import StreamedTrainer
    from tiertune.methods.lora import adapter_name

    recipe = Recipe()
    recipe.model.path = str(base)
    recipe.model.quantize = "nf4"  # as it ships: read in place
    recipe.model.dtype = "bfloat16"
    recipe.method.type = "lora"
    recipe.method.lora.r = 16
    recipe.method.lora.dropout = 0.0
    recipe.data.max_seq_len = a.seq
    recipe.training.per_device_train_batch_size = a.rows
    recipe.offload.disk_path = str(disk)
    recipe.offload.params = "disk"
    recipe.offload.host_budget = a.host_budget
    recipe.offload.device_budget = a.device_budget
    store, engine = plan(recipe)
    engine = dataclasses.replace(engine, max_steps=a.steps)
    others = tuple(
        dataclasses.replace(engine, lora=dataclasses.replace(engine.lora, seed=i)) for i in range(1, n)
    )
    trainer = StreamedTrainer(str(base), store, dataclasses.replace(engine, others=others))
    data = [_batches(a.steps, a.rows, a.seq, vocab, seed=i) for i in range(n)]
    seconds, read, parts = [], [], []
    try:
        for s in range(a.steps):
            before = _disk_read(trainer)
            began = time.perf_counter()
            if n == 1:
                trainer.step([data[0][s]])
            else:
                trainer.step_adapters({adapter_name(i): [data[i][s]] for i in range(n)})
            seconds.append(time.perf_counter() - began)
            read.append(_disk_read(trainer) - before)
            parts.append({k: round(v, 2) for k, v in (trainer.last_report.parts or {}).items()})
            print(
                f"N={n} step {s + 1}: {seconds[-1]:.2f} s, {read[-1]:,} bytes from disk",
                file=sys.stderr,
                flush=True,
            )
    finally:
        trainer.close()
    later = slice(1, None) if a.steps > 1 else slice(None)
    return {
        "adapters": n,
        "step_seconds": [round(x, 3) for x in seconds],
        "median_step_s": round(statistics.median(seconds[later]), 3),
        "disk_bytes_per_step": read,
        "median_disk_bytes": int(statistics.median(read[later])),
        "tokens_per_step": n * a.rows * a.seq,
        "step_parts_s": parts,
    }


def _disk_read(trainer) -> int:
    return sum(v for link, v in trainer.store_stats().bytes_moved.items() if link.startswith("disk->"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the checkpoint and the disk tier go")
    p.add_argument("--config", default=str(CONFIG), help="a real model's config.json")
    p.add_argument("--layers", type=int, default=2, help="decoder layers kept")
    p.add_argument("--adapters", default="1,4", help="N adapters, comma-separated (1 is the reference)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--rows", type=int, default=1, help="rows a micro-batch, each adapter one micro-batch a step"
    )
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--device-budget", default="12GiB")
    a = p.parse_args()

    from bench_scale import write_nf4_checkpoint

    directory = Path(a.dir)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(a.config).read_text())
    config["num_hidden_layers"] = a.layers
    base = directory / "base-nf4"
    try:
        written = write_nf4_checkpoint(config, base)
        print(f"checkpoint: {json.dumps(written)}", file=sys.stderr, flush=True)
        runs = []
        for n in (int(x) for x in a.adapters.split(",")):
            disk = directory / f"disk-{n}"
            shutil.rmtree(disk, ignore_errors=True)
            runs.append(_run(base, disk, n, a, int(config["vocab_size"])))
            shutil.rmtree(disk, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    one = runs[0]
    for run in runs:
        run["bytes_over_one"] = round(run["median_disk_bytes"] / max(one["median_disk_bytes"], 1), 4)
        run["time_over_one"] = round(run["median_step_s"] / one["median_step_s"], 3)
    out = {
        "benchmark": "several_adapters_one_base",
        "machine": machine(),
        "config": a.config,
        "layers": a.layers,
        "model_bytes": written.get("bytes_on_disk"),
        "runs": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
