"""Several recipes trained over one base in one run (``tiertune train a.yaml b.yaml``, ``sweep:``:
``config.sweep``): one ``StreamedTrainer`` whose base streams once a step for every recipe's LoRA adapter
(``engine.several``), each adapter with its own objective (SFT or a preference objective), data, steps, log,
checkpoints and model in its own run directory; launched as several processes, each rank trains its rows of
every adapter's global batch.

Before anything is loaded, a step of all the adapters is replayed on a ledger (``estimates.adapters``): where they
do not fit, the run is refused naming the most that do. Each run directory is locked, decided and prepared as a
run's (``rundir.RunDirectory``): a recipe with
``training.resume_from_checkpoint`` resumes its adapter from its own checkpoint, whichever of the others resume
or start; one whose directory cannot be used (a damaged checkpoint named, a finished run, another run's
directory) is left out with its message and the others train (``AdapterResult.error``). Each adapter's
``trainer_log.jsonl`` has a run's records (``loss``, ``grad_norm``, ``learning_rate``, ``epoch``, its objective's
metrics) with the shared stream's ``bytes_moved`` and peaks; its ``checkpoint-<step>/`` every ``save_steps`` of
its own steps and at its last, in a run's format (the adapter in PEFT format, ``adapter_optimizer.pt``, its
random generator ``adapter_rng.pt``, the trainer state with the data's position), written at once: an adapter's
state is small and in memory (``checkpoint.save_in_place``). An adapter whose steps are done takes no part in
later steps, nor one whose loss or gradient norm is not finite (its run stops there, as a run of one does: nothing
saved or exported after its last good step; the others go on, and the run ends with its message). SIGINT or
SIGTERM stops the run at its next safe point (``Interrupted``). An adapter whose recipe evaluates
(``training.eval_strategy: steps``) gets its held-out loss in a pass of the base with its adapter alone, and stops
early on it alone (``finetune.evaluation``). A distillation's adapter (``objective.type: distill`` with a cached
``top_k``) has its teacher's figures of its data and held-out set made before the base is loaded
(``finetune.teacher``: each pass holds the budgets alone; recipes of the same teacher, settings and data read one
cache); its micro-batches carry them, and its stacks of the head are its own. Not yet: the teacher beside the
student (``top_k: 0``) and GRPO."""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from tiertune.config.plan import resolve
from tiertune.config.recipe import Recipe
from tiertune.config.sweep import shared_base, shared_engine
from tiertune.distributed.world import World
from tiertune.engine import several
from tiertune.errors import ConfigError, IntegrityError, Interrupted, Signalled
from tiertune.files import write_text_atomically
from tiertune.finetune.checkpoint import (
    PREFIX,
    RECIPE_FILE,
    STATE_FILE,
    latest_checkpoint,
    read_part,
    read_state,
    save_in_place,
)
from tiertune.finetune.data import batches
from tiertune.finetune.evaluation import EarlyStopping, best_checkpoint, due, eval_batches, evaluate
from tiertune.finetune.rundir import LAUNCH_FILE, LOG_NAME, Decision, RunDirectory, launch_record
from tiertune.finetune.signals import stop_on_signals
from tiertune.loading.hub import model_directory
from tiertune.methods.lora import adapter_name

log = logging.getLogger("tiertune.train")

RNG_FILE = "adapter_rng.pt"  # an adapter's random generator (its micro-batches' streams) in its checkpoint


@dataclass
class AdapterResult:
    """One recipe's adapter of a run over one base: its directory, name in the run, steps done (a resumed one's
    before this run included), the losses of this run's steps, its last record, and the message that left it
    out (None: it trained)."""

    output_dir: Path
    name: str = ""
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    resumed_from: Path | None = None
    eval_loss: float | None = None  # its last evaluation's (``training.eval_strategy: steps``)
    stopped_early: int | None = None  # the step after which early stopping ended it
    best_checkpoint: Path | None = None  # exported in place of its last step (``load_best_model_at_end``)
    teacher_pass: dict[str, Any] | None = None  # a distillation's teacher pass (``TeacherPass.record``)


