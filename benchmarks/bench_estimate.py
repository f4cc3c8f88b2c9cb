"""``tiertune estimate``'s step time against measured steps, on this machine's CPU, in one invocation.

Two runs, each estimated (``estimate(recipe, gpu="cpu")``: the disk probed, the CPU optimizer and a matrix
product of the model's own shape measured) and then trained for ``--steps`` steps:

- ``demo``: the built-in demo recipe (a random 8-layer Llama, hidden 256, full fine-tuning with weights and
  optimizer states on disk, 64 MiB budgets) as ``tiertune demo`` runs it;
- ``1b``: a random Llama of ~1.1 B parameters (TinyLlama's shape: hidden 2048, 22 layers, MLP 5632, vocab
  32000) in bf16, LoRA r 16 on every linear layer, 2 x 128 tokens per step, base homed on the host.

The measured step time is the median ``step_seconds`` of the run's log over the steps after ``--skip``
(the first records the prefetch trace); ``ratio`` is predicted / measured.

Run: ``python benchmarks/bench_estimate.py --dir /tmp/bench-estimate``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402


def demo_recipe(work: Path, steps: int) -> Path:
    """The demo recipe with its paths under ``work``, its model made as ``tiertune demo`` makes it."""
    from tiertune.cli.demo import make_model
    from tiertune.finetune.data import read_rows

    recipe = yaml.safe_load((ROOT / "tiertune/recipes/demo.yaml").read_text())
    data = ROOT / "tiertune/recipes/data/demo.jsonl"
    model = work / "demo-model"
    if not (model / "config.json").exists():
        make_model(model, read_rows(data)["text"], layers=8, hidden=256)
    recipe["model"]["path"] = str(model)
    recipe["data"]["path"] = str(data)
    recipe["training"].update(
        output_dir=str(work / "demo-out"),
        max_steps=steps,
        logging_steps=1,
        save_steps=0,
        overwrite_output_dir=True,
    )
    recipe["offload"]["disk_path"] = str(work / "demo-offload")
    path = work / "demo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def one_b_recipe(work: Path, steps: int) -> Path:
    """A ~1.1 B random Llama (bf16) and a LoRA recipe for it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiertune.cli.demo import make_tokenizer
    from tiertune.finetune.data import read_rows

    data = ROOT / "tiertune/recipes/data/demo.jsonl"
    model = work / "llama-1b"
    if not (model / "config.json").exists():
        tok = make_tokenizer(read_rows(data)["text"], model)
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model)
    recipe = {
        "model": {"path": str(model), "dtype": "bfloat16"},
        "method": {"type": "lora", "lora": {"r": 16, "alpha": 32, "target_modules": "all-linear"}},
        "data": {"path": str(data), "max_seq_len": 128, "packing": True},
        "training": {
            "output_dir": str(work / "1b-out"),
            "max_steps": steps,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "logging_steps": 1,
            "save_steps": 0,
            "overwrite_output_dir": True,
        },
        "offload": {
            "params": "host",
            "device_budget": "1GiB",
            "host_budget": "4GiB",
            "disk_path": str(work / "1b-offload"),
        },
    }
    path = work / "1b.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def measure(path: Path, skip: int) -> dict:
    """Estimate, then train; the predicted and the measured step time."""
    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate
    from tiertune.finetune.train import train

    recipe = load_recipe(path)
    est = estimate(recipe, gpu="cpu")
    began = time.perf_counter()
    result = train(recipe, progress=False)
    wall = time.perf_counter() - began
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    measured = statistics.median(r["step_seconds"] for r in records[skip:])
    sp = est.speed
    assert sp is not None
    return {
        "predicted_step_s": sp.seconds,
        "measured_step_s": measured,
        "ratio": sp.seconds / measured,
        "predicted_parts_s": sp.parts,
        "bound": sp.bound,
        "flops_per_step": sp.flops.total,
        "flops_formula": sp.flops.formula,
        "compute_rate_tflops": sp.compute_rate / 1e12,
        "compute_rate_source": sp.compute_rate_source,
        "predicted_tokens_per_s": sp.tokens_per_second,
        "moved_per_step_predicted": est.moved_per_step,
        "moved_per_step_measured": {
            k: (records[-1]["bytes_moved"].get(k, 0) - records[skip - 1]["bytes_moved"].get(k, 0))
            / (len(records) - skip)
            for k in records[-1]["bytes_moved"]
        },
        "steps_measured": len(records) - skip,
        "run_wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="where the models and runs are written")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="steps not measured (the first records the trace)")
    p.add_argument("--only", choices=["demo", "1b"], default=None)
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"machine": machine()}
    for name, make in (("demo", demo_recipe), ("1b", one_b_recipe)):
        if a.only in (None, name):
            out[name] = measure(make(a.dir, a.steps), a.skip)
            print(json.dumps({name: out[name]}), file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
