"""The memory plan against runs: a SmolLM2-135M-shaped full fine-tune (its tied 49152 x 576 embedding, 108 MiB
in fp32; weights and AdamW states on disk) with the budgets a user tried and the smallest the plan names.

For each budget pair: ``estimate`` (the plan: what each tier needs, whether it fits) and then ``train`` for
``--steps`` steps, in one invocation. A run the plan refuses must stop before loading the model, naming the
smallest budgets that work (``refused_before_loading``); a run it admits must train to its last step, its
store never holding more chunks of a size class in use on a tier than the plan reserved slots for
(``in_use_peaks`` against ``reserve``). The smallest budgets named are then run too.

Run: ``python benchmarks/bench_plan.py --dir /tmp/bench-plan [--layers 30] [--steps 3]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

TRIED = [("128MiB", "256MiB"), ("128MiB", "512MiB"), ("128MiB", "1GiB")]  # what a user tried (issue 27)


def make_model(directory: Path, layers: int) -> Path:
    """A random model of SmolLM2-135M-Instruct's shapes with a tokenizer fitted to the demo data."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiertune.cli.demo import make_tokenizer
    from tiertune.finetune.data import read_rows

    if (directory / "config.json").is_file():
        return directory
    texts = [row["text"] for row in read_rows(ROOT / "tiertune/recipes/data/demo.jsonl")]
    tok = make_tokenizer(texts, directory)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # JSON lines only on stdout
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def recipe(work: Path, model: Path, name: str, device: str, host: str, steps: int) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(model), "dtype": "float32"},
                "data": {"path": str(ROOT / "tiertune/recipes/data/demo.jsonl"), "max_seq_len": 64},
                "training": {
                    "output_dir": str(work / "runs" / name),
                    "max_steps": steps,
                    "per_device_train_batch_size": 4,
                    "logging_steps": 1,
                    "save_steps": 0,
                    "overwrite_output_dir": True,
                },
                "offload": {
                    "disk_path": str(work / "nvme"),
                    "params": "disk",
                    "optimizer_states": "disk",
                    "device_budget": device,
                    "host_budget": host,
                },
            }
        )
    )
    return path


def trial(path: Path) -> dict:
    from tiertune.config.recipe import load_recipe
    from tiertune.errors import BudgetError
    from tiertune.estimates.report import estimate
    from tiertune.finetune import train as train_module
    from tiertune.offload import store as store_module
    from tiertune.offload.tiers import Tier

    seen: dict = {"loaded": False, "stores": []}
    built, close = train_module.StreamedTrainer, store_module.ChunkStore.close

    def trainer(*args, **kwargs):
        seen["loaded"] = True
        return built(*args, **kwargs)

    def closing(self):
        if not self._closed:
            seen["stores"].append({"in_use_peaks": self.in_use_peaks(), "reserve": self.config.reserve})
        close(self)

    train_module.StreamedTrainer, store_module.ChunkStore.close = trainer, closing
    try:
        loaded = load_recipe(path)
        est = estimate(loaded, measure=False)
        out: dict = {
            "budgets": {"device": loaded.offload.device_budget, "host": loaded.offload.host_budget},
            "estimate": {
                "fits": est.fits,
                "needed": {t.value: est.plan.needed(t) for t in (Tier.DEVICE, Tier.HOST)},
                "slots": {t.value: est.plan.describe(t) for t in (Tier.DEVICE, Tier.HOST)},
            },
        }
        began = time.perf_counter()
        try:
            result = train_module.train(loaded, progress=False)
        except BudgetError as exc:
            smallest = re.search(
                r"offload\.device_budget: (\d+MiB), offload\.host_budget: (\d+MiB)", str(exc)
            )
            out.update(
                outcome="refused",
                refused_before_loading=not seen["loaded"],
                seconds=time.perf_counter() - began,
                smallest={"device": smallest.group(1), "host": smallest.group(2)} if smallest else None,
                message=str(exc),
            )
            return out
        records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
        store = seen["stores"][-1]
        within = all(
            n <= (store["reserve"] or {}).get(tier, {}).get(size, 0)
            for tier, classes in store["in_use_peaks"].items()
            for size, n in classes.items()
        )
        out.update(
            outcome="trained",
            last_step=records[-1]["step"],
            seconds=time.perf_counter() - began,
            step_seconds_median=statistics.median(r["step_seconds"] for r in records[1:] or records),
            peak_bytes=records[-1]["peak_bytes"],
            in_use_within_reserve=within,
            **store,
        )
        return out
    finally:
        train_module.StreamedTrainer, store_module.ChunkStore.close = built, close


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.dir / "model", args.layers)
    results = []
    smallest = None
    for i, (device, host) in enumerate(TRIED):
        res = {
            "trial": f"tried {device} / {host}",
            **trial(recipe(args.dir, model, f"t{i}", device, host, args.steps)),
        }
        results.append(res)
        print(json.dumps(res), flush=True)
        smallest = smallest or res.get("smallest")
    if smallest:
        path = recipe(args.dir, model, "smallest", smallest["device"], smallest["host"], args.steps)
        res = {"trial": "the smallest budgets named", **trial(path)}
        results.append(res)
        print(json.dumps(res), flush=True)
    ok = all(
        (r["outcome"] == "refused" and r["refused_before_loading"] and not r["estimate"]["fits"])
        or (
            r["outcome"] == "trained"
            and r["last_step"] == args.steps
            and r["in_use_within_reserve"]
            and r["estimate"]["fits"]
        )
        for r in results
    )
    print(
        json.dumps(
            {
                "summary": {
                    "machine": machine(),
                    "layers": args.layers,
                    "steps": args.steps,
                    "every_run_trained_or_was_refused_before_loading": ok,
                    "outcomes": [r["outcome"] for r in results],
                }
            }
        )
    )


if __name__ == "__main__":
    main()
