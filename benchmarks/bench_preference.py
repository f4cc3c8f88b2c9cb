"""Bytes a preference (DPO) step moves against an SFT step of the same model and budgets.

The reference of a LoRA/QLoRA DPO run is the base with the adapters off, run in the same layer visits as the
policy, so a step reads each weight once for both: it should move what an SFT step moves, plus the traffic of
its boundaries (a pair is two sequences). A random Llama (hidden ``--hidden``, ``--layers`` layers; a word-level
tokenizer fitted to the bundled demo data), its base on disk and streamed every step (device and host budgets
below its size), pairs made from the demo rows (a prompt of 3 words; the row's rest chosen, another row's
rejected). For each method (``lora``; ``qlora`` where bitsandbytes is installed) and each place of the layer
boundaries (``device``, ``host``), three runs of ``--steps`` steps:

- ``dpo``: ``--pairs`` pairs a micro-batch (``2 x pairs`` sequences), ``--accumulation`` micro-batches a step;
- ``sft_same_rows``: SFT on as many sequences a micro-batch (the chosen rows and the rejected ones);
- ``sft_same_batch``: SFT with ``per_device_train_batch_size`` = ``--pairs`` (the recipe's number).

Each prints one JSON object (the last step's bytes per link, the median seconds of the steps after the first);
then a summary per method and placement: the ratios of the DPO step's bytes to each SFT step's, and ``ok``:
at most 1.3 against the SFT step of as many sequences.

Run: ``python benchmarks/bench_preference.py --dir /tmp/bench-preference``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402


def make_inputs(directory: Path, hidden: int, layers: int) -> tuple[Path, Path, Path]:
    """The random model, the SFT rows (every sequence of the pairs) and the pairs, made once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiertune.cli.demo import make_tokenizer
    from tiertune.finetune.data import read_rows

    model = directory / f"model-{hidden}-{layers}"
    texts = list(read_rows(ROOT / "tiertune" / "recipes" / "data" / "demo.jsonl")["text"])
    if not (model / "config.json").is_file():
        tok = make_tokenizer(texts, model)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 128),
            max_position_embeddings=256,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(model)
    pairs, rows = directory / "pairs.jsonl", directory / "rows.jsonl"
    made = []
    for good, other in zip(texts[::2], texts[1::2], strict=False):
        words, others = good.split(), other.split()
        made.append(
            {
                "prompt": " ".join(words[:3]),
                "chosen": " " + " ".join(words[3:]),
                "rejected": " " + " ".join(others[3:]),
            }
        )
    pairs.write_text("".join(json.dumps(r) + "\n" for r in made))
    rows.write_text(
        "".join(json.dumps({"text": r["prompt"] + r[k]}) + "\n" for r in made for k in ("chosen", "rejected"))
    )
    return model, rows, pairs