@dataclass
class _Adapter:
    """An adapter training in the run: its recipe, data, result, log so far and data stream."""

    recipe: Recipe
    loaded: Any
    result: AdapterResult
    decision: Decision
    history: list[dict] = field(default_factory=list)
    stream: Any = None
    stopped: bool = False  # its loss or gradient norm was not finite: it takes no part in later steps
    eval_passes: list = field(default_factory=list)  # its held-out set (``finetune.evaluation``)
    eval_teacher: Any = None  # a distillation's: the held-out batches with their teacher's figures
    early: EarlyStopping | None = None
    kept: tuple[Path, float] | None = None  # its best checkpoint and eval_loss (``load_best_model_at_end``)


def train_several(recipes: list[Recipe], progress: bool = True) -> list[AdapterResult]:
    """Train each of ``recipes`` (two or more; ``config.sweep.shared_base`` holds for them) as a LoRA adapter over
    their one base, the base streamed once a step for all of them; export each adapter into its directory.
    A recipe whose run directory cannot be used is left out with its message (``AdapterResult.error``);
    ConfigError when none can train. Prints a table of each adapter's final loss and directory when
    ``progress``. Launched as several processes (``torchrun``), every rank trains its share of each adapter's
    global batch (the adapters replicated, their gradients summed, the base sharded as a run of one's); rank
    0 decides the directories and writes the logs, checkpoints and adapters."""
    from tiertune.finetune.ranks import decided_by_main, join
    from tiertune.finetune.train import admit, load_run

    recipes = [r.with_absolute_paths() for r in recipes]
    shared_base(recipes)
    world = World.from_env()
    for recipe in recipes:
        recipe.model.path = model_directory(recipe.model.path)
        if recipe.objective.distills:
            recipe.objective.teacher.path = model_directory(recipe.objective.teacher.path)
        _refuse(recipe)
    runs = [resolve(r, world) for r in recipes]
    _admit(runs, world)
    admit(runs[0])
    join(world)  # several processes: the process group, this rank's GPU and threads
    loaded = [load_run(r, world.size) for r in recipes]
    results = [AdapterResult(Path(r.training.output_dir)) for r in recipes]
    with stop_on_signals() as stop, ExitStack() as held:

        def settle() -> list[Decision | str]:  # rank 0's: each directory locked, decided, prepared
            out: list[Decision | str] = []
            for recipe, ld in zip(recipes, loaded, strict=True):
                try:
                    directory = held.enter_context(RunDirectory(recipe.training.output_dir, world.size))
                    decision = directory.decide(recipe, ld.steps)
                except (ConfigError, IntegrityError) as exc:  # this adapter's alone: the others train
                    log.error("%s is left out of the run: %s", recipe.training.output_dir, exc)
                    out.append(str(exc))
                    continue
                directory.prepare(decision)
                out.append(decision)
            return out

        adapters: list[_Adapter] = []
        for recipe, ld, result, decided in zip(
            recipes, loaded, results, decided_by_main(world, settle), strict=True
        ):
            if isinstance(decided, str):
                result.error = decided
                if progress and world.is_main:
                    print(f"left out {recipe.training.output_dir}: {decided}", flush=True)
                continue
            result.steps, result.resumed_from = decided.step, decided.resume
            adapters.append(_Adapter(recipe, ld, result, decided))
        if not adapters:
            raise ConfigError(
                "no recipe of the run can train: " + "; ".join(f"{r.output_dir}: {r.error}" for r in results)
            )
        chosen = [runs[i] for i, r in enumerate(results) if r.error is None]
        engine = shared_engine(chosen, [a.loaded.steps for a in adapters])
        done = [0]  # the shared steps completed
        try:
            with stop.at_safe_points():
                _train(adapters, chosen[0].store, engine, world, stop, progress and world.is_main, done)
        except Signalled as exc:  # the trainer closed, the directories unlocked: said as a run's stop
            first = adapters[0].result
            where = latest_checkpoint(first.output_dir)
            raise Interrupted(exc.signum, done[0], where, first.output_dir / RECIPE_FILE) from None
    if progress and world.is_main:
        print(format_table(results), flush=True)
    return results


