"""GRPO over a model streamed from disk: the bytes read from disk per completion when a generation feeds one step
(TRL's default: ``steps_per_generation`` = ``gradient_accumulation_steps``, the reference in the same run) and
when it feeds several (its completions decoded together: each decoded token reads the weights once for all of
them), beside the estimate's generation bytes for the same recipes, in one JSON.

The model is a random Llama made here (``--layers`` x ``--hidden``, a word-level tokenizer), LoRA on it, its
weights on disk under budgets that keep a part of them; the prompts are the first two words of short sentences,
``--steps`` steps of 8 completions (4 of each of 2 prompts), up to ``--length`` tokens each. The bytes are the
store's own (``bytes_moved``: the steps', the generations' and the old policy's passes); the seconds are one
run each. A generation that feeds ``k`` steps saves ``(k - 1) x max_completion_length`` passes of the weights
(the later steps' decodings) and adds ``k`` passes for the sampling policy's log-probabilities: with short
completions, or budgets that keep most of the model, a generation a step can read less.

    python benchmarks/bench_grpo_generation.py --dir /tmp/bgg --spans 1,2,4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

TEXTS = [
    f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old", "fat") for b in ("blue", "flat", "wet")
]
REWARD = "def cats(prompts, completions, **kw):\n    return [c.split().count('cat') / max(1, len(c.split())) for c in completions]\n"
ACCUMULATION, ROWS = 2, 4


def _recipe(root: Path, model: Path, spans: int, a: argparse.Namespace) -> Path:
    import yaml

    name = f"spans{spans}"
    recipe = {
        "model": {"path": str(model), "dtype": "float32"},
        "method": {"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        "data": {
            "path": str(root / "prompts.jsonl"),
            "format": "prompt",
            "shuffle": False,
            "max_seq_len": 32,
        },
        "objective": {
            "type": "grpo",
            "num_generations": 4,
            "max_completion_length": a.length,
            "reward_funcs": [f"{root / 'rewards.py'}:cats"],
            "steps_per_generation": spans * ACCUMULATION,
        },
        "training": {
            "output_dir": str(root / name),
            "max_steps": a.steps,
            "per_device_train_batch_size": ROWS,
            "gradient_accumulation_steps": ACCUMULATION,
            "learning_rate": 1e-2,
            "save_steps": 0,
            "logging_steps": 1,
            "overwrite_output_dir": True,
        },
        "offload": {
            "disk_path": str(root / f"{name}-nvme"),
            "params": "disk",
            "device_budget": a.budget,
            "host_budget": a.budget,
        },
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument(
        "--spans", default="1,2,4", help="steps a generation feeds, comma-separated (1: the reference)"
    )
    p.add_argument("--steps", type=int, default=8, help="a multiple of every span")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--length", type=int, default=16, help="max_completion_length")
    p.add_argument("--budget", default="4MiB", help="device and host budgets each")
    a = p.parse_args()
    from tiertune.cli.demo import make_model
    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate
    from tiertune.finetune.train import train

    spans = [int(s) for s in a.spans.split(",")]
    if 1 not in spans or any(a.steps % s for s in spans):
        p.error("--spans must hold 1 (the reference) and each divide --steps")
    root = a.dir
    root.mkdir(parents=True, exist_ok=True)
    model = root / "model"
    if not (model / "config.json").is_file():
        make_model(model, TEXTS, a.layers, a.hidden)
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": " ".join(t.split()[:2])}) + "\n" for t in TEXTS * 4)
    )
    (root / "rewards.py").write_text(REWARD)
    runs = {}
    completions = a.steps * ROWS * ACCUMULATION
    for span in spans:
        recipe = load_recipe(_recipe(root, model, span, a))
        generation = estimate(recipe, measure=False).generation
        began = time.perf_counter()
        result = train(recipe, progress=False)
        seconds = time.perf_counter() - began
        log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
        read = log[-1]["bytes_moved"].get("disk->host", 0)
        runs[span] = {
            "steps_a_generation": span,
            "disk_read_bytes": read,
            "disk_bytes_per_completion": read / completions,
            "estimated_generation_disk_bytes_per_completion": generation.read_bytes.get("disk->host", 0)
            / generation.sequences,
            "estimated_sequences_decoded_together": generation.sequences,
            "seconds": round(seconds, 2),
            "generation_seconds": round(sum(r.get("generation_seconds", 0.0) for r in log), 3),
            "final_reward": log[-1].get("reward"),
        }
        shutil.rmtree(root / f"spans{span}-nvme", ignore_errors=True)
    reference = runs[1]["disk_bytes_per_completion"]
    for run in runs.values():
        run["disk_bytes_per_completion_vs_one_step"] = run["disk_bytes_per_completion"] / reference
    print(json.dumps({"machine": machine(), "completions": completions, "runs": runs}))


if __name__ == "__main__":
    main()
