"""Long sequences on the CPU: how a run's peak memory grows with the sequence length, against what
``tiertune estimate`` says a layer's activations and temporaries take, and the longest sequence that trains
under a fixed memory budget.

A random Llama (hidden 256, MLP 1024, 2 layers, 4 heads; a word-level tokenizer fitted to the bundled demo
data), LoRA on every linear, the layer inputs on the host (``offload.activations: host``), one micro-batch of
one row a step, 2 steps: the demo rows packed into the row (``--data packed``: documents of ~13 tokens, the
attention cut into them) or one long document cut to the length (``--data document``). Each length runs in a fresh
process (its peak RSS is its own). One JSON object per length, then a summary:

- ``slope``: the growth of peak RSS per token between two lengths (``--slope-between``, default 8K and 32K; each
  length's median of ``--repeats`` runs), in bytes and in hidden states' worth of bytes (``hidden`` x the compute dtype's size), with the estimate's own
  per-token growth of what it says the run holds (the store's tiers and the bytes outside the store) and their
  ratio;
- ``longest`` (``--bisect BYTES``): the longest multiple of 1024 tokens whose run's peak RSS stays within the
  budget, bisected between ``--bisect-low`` and ``--bisect-high``.

Run: ``python benchmarks/bench_longseq.py --dir /tmp/bench-longseq [--lengths 8192,16384,32768]
[--sequence-tile 0] [--bisect 4GiB]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, proc_status_bytes  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, HEADS = 256, 1024, 2, 4


def make_model(directory: Path) -> Path:
    """The benchmark's random Llama and its tokenizer (made once)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiertune.cli.demo import make_tokenizer
    from tiertune.finetune.data import read_rows

    if (directory / "config.json").is_file():
        return directory
    texts = [row["text"] for row in read_rows(ROOT / "tiertune/recipes/data/demo.jsonl")]
    tok = make_tokenizer(texts, directory)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=1 << 20,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_data(path: Path, tokens: int, packed: bool) -> Path:
    """The demo text, at least ``tokens`` tokens of it: its rows, to be packed into one row (``packed``), or
    one long document (the rows joined) cut to the length."""
    from tiertune.finetune.data import read_rows

    texts = [row["text"] for row in read_rows(ROOT / "tiertune/recipes/data/demo.jsonl")]
    words = sum(len(t.split()) for t in texts)
    rows = texts * (tokens // max(words, 1) + 2)
    with path.open("w") as f:
        for row in rows if packed else [" ".join(rows)]:
            f.write(json.dumps({"text": row}) + "\n")
    return path


def recipe(work: Path, model: Path, seq: int, tile: int | None, steps: int, packed: bool) -> Path:
    offload = {"activations": "host", "host_budget": "auto", "device_budget": "auto"}
    if tile is not None:
        offload["sequence_tile"] = tile
    path = work / f"recipe-{seq}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(model), "dtype": "float32"},
                "method": {"type": "lora", "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}},
                "data": {
                    "path": str(make_data(work / f"data-{seq}.jsonl", seq, packed)),
                    "format": "text",
                    "max_seq_len": seq,
                    "packing": packed,
                },
                "training": {
                    "output_dir": str(work / "runs" / str(seq)),
                    "max_steps": steps,
                    "per_device_train_batch_size": 1,
                    "logging_steps": 1,
                    "save_steps": 0,
                    "overwrite_output_dir": True,
                    "learning_rate": 1e-4,
                },
                "offload": offload,
            }
        )
    )
    return path


def child(path: Path) -> dict:
    """One length: the estimate, then the run; peak RSS (the kernel's high-water mark) of this process."""
    import torch

    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate
    from tiertune.finetune.train import train

    torch.set_num_threads(2)
    loaded = load_recipe(path)
    est = estimate(loaded, measure=False, gpu="cpu")
    held = sum(t.needed for t in est.tiers.values() if t.budget) + sum(est.outside_store.values())
    began = time.perf_counter()
    result = train(loaded, progress=False)
    seconds = time.perf_counter() - began
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    peak = proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak_rss_bytes": peak,
        "estimate_held_bytes": held,
        "estimate_outside_store": est.outside_store,
        "losses": [r["loss"] for r in records if "loss" in r],
        "seconds": seconds,
    }