def _admit(runs: list, world: World) -> None:
    """ConfigError, naming the most adapters that fit, where a step of all the runs' adapters does not fit the
    first's budgets or the compute device (``config.several``: their step on a ledger). A launch of several
    processes is checked as a run of one is: each rank's plan (``admit``)."""
    from tiertune.config.several import fitting

    if world.size > 1:
        return
    device = runs[0].store.device
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    why = fitting(runs, memory).refusal()
    if why:
        raise ConfigError(why)


def _refuse(recipe: Recipe) -> None:
    """ConfigError for what several recipes over one base do not run yet."""
    kind = recipe.objective.type
    if not (kind in ("sft", "distill") or recipe.objective.paired):
        raise ConfigError(
            f"objective.type is {kind}: several adapters train with sft, dpo, simpo, orpo, kto or distill (recipe "
            f"of {recipe.training.output_dir}); train that recipe alone"
        )
    if recipe.objective.beside:
        raise ConfigError(
            f"objective.top_k is 0 in {recipe.training.output_dir}'s recipe: the teacher beside the student trains "
            "alone in this release; set objective.top_k (64: its figures cached before the run) or train it alone"
        )


def _train(
    adapters: list[_Adapter],
    store: Any,
    engine: Any,
    world: World,
    stop: Any,
    progress: bool,
    done: list[int],
) -> None:
    from tiertune.engine import StreamedTrainer
    from tiertune.finetune.ranks import rows_of
    from tiertune.finetune.train import batches_done

    for k, a in enumerate(adapters):
        a.result.name = adapter_name(k)
        r, ld = a.recipe, a.loaded
        a.stream = rows_of(  # the global batches (per-device x ranks), and this rank's rows of each
            world,
            batches(
                ld.data,
                r.training.per_device_train_batch_size * world.size,
                ld.pad_id,
                r.data.shuffle,
                r.training.seed,
                r.data.packing,
                r.data.max_seq_len,
            ),
        )
    path = adapters[0].recipe.model.path
    for a in adapters:  # a distillation's teacher figures first: each teacher pass holds the budgets alone
        if a.recipe.objective.distills:
            _teacher_figures(a, world, stop)
    trainer = StreamedTrainer(path, store, engine, safe_point=stop.check, world=world)
    try:
        for a in adapters:
            out, rows = a.result.output_dir, a.recipe.training.per_device_train_batch_size * world.size
            if a.decision.resume is not None:
                state = _resume(trainer, a.result.name, a.decision.resume)
                a.history = [r for r in state["log_history"] if int(r.get("step", 0)) <= a.decision.step]
                for _ in range(batches_done(state["tiertune"], rows)):  # the data's position
                    next(a.stream)
            if a.loaded.eval_data is not None:
                a.eval_passes = eval_batches(a.loaded.eval_data, a.recipe, a.loaded.pad_id)
            a.early = EarlyStopping.of(a.recipe, a.history)  # a resumed adapter counts from its log
            if a.recipe.training.load_best_model_at_end:
                a.kept = best_checkpoint(a.history, out, *a.recipe.best_metric)
            if world.is_main:
                write_text_atomically(out / RECIPE_FILE, a.recipe.to_yaml())
                write_text_atomically(out / LAUNCH_FILE, launch_record(world, rows))
                write_text_atomically(out / LOG_NAME, "".join(json.dumps(r) + "\n" for r in a.history))
            if progress:
                for note in a.decision.notes:
                    print(f"{a.result.name} ({out}): {note}", flush=True)
        for a in adapters:  # the Trainer's eval_on_start: each adapter before its first step
            if a.recipe.training.eval_on_start and a.result.steps == 0:
                _evaluate(trainer, a, {"epoch": 0.0, "step": 0}, world)
        while True:
            going = [
                a
                for a in adapters
                if not a.stopped and not a.result.stopped_early and a.result.steps < a.loaded.steps
            ]
            if not going:
                break
            groups = {
                a.result.name: [next(a.stream) for _ in range(a.recipe.training.gradient_accumulation_steps)]
                for a in going
            }
            tokens = {name: sum(int(mb["num_tokens"]) for mb in micro) for name, micro in groups.items()}
            began = time.perf_counter()
            out = trainer.step_adapters(groups)
            seconds = time.perf_counter() - began
            done[0] += 1
            for a in going:
                _record(trainer, a, out[a.result.name], tokens, seconds, len(out), world)
            stop.check()
            if progress:
                losses = " ".join(f"{n}={v.loss:.4f}" for n, v in out.items())
                print(f"step {done[0]}: {losses}", flush=True)
        for a in adapters if world.is_main else ():  # (replicated: every rank's adapters are rank 0's)
            if a.stopped:  # as a run of one: nothing exported after its last good step
                continue
            res = a.result
            best = (
                best_checkpoint(a.history, res.output_dir, *a.recipe.best_metric)
                if a.recipe.training.load_best_model_at_end
                else None
            )
            if best is not None and best[0].name != f"{PREFIX}{res.steps}":  # the Trainer's best model
                log.info("%s: exporting its best checkpoint %s (eval_loss %.6g)", res.name, best[0], best[1])
                _resume(trainer, res.name, best[0])
                res.best_checkpoint = best[0]
            trainer.adapters.save(res.output_dir, res.name)
            a.loaded.tokenizer.save_pretrained(str(res.output_dir))
            final = {"global_step": res.steps, "max_steps": a.loaded.steps, "log_history": a.history}
            if a.early is not None and a.early.best is not None:  # the Trainer's names
                final["best_metric"] = a.early.best
                final["best_model_checkpoint"] = str(best[0]) if best is not None else None
            if res.stopped_early:
                final["stopped_early"] = True
            write_text_atomically(res.output_dir / STATE_FILE, json.dumps(final, indent=2))
    finally:
        trainer.close()