def one_run(
    args: argparse.Namespace, name: str, method: str, activations: str, model: Path, data: Path
) -> dict:
    """One run in a fresh process: its last step's bytes per link and its steps' median seconds."""
    work = Path(args.dir) / f"{method}-{activations}-{name}"
    dpo = name == "dpo"
    rows = args.pairs * (2 if name == "sft_same_rows" else 1)
    recipe = {
        "model": {
            "path": str(model),
            "dtype": "float32",
            **({"quantize": "nf4"} if method == "qlora" else {}),
        },
        "method": {"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
        "data": {
            "path": str(data),
            "format": "preference" if dpo else "text",
            "max_seq_len": 64,
            "shuffle": False,
            **({} if dpo else {"add_eos": True}),
        },
        "training": {
            "output_dir": str(work / "run"),
            "max_steps": args.steps,
            "per_device_train_batch_size": rows,
            "gradient_accumulation_steps": args.accumulation,
            "learning_rate": 1e-4,
            "logging_steps": 1,
        },
        "offload": {
            "disk_path": str(work / "nvme"),
            "params": "disk",
            "activations": activations,
            "device_budget": args.qlora_device_budget if method == "qlora" else args.device_budget,
            "host_budget": args.qlora_host_budget if method == "qlora" else args.host_budget,
        },
        **({"objective": {"type": "dpo"}} if dpo else {}),
    }
    shutil.rmtree(work, ignore_errors=True)  # a fresh run each time
    work.mkdir(parents=True)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = (
        "import json, sys; from tiertune.config.recipe import load_recipe; from tiertune.finetune.train import train;"
        f"r = train(load_recipe({str(path)!r}), progress=False); print(r.log_path)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} ({method}, {activations}) failed:\n{done.stderr[-3000:]}")
    log = [json.loads(line) for line in Path(done.stdout.strip().splitlines()[-1]).read_text().splitlines()]
    before, after = log[-2]["bytes_moved"], log[-1]["bytes_moved"]
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    return {
        "run": name,
        "method": method,
        "activations": activations,
        "sequences_per_micro_batch": rows * (2 if dpo else 1),
        "moved_per_step": moved,
        "moved_total": sum(moved.values()),
        "step_seconds": statistics.median(r["step_seconds"] for r in log[1:]),
        "loss": log[-1]["loss"],
        **({"rewards/margins": log[-1]["rewards/margins"]} if dpo else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="work directory (the model is made there once)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--pairs", type=int, default=4, help="pairs per micro-batch")
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--device-budget", default="40MiB", help="below the base (LoRA's fp32 layers are 15 MiB each)"
    )
    p.add_argument("--host-budget", default="64MiB", help="below the base, above a step's boundaries")
    p.add_argument("--qlora-device-budget", default="6MiB", help="below the NF4 base (2 MiB a layer)")
    p.add_argument("--qlora-host-budget", default="40MiB")
    p.add_argument("--methods", default="lora,qlora")
    p.add_argument("--placements", default="device,host")
    args = p.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    model, rows, pairs = make_inputs(Path(args.dir), args.hidden, args.layers)
    methods = args.methods.split(",")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        methods = [m for m in methods if m != "qlora"]
    summary = []
    for method in methods:
        for activations in args.placements.split(","):
            runs = {
                name: one_run(args, name, method, activations, model, pairs if name == "dpo" else rows)
                for name in ("dpo", "sft_same_rows", "sft_same_batch")
            }
            for result in runs.values():
                print(json.dumps(result), flush=True)
            if not all(r["moved_total"] for r in runs.values()):
                raise SystemExit(
                    f"{method}, {activations}: a run moved nothing in its last step (the weights fit "
                    "the budgets): lower --device-budget / --qlora-device-budget"
                )
            dpo = runs["dpo"]["moved_total"]
            ratios = {name: dpo / runs[name]["moved_total"] for name in ("sft_same_rows", "sft_same_batch")}
            seconds = {
                name: runs["dpo"]["step_seconds"] / runs[name]["step_seconds"]
                for name in ("sft_same_rows", "sft_same_batch")
            }
            summary.append(
                {
                    "method": method,
                    "activations": activations,
                    "dpo_over_sft_same_rows": round(ratios["sft_same_rows"], 4),
                    "dpo_over_sft_same_batch": round(ratios["sft_same_batch"], 4),
                    "seconds_dpo_over_sft_same_rows": round(seconds["sft_same_rows"], 3),
                    "seconds_dpo_over_sft_same_batch": round(seconds["sft_same_batch"], 3),
                    "ok": ratios["sft_same_rows"] <= 1.3,
                }
            )
    print(
        json.dumps(
            {
                "summary": summary,
                "machine": machine(),
                "model": {"hidden": args.hidden, "layers": args.layers},
                "budgets": {
                    "device": args.device_budget,
                    "host": args.host_budget,
                    "qlora_device": args.qlora_device_budget,
                    "qlora_host": args.qlora_host_budget,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
