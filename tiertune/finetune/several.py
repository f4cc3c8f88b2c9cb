"""Several recipes trained over one base in one run (``tiertune train a.yaml b.yaml``, ``sweep:``:
``config.sweep``): one ``StreamedTrainer`` whose base streams once a step for every recipe's LoRA adapter
(``engine.several``), each adapter with its own data, steps, log, and model in its own run directory.

Each run directory is locked and checked as a run's (``rundir.RunDirectory``); each adapter's
``trainer_log.jsonl`` has its own records (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``), with the shared
stream's ``bytes_moved`` counted from the start, as a run of one. An adapter whose steps are done takes no part in
later steps. SIGINT or SIGTERM stops the run at its next safe point (``Interrupted``; nothing is kept to
resume). Not yet: checkpoints of several adapters (``training.save_steps`` must be 0), preference and
distillation objectives, several processes."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiertune.config.plan import resolve
from tiertune.config.recipe import Recipe
from tiertune.config.sweep import shared_base
from tiertune.errors import ConfigError, Interrupted, Signalled
from tiertune.files import write_text_atomically
from tiertune.finetune.checkpoint import RECIPE_FILE
from tiertune.finetune.data import batches
from tiertune.finetune.rundir import RunDirectory
from tiertune.finetune.signals import stop_on_signals
from tiertune.loading.hub import model_directory
from tiertune.methods.lora import adapter_name


@dataclass
class AdapterResult:
    """One recipe's adapter of a run over one base: its directory, steps, losses and last record."""

    output_dir: Path
    name: str
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)


def train_several(recipes: list[Recipe], progress: bool = True) -> list[AdapterResult]:
    """Train each of ``recipes`` (two or more; ``config.sweep.shared_base`` holds for them) as a LoRA adapter over
    their one base, the base streamed once a step for all of them; export each adapter into its directory.
    Prints a table of each adapter's final loss and directory when ``progress``."""
    from tiertune.distributed.world import World
    from tiertune.finetune.train import admit, load_run

    recipes = [r.with_absolute_paths() for r in recipes]
    shared_base(recipes)
    world = World.from_env()
    for recipe in recipes:
        recipe.model.path = model_directory(recipe.model.path)
        _refuse(recipe, world.size)
    runs = [resolve(r, world) for r in recipes]
    loaded = [load_run(r, world.size) for r in recipes]
    first = runs[0]
    engine = dataclasses.replace(
        first.engine,
        max_steps=loaded[0].steps,
        activation_tokens=max(r.engine.activation_tokens for r in runs),
        others=tuple(
            dataclasses.replace(r.engine, max_steps=ld.steps)
            for r, ld in zip(runs[1:], loaded[1:], strict=True)
        ),
    )
    admit(first)
    with stop_on_signals() as stop, ExitStack() as held:
        for recipe, ld in zip(recipes, loaded, strict=True):
            directory = held.enter_context(RunDirectory(recipe.training.output_dir))
            directory.prepare(directory.decide(recipe, ld.steps))
        done = [0]  # the shared steps completed
        try:
            with stop.at_safe_points():
                return _train(recipes, first.store, engine, loaded, stop, progress, done)
        except Signalled as exc:  # the trainer closed, the directories unlocked: said as a run's stop
            where = Path(recipes[0].training.output_dir) / RECIPE_FILE
            raise Interrupted(exc.signum, done[0], None, where) from None


def _refuse(recipe: Recipe, ranks: int) -> None:
    """ConfigError for what several recipes over one base do not run yet."""
    t = recipe.training
    for holds, setting, why in (
        (
            recipe.objective.type == "sft",
            "objective.type",
            f"is {recipe.objective.type}: several adapters train with sft so far",
        ),
        (t.save_steps == 0, "training.save_steps", "must be 0: several adapters write no checkpoints yet"),
        (
            not t.resume_from_checkpoint,
            "training.resume_from_checkpoint",
            "is set: several adapters do not resume yet",
        ),
        (ranks == 1, "the launch", f"has {ranks} processes: several adapters run in one process so far"),
    ):
        if not holds:
            raise ConfigError(f"{setting} {why} (recipe of {t.output_dir}); train that recipe alone")


def _train(
    recipes: list[Recipe],
    store: Any,
    engine: Any,
    loaded: list[Any],
    stop: Any,
    progress: bool,
    done: list[int],
) -> list[AdapterResult]:
    from tiertune.engine import StreamedTrainer

    names = [adapter_name(i) for i in range(len(recipes))]
    results = [AdapterResult(Path(r.training.output_dir), n) for r, n in zip(recipes, names, strict=True)]
    streams = [
        batches(
            ld.data,
            r.training.per_device_train_batch_size,
            ld.pad_id,
            r.data.shuffle,
            r.training.seed,
            r.data.packing,
            r.data.max_seq_len,
        )
        for r, ld in zip(recipes, loaded, strict=True)
    ]
    trainer = StreamedTrainer(recipes[0].model.path, store, engine, safe_point=stop.check)
    try:
        for recipe, result in zip(recipes, results, strict=True):
            write_text_atomically(result.output_dir / RECIPE_FILE, recipe.to_yaml())
        while any(res.steps < ld.steps for res, ld in zip(results, loaded, strict=True)):
            groups, tokens = {}, {}
            for recipe, res, ld, stream in zip(recipes, results, loaded, streams, strict=True):
                if res.steps < ld.steps:
                    micro = [next(stream) for _ in range(recipe.training.gradient_accumulation_steps)]
                    groups[res.name] = micro
                    tokens[res.name] = sum(int(mb["num_tokens"]) for mb in micro)
            began = time.perf_counter()
            out = trainer.step_adapters(groups)
            seconds = time.perf_counter() - began
            report = trainer.last_report
            done[0] += 1
            for recipe, res, ld in zip(recipes, results, loaded, strict=True):
                if res.name not in out:
                    continue
                loss, norm, lr = out[res.name]
                res.steps += 1
                res.losses.append(loss)
                t = recipe.training
                record = {
                    "step": res.steps,
                    "epoch": round(res.steps * t.gradient_accumulation_steps / ld.per_epoch, 4),
                    "loss": loss,
                    "grad_norm": norm,
                    "learning_rate": lr,
                    "num_tokens": tokens[res.name],
                    "tokens_per_second": round(sum(tokens.values()) / seconds, 3),
                    "bytes_moved": dict(report.bytes_moved) if report is not None else {},
                    "adapters_in_step": len(out),
                }
                res.last = record
                if res.steps % t.logging_steps == 0 or res.steps == ld.steps:
                    with open(res.output_dir / "trainer_log.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
            stop.check()
            if progress:
                losses = " ".join(f"{n}={v[0]:.4f}" for n, v in out.items())
                print(f"step {done[0]}: {losses}", flush=True)
        for res, ld in zip(results, loaded, strict=True):
            trainer.adapters.save(res.output_dir, res.name)
            ld.tokenizer.save_pretrained(str(res.output_dir))
    finally:
        trainer.close()
    if progress:
        print(format_table(results), flush=True)
    return results


def format_table(results: list[AdapterResult]) -> str:
    """Each adapter's steps, final loss and output directory, a row each."""
    rows = [("adapter", "steps", "final loss", "output_dir")]
    rows += [
        (r.name, str(r.steps), f"{r.losses[-1]:.4f}" if r.losses else "-", str(r.output_dir)) for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3] for row in rows
    )


__all__ = ["AdapterResult", "format_table", "train_several"]