def _record(
    trainer: Any,
    a: _Adapter,
    step: several.AdapterStep,
    tokens: dict,
    seconds: float,
    sharing: int,
    world: World,
) -> None:
    """Adapter ``a``'s step done: its record logged (every ``logging_steps`` and its last), its checkpoint
    written (every ``save_steps`` and its last); by rank 0 of several."""
    res, t = a.result, a.recipe.training
    if step.error is not None:
        a.stopped = True
        last = latest_checkpoint(res.output_dir)
        res.error = (
            f"stopped at its step {res.steps + 1}: {step.error} (nothing saved or exported after step "
            f"{res.steps}; " + (f"its newest checkpoint is {last})" if last else "no checkpoint was written)")
        )
        log.error("%s: %s", res.output_dir, res.error)
        return
    res.steps += 1
    res.losses.append(step.loss)
    report = trainer.last_report
    record = report.record(
        res.steps,
        round(res.steps * t.gradient_accumulation_steps / a.loaded.per_epoch, 4),
        round(sum(tokens.values()) / seconds, 3),
    )
    record.update(
        {
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "learning_rate": step.learning_rate,
            "num_tokens": tokens[res.name],
            "adapters_in_step": sharing,
            **step.metrics,
        }
    )
    res.last = record
    last = res.steps == a.loaded.steps
    logged = [record] if res.steps % t.logging_steps == 0 or last else []
    a.history.extend(logged)
    if world.is_main and logged:
        with open(res.output_dir / LOG_NAME, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in logged))
    held_out = None
    # a pass of the base with its adapter alone
    if due(a.recipe, res.steps, a.loaded.per_epoch, a.loaded.steps):
        held_out = _evaluate(trainer, a, {"epoch": record["epoch"], "step": res.steps}, world)
        last = last or res.stopped_early is not None
    saving = t.save_steps > 0 and (res.steps % t.save_steps == 0 or last)
    better = (  # by the adapter's metric_for_best_model and greater_is_better, as a run of one
        held_out is not None
        and a.early is not None
        and a.early.better(held_out, a.kept[1] if a.kept is not None else None)
    )
    if saving and better and t.load_best_model_at_end:
        a.kept = (res.output_dir / f"{PREFIX}{res.steps}", held_out)  # save_total_limit keeps it
    if world.is_main and saving:
        _save(trainer, a, step.grad_norm, world.size)


def _teacher_figures(a: _Adapter, world: World, stop: Any) -> None:
    """Adapter ``a``'s teacher figures of its data and held-out set (``finetune.teacher.carried_figures``, read
    from their caches where another adapter's pass or an earlier run made them): its stream's batches carry them,
    and its evaluations' batches."""
    from tiertune.finetune.teacher import carried_figures

    a.stream, a.eval_teacher, ran = carried_figures(a.recipe, a.loaded, a.stream, world, stop.check)
    a.result.teacher_pass = ran.record()