def run_length(work: Path, model: Path, seq: int, tile: int | None, steps: int, packed: bool) -> dict:
    path = recipe(work, model, seq, tile, steps, packed)
    proc = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"seq": seq, "error": " | ".join(tail)}
    return {"seq": seq, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path)
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--slope-between", default="8192,32768")
    p.add_argument(
        "--sequence-tile", type=int, default=None, help="offload.sequence_tile (default: the plan's)"
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--data",
        choices=("packed", "document"),
        default="packed",
        help="the demo rows packed into each row (documents of ~13 tokens), or one long document",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs per length; the slope takes each length's median"
    )
    p.add_argument(
        "--bisect", default=None, help="a peak RSS budget (e.g. 4GiB): the longest length within it"
    )
    p.add_argument("--bisect-low", type=int, default=1024)
    p.add_argument("--bisect-high", type=int, default=1 << 20)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)), flush=True)
        return
    from tiertune.settings import parse_size

    if args.dir is None:
        p.error("--dir is required: where the model, the data and the runs go")
    args.dir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.dir / "model")
    results = {}
    for seq in (int(x) for x in args.lengths.split(",")):
        runs = [
            run_length(args.dir, model, seq, args.sequence_tile, args.steps, args.data == "packed")
            for _ in range(args.repeats)
        ]
        for r in runs:
            print(json.dumps(r), flush=True)
        good = [r for r in runs if "error" not in r]
        if good:  # the median run by peak RSS (the allocator's high-water mark drifts between runs)
            good.sort(key=lambda r: r["peak_rss_bytes"])
            results[seq] = {
                **good[len(good) // 2],
                "peak_rss_bytes_runs": [r["peak_rss_bytes"] for r in good],
            }
        else:
            results[seq] = runs[0]
    summary: dict = {
        "machine": machine(),
        "hidden": HIDDEN,
        "intermediate": INTERMEDIATE,
        "layers": LAYERS,
        "sequence_tile": args.sequence_tile,
        "data": args.data,
    }
    lo, hi = (int(x) for x in args.slope_between.split(","))
    if lo in results and hi in results and "error" not in results[lo] and "error" not in results[hi]:
        state = HIDDEN * 4  # fp32
        measured = (results[hi]["peak_rss_bytes"] - results[lo]["peak_rss_bytes"]) / (hi - lo)
        estimated = (results[hi]["estimate_held_bytes"] - results[lo]["estimate_held_bytes"]) / (hi - lo)
        summary["slope"] = {
            "between": [lo, hi],
            "measured_bytes_per_token": measured,
            "measured_hidden_states_per_token": measured / state,
            "estimated_bytes_per_token": estimated,
            "estimated_hidden_states_per_token": estimated / state,
            "estimate_over_measured": estimated / measured if measured else None,
        }
    if args.bisect:
        budget = parse_size(args.bisect, "--bisect")
        low, high, trials = args.bisect_low, args.bisect_high, []
        while high - low > 1024:
            mid = (low + high) // 2 // 1024 * 1024
            r = run_length(args.dir, model, mid, args.sequence_tile, 1, args.data == "packed")
            fits = "error" not in r and r["peak_rss_bytes"] <= budget
            trials.append(
                {"seq": mid, "fits": fits, "peak_rss_bytes": r.get("peak_rss_bytes"), "error": r.get("error")}
            )
            print(json.dumps(trials[-1]), flush=True)
            low, high = (mid, high) if fits else (low, mid)
        summary["longest"] = {"budget_bytes": budget, "longest_tokens": low, "trials": trials}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
