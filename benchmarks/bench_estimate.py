"""``tiertune estimate``'s step time against measured steps, on this machine's CPU, in one invocation.

Four runs, each estimated (``estimate(recipe, gpu="cpu")``: the disk probed, the CPU optimizer and the
engine's own step on cuts of the model measured, the replayed step played as a timeline) and then trained for
``--steps`` steps:

- ``demo``: the built-in demo recipe (a random 8-layer Llama, hidden 256, full fine-tuning with weights and
  optimizer states on disk, 64 MiB budgets) as ``tiertune demo`` runs it;
- ``demo_eval``: the same evaluating 96 held-out rows every 4 steps, ``--repeats`` times in turn: the
  estimate's seconds of an evaluation's passes against the run's ``eval_runtime`` (``evaluation_s``, medians);
- ``1b``: a random Llama of ~1.1 B parameters (TinyLlama's shape: hidden 2048, 22 layers, MLP 5632, vocab
  32000) in bf16, LoRA r 16 on every linear layer, 2 x 128 tokens per step, base homed on the host;
- ``compute_longer`` and ``few_tokens`` (``OVERLAP_CASES``): full fine-tuning with the CPU optimizer during
  backward, many tokens through small layers and 8 through wide ones. Each is
  estimated and trained ``--repeats`` times in turn, and the timeline's parts (``compute``, ``io_wait``,
  ``optimizer_wait``: the optimizer not hidden, ``optimizer_busy``, ``optimizer_hidden_share``) are set
  against the run's log (``parts_s``): medians over the pairs, since this machine's speed drifts by 20% and
  more from one minute to the next;
- ``gpu_like`` (``GPU_LIKE``): the regime whose updates outlast the compute, which this CPU reaches only with
  ``bench_train.py``'s stand-in GPU: estimated with the layers' milliseconds given (``--layer-ms``), run by
  ``bench_train.py --fast-compute``, ``--repeats`` times in turn.

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
from functools import partial
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


def demo_eval_recipe(work: Path, steps: int) -> Path:
    """The demo recipe evaluating a held-out set (the demo data's first 96 rows: 3 passes of 2 x 16 rows) every
    4 steps."""
    path = demo_recipe(work, steps)
    recipe = yaml.safe_load(path.read_text())
    held_out = work / "demo-held-out.jsonl"
    rows = (ROOT / "tiertune/recipes/data/demo.jsonl").read_text().splitlines(keepends=True)
    held_out.write_text("".join(rows[:96]))
    recipe["data"]["eval_path"] = str(held_out)
    recipe["training"].update(eval_strategy="steps", eval_steps=4)
    path = work / "demo-eval.yaml"
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


OVERLAP_CASES = {
    # (layers, hidden, rows, tokens): full fine-tuning, fp32, weights and AdamW states on the host, the
    # optimizer during backward in place (no clipping, as the GPU suite's full phase)
    "compute_longer": (4, 512, 4, 128),
    "few_tokens": (6, 1024, 1, 8),
}
"""Two cases of the timeline on this CPU: many tokens, and few tokens through wide layers (on a CPU even 8 tokens'
backward outlasts the layers' updates: writing each weight's gradient costs about what AdamW does; the regime
where the updates outlast the compute is ``GPU_LIKE``'s)."""


def overlap_recipe(work: Path, steps: int, name: str) -> Path:
    """A random Llama of ``OVERLAP_CASES[name]``'s shape (its vocabulary the demo data's words) and a full
    fine-tune of it with the CPU optimizer during backward."""
    from tiertune.cli.demo import make_model
    from tiertune.finetune.data import read_rows

    layers, hidden, rows, tokens = OVERLAP_CASES[name]
    data = ROOT / "tiertune/recipes/data/demo.jsonl"
    model = work / f"{name}-model"
    if not (model / "config.json").exists():
        make_model(model, read_rows(data)["text"], layers=layers, hidden=hidden)
    recipe = {
        "model": {"path": str(model), "dtype": "float32"},
        "method": {"type": "full"},
        "data": {"path": str(data), "max_seq_len": tokens, "packing": True},
        "training": {
            "output_dir": str(work / f"{name}-out"),
            "max_steps": steps,
            "per_device_train_batch_size": rows,
            "logging_steps": 1,
            "save_steps": 0,
            "max_grad_norm": 0.0,
            "overwrite_output_dir": True,
        },
        "offload": {
            "params": "host",
            "optimizer_states": "host",
            "device_budget": "256MiB",
            "host_budget": "4GiB",
            "overlap_optimizer": True,
        },
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


GPU_LIKE = {
    "layers": 12,
    "hidden": 1024,
    "intermediate": 2752,
    "heads": 16,
    "vocab": 8000,
    "seq": 8,
    "ms": (3, 9),
}
"""The updates-longer regime, which this CPU reaches only with a stand-in GPU (``bench_train.py
--fast-compute``): 12 bf16 layers of 1024 whose forward and backward take 3 and 9 ms on a thread of their own,
8 tokens a step, weights and states on the host, fp32 gradients homed on disk (held on the host while in
flight), no clipping, one thread a side (``bench_train``'s ``--threads 1``)."""


def gpu_like(work: Path, steps: int, skip: int, repeats: int) -> dict:
    """``GPU_LIKE``: ``estimate(..., layer_seconds=ms, threads=1)`` of the recipe ``bench_train``'s ``host``
    mode amounts to, then that mode's run, ``repeats`` times in turn; ``bench_train``'s parts against the
    timeline's."""
    import subprocess

    from bench_load import write_checkpoint

    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate

    g = GPU_LIKE
    model = work / "gpu-like-model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        write_checkpoint(
            model, g["layers"], g["hidden"], g["intermediate"], g["heads"], g["heads"], g["vocab"]
        )
    recipe = {
        "model": {"path": str(model), "dtype": "bfloat16"},
        "method": {"type": "full"},
        "data": {
            "path": str(ROOT / "tiertune/recipes/data/demo.jsonl"),
            "max_seq_len": g["seq"],
            "packing": False,
        },
        "training": {
            "output_dir": str(work / "gpu-like-out"),
            "max_steps": steps,
            "per_device_train_batch_size": 1,
            "learning_rate": 1e-5,
            "max_grad_norm": 0.0,
        },
        "offload": {
            "params": "host",
            "optimizer_states": "host",
            "device_budget": "2GiB",
            "host_budget": "6GiB",
            "disk_path": str(work / "gpu-like-disk"),
            "overlap_optimizer": True,
        },
    }
    path = work / "gpu-like.yaml"
    path.write_text(yaml.safe_dump(recipe))
    shape = ("--layers", "--hidden", "--intermediate", "--heads", "--kv-heads", "--vocab")
    values = (g["layers"], g["hidden"], g["intermediate"], g["heads"], g["heads"], g["vocab"])
    args = [x for pair in zip(shape, map(str, values), strict=True) for x in pair]
    args += ["--seq", str(g["seq"]), "--dtype", "bfloat16", "--max-grad-norm", "0", "--handoff-lag", "0"]
    args += ["--fast-compute", ",".join(map(str, g["ms"])), "--steps", str(steps), "--threads", "1"]
    args += ["--host-budget", "6GiB", "--device-budget", "2GiB"]
    guesses, runs = [], []
    for _ in range(repeats):
        est = estimate(load_recipe(path), gpu="cpu", threads=1, layer_seconds=tuple(m / 1e3 for m in g["ms"]))
        guesses.append(est.speed.timeline.as_json())
        cmd = [sys.executable, str(ROOT / "benchmarks/bench_train.py"), *args, "--dir", str(work)]
        cmd += ["--child", str(model), str(work / "gpu-like-disk"), "host"]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    names = {
        "step": ("step_s", "step_s"),
        "compute": ("compute_s", "compute_s"),
        "io_wait": ("io_wait_s", "io_wait_s"),
        "optimizer_wait": ("optimizer_wait_s", "optimizer_not_hidden_s"),
        "optimizer_busy": ("optimizer_busy_s", "optimizer_busy_s"),
        "optimizer_hidden_share": ("optimizer_hidden_share", "optimizer_hidden_share"),
    }
    parts = {
        part: compared([x[mine] for x in guesses], [x[theirs] for x in runs])
        for part, (mine, theirs) in names.items()
    }
    return {
        "timeline": parts,
        "device_busy_s": statistics.median(x["device_busy_s"] for x in runs),
        "repeats": repeats,
        "settings": g,
    }


PARTS = ("compute", "io_wait", "optimizer_wait", "optimizer_busy")
"""The parts of a step the run logs (``parts_s``) and the estimate's timeline names."""


def compared(guesses: list[float], runs: list[float]) -> dict:
    """A part as estimated and as run, pair by pair, and the medians over the pairs (``ratio``: estimated
    median over run median)."""
    guess, run = statistics.median(guesses), statistics.median(runs)
    return {
        "predicted": guess,
        "measured": run,
        "ratio": guess / run if run else None,
        "predicted_each": guesses,
        "measured_each": runs,
    }


def measure(path: Path, skip: int, repeats: int = 1) -> dict:
    """Estimate, then train, ``repeats`` times in turn (on a machine whose speed drifts from minute to minute,
    each estimate beside a run of its own minute); the predicted and the measured step time, and the
    timeline's parts against the run's logged ones (``parts_s``): per pair, and the median over the pairs
    (``ratio``: the predicted median over the measured median)."""
    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate
    from tiertune.finetune.train import train

    recipe = load_recipe(path)
    pairs = []
    for _ in range(repeats):
        est = estimate(recipe, gpu="cpu")
        began = time.perf_counter()
        result = train(recipe, progress=False)
        wall = time.perf_counter() - began
        logged = [json.loads(line) for line in result.log_path.read_text().splitlines()]
        records = [r for r in logged if "step_seconds" in r]
        evaluations = [r["eval_runtime"] for r in logged if "eval_runtime" in r]
        pairs.append((est, records, wall, evaluations))
    evaluated = None
    if pairs[0][0].evaluation is not None and pairs[0][3]:  # an evaluation's passes, estimated and run
        passes = [e.evaluation.seconds - (e.evaluation.step_after_extra or 0.0) for e, *_ in pairs]
        evaluated = compared(passes, [statistics.median(ev) for *_, ev in pairs])
    pairs = [(e, recs, w) for e, recs, w, _ in pairs]
    est, records, wall = pairs[-1]
    step = [statistics.median(r["step_seconds"] for r in recs[skip:]) for _, recs, _ in pairs]
    sp = est.speed
    assert sp is not None
    parts: dict = {}
    # the run's steps were mostly clipped (their optimizer after backward) or not: the timeline of that kind
    counts = records[-1].get("optimizer_steps", {})
    clipped = counts.get("after_backward", 0) > counts.get("speculative", 0) and sp.after_clipped is not None
    if sp.timeline is not None and "parts_s" in records[-1]:
        for part in ("step", *PARTS, "optimizer_hidden_share"):
            key = part if part == "optimizer_hidden_share" else f"{part}_s"
            guesses = [
                (e.speed.after_clipped if clipped else e.speed.timeline).as_json()[key] for e, _, _ in pairs
            ]
            runs = [
                statistics.median(
                    r["step_seconds"] if part == "step" else r["parts_s"][part] for r in recs[skip:]
                )
                for _, recs, _ in pairs
            ]
            parts[part] = compared(guesses, runs)
    return {
        "timeline": parts,
        "evaluation_s": evaluated,
        "run_steps_clipped": clipped,
        "optimizer_steps": counts,
        "timeline_work_s": sp.timeline.work if sp.timeline is not None else None,
        "predicted_step_s": statistics.median(e.speed.seconds for e, _, _ in pairs),
        "predicted_after_clipped_step_s": statistics.median(
            e.speed.after_clipped.step for e, _, _ in pairs if e.speed.after_clipped is not None
        )
        if sp.after_clipped is not None
        else None,
        "measured_step_s": statistics.median(step),
        "ratio": statistics.median(e.speed.seconds for e, _, _ in pairs) / statistics.median(step),
        "repeats": repeats,
        "predicted_parts_s": sp.parts,
        "bound": sp.bound,
        "flops_per_step": sp.flops.total,
        "flops_formula": sp.flops.formula,
        "compute_rate_tflops": sp.compute_rate / 1e12,
        "compute_rate_source": sp.compute_rate_source,
        "predicted_tokens_per_s": sp.tokens_per_second,
        # the run's steps mostly clipped: a step after clipped ones (its update after backward, in place)
        "moved_per_step_predicted": est.moved_after_clipped
        if clipped and est.moved_after_clipped
        else est.moved_per_step,
        "moved_per_step_predicted_of": "a step after clipped ones"
        if clipped and est.moved_after_clipped
        else "a step",
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
    p.add_argument("--only", choices=["demo", "demo_eval", "1b", *OVERLAP_CASES, "gpu_like"], default=None)
    p.add_argument(
        "--repeats", type=int, default=3, help="estimate-then-train pairs of the timeline's cases (medians)"
    )
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"machine": machine()}
    cases = {"demo": demo_recipe, "demo_eval": demo_eval_recipe, "1b": one_b_recipe}
    cases.update({name: partial(overlap_recipe, name=name) for name in OVERLAP_CASES})
    for name, make in cases.items():
        if a.only in (None, name):
            repeats = a.repeats if name in (*OVERLAP_CASES, "demo_eval") else 1
            out[name] = measure(make(a.dir, a.steps), a.skip, repeats)
            print(json.dumps({name: out[name]}), file=sys.stderr)
    if a.only in (None, "gpu_like"):
        out["gpu_like"] = gpu_like(a.dir, a.steps, a.skip, a.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