def _evaluate(trainer: Any, a: _Adapter, at: dict[str, Any], world: World) -> float:
    """Adapter ``a``'s held-out loss now (``at``: the record's epoch and step), in a pass of the base with it
    alone: logged (by rank 0 of several) and counted for its early stopping (which may end it: not at step 0,
    the Trainer's eval_on_start); returns the loss."""
    res = a.result
    trainer.adapters.activate(res.name)
    evaluated = evaluate(trainer, a.eval_passes, a.recipe.objective, teacher=a.eval_teacher) | at
    a.history.append(evaluated)
    if world.is_main:
        with open(res.output_dir / LOG_NAME, "a") as f:
            f.write(json.dumps(evaluated) + "\n")
    res.eval_loss = evaluated["eval_loss"]
    assert a.early is not None
    if a.early.see(res.eval_loss) and at["step"] > 0:
        res.stopped_early = res.steps
        log.info(
            "%s: stopped early after its step %d (training.early_stopping_patience)", res.name, res.steps
        )
    return res.eval_loss


def _save(trainer: Any, a: _Adapter, grad_norm: float, ranks: int) -> Path:
    """Adapter ``a``'s checkpoint at its step, in a run's format (a run of it alone resumes from it too)."""
    res, t = a.result, a.recipe.training
    state = {
        "global_step": res.steps,
        "max_steps": a.loaded.steps,
        "epoch": res.last.get("epoch"),
        "log_history": list(a.history),
        "tiertune": {
            "micro_batches": res.steps * t.gradient_accumulation_steps,
            "rows_per_micro_batch": t.per_device_train_batch_size * ranks,
            "step_count": res.steps,
            "last_grad_norm": grad_norm,
            "optimizer_counts": {},
            "weights_behind": False,
        },
    }

    def write(directory: Path) -> None:
        taken = several.adapter_state(trainer, res.name)
        trainer.adapters.save(directory, res.name)
        torch.save(taken["training"], directory / "adapter_optimizer.pt")
        torch.save(taken["rng"], directory / RNG_FILE)

    keep = a.kept[0] if a.kept is not None else None
    return save_in_place(res.output_dir, state, write, a.recipe.to_yaml(), t.save_total_limit, keep)


def _resume(trainer: Any, name: str, path: Path) -> dict:
    """Adapter ``name`` put back from its checkpoint ``path`` (verified by the run directory's decision);
    returns the checkpoint's trainer state. A checkpoint of a run of one adapter has no generator of its own:
    the adapter's starts from its seed."""
    state = read_state(path / STATE_FILE)
    load = partial(torch.load, weights_only=False)
    rng = path / RNG_FILE
    several.load_adapter_state(
        trainer,
        name,
        {
            "training": read_part(path / "adapter_optimizer.pt", load),
            "steps": int(state["tiertune"].get("step_count", state["global_step"])),
            "rng": read_part(rng, load) if rng.is_file() else trainer.adapter_rng[name].get_state(),
        },
    )
    return state


def format_table(results: list[AdapterResult]) -> str:
    """Each adapter's steps, final loss, last eval_loss (where they evaluate) and output directory, a row each
    (one left out: its message)."""
    evaluated = any(r.eval_loss is not None for r in results)
    rows = [("adapter", "steps", "final loss", *(("eval_loss",) if evaluated else ()), "output_dir")]
    for r in results:
        final = f"{r.losses[-1]:.4f}" if r.losses else "-"
        steps = f"{r.steps} (stopped early)" if r.stopped_early else str(r.steps)
        held_out = (f"{r.eval_loss:.4f}" if r.eval_loss is not None else "-",) if evaluated else ()
        rows.append(
            (r.name or "-", steps, final if r.error is None else "left out", *held_out, str(r.output_dir))
        )
    n = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(n)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:n], widths, strict=True)) + "  " + row[n] for row in rows
    ]
    lines += [f"{r.output_dir}: {r.error}" for r in results if r.error is not None]
    return "\n".join(lines)


__all__ = ["AdapterResult", "format_table", "train_several"]
