"""``train()``: a recipe in, a fine-tuned model out. The loop is here, in one place.

The run directory gets ``trainer_log.jsonl`` (one JSON object per logged step: step, loss, learning_rate,
grad_norm, tokens_per_second, peak bytes per tier; for an MoE whose loss includes the router's auxiliary
loss, ``router_aux_loss``: that part of ``loss``; of several ranks, ``wire_bytes``: what rank 0 sent in the
step, by collective) and, at the end, the model in Hugging Face safetensors
format (config, shards, index, tokenizer), written shard by shard from the chunk store and moved into
place only once complete; for LoRA, the adapter in PEFT format (``adapter_config.json``,
``adapter_model.safetensors``) and the tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiertune.config.plan import BESIDE_SHARE, RunPlan, resolve
from tiertune.config.recipe import Recipe, load_recipe
from tiertune.distributed.world import World
from tiertune.engine import StreamedTrainer
from tiertune.errors import (
    BudgetError,
    ConfigError,
    DataError,
    DiskFullError,
    Interrupted,
    ModelError,
    NonFiniteError,
    RankError,
    Signalled,
)
from tiertune.files import write_text_atomically
from tiertune.finetune.checkpoint import (
    PREFIX as CHECKPOINT_PREFIX,
)
from tiertune.finetune.checkpoint import (
    RECIPE_FILE,
    STATE_FILE,
    STOP_GRACE_S,
    CheckpointWriter,
    checkpoint_bytes,
    checkpoint_step,
    is_disk_full,
    latest_checkpoint,
    load_checkpoint,
    load_rollouts,
    partials,
    recover,
)
from tiertune.finetune.data import batches, load_data, pad_id_of
from tiertune.finetune.evaluation import EarlyStopping, best_checkpoint, due, eval_batches, evaluate
from tiertune.finetune.grpo import METRICS_KEY as ROLLOUT_METRICS
from tiertune.finetune.grpo import SAMPLES_FILE, Rollouts
from tiertune.finetune.grpo_evaluation import evaluate_rollouts
from tiertune.finetune.hf_model import write_hf
from tiertune.finetune.ranks import decided_by_main, join, launch_notes, rows_of, sweep_other_ranks
from tiertune.finetune.reference import ReferenceBeside, reference_logps, with_reference
from tiertune.finetune.reporting import Reporters
from tiertune.finetune.rundir import LAUNCH_FILE, LOG_NAME, Decision, RunDirectory, launch_record
from tiertune.finetune.served import ServedSampler
from tiertune.finetune.signals import StopOnSignals, stop_on_signals
from tiertune.finetune.teacher import (
    TeacherBeside,
    beside_teacher,
    carried_figures,
    check_quantization,
    check_tokenizers,
)
from tiertune.kernels.patch import describe
from tiertune.loading.hub import model_directory
from tiertune.loading.model import vocabulary_size
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import BUDGET_SETTING, Tier
from tiertune.units import format_size

log = logging.getLogger("tiertune.train")


@dataclass
class TrainResult:
    """What a run did: the losses of the steps it ran (from ``first_step``: a resumed run starts after its
    checkpoint), where its log and model are, how long it took."""

    output_dir: Path
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    first_step: int = 1
    # optimizer steps by how they ran: speculative (during backward, confirmed), redone (during backward,
    # then again after it: the step was clipped), after_backward
    optimizer_counts: dict[str, int] = field(default_factory=dict)
    # a distillation's teacher pass (``finetune.teacher.TeacherPass.record``; None: no teacher)
    teacher_pass: dict[str, Any] | None = None
    # the step after which early stopping ended the run (``finetune.evaluation``); None: it ran its steps
    stopped_early: int | None = None
    # the checkpoint exported in place of the last step's (``training.load_best_model_at_end``); None: the last
    best_checkpoint: Path | None = None
    # what its evaluations are compared by (``Recipe.best_metric``: the record's key, whether greater is better)
    best_metric: tuple[str, bool] = ("eval_loss", False)

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """The run's evaluation records (``eval_loss``, ...), read from its log."""
        if not self.log_path.is_file():
            return []
        records = (json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip())
        return [r for r in records if "eval_loss" in r]

    @property
    def log_path(self) -> Path:
        return self.output_dir / LOG_NAME


def steps_of(recipe: Recipe) -> int:
    """The optimizer steps ``recipe`` makes: ``training.max_steps``, or its epochs over the data as the run
    counts them (tokenized with the model's tokenizer; a DataError or ModelError when either is missing)."""
    if recipe.training.max_steps > 0:
        return recipe.training.max_steps
    return load_run(recipe, World.from_env().size).steps


def scored_rows(recipe: Recipe) -> tuple[tuple[int, int], tuple[int, int]]:
    """The data's rows and scored tokens (labels after the first that count) as the run tokenizes them, and the
    held-out set's ((0, 0) where the run evaluates none)."""
    from tiertune.finetune.teacher import scored_counts

    loaded = load_run(recipe, 1)
    counts = scored_counts(loaded.data)
    held = scored_counts(loaded.eval_data) if loaded.eval_data is not None else []
    return (len(counts), sum(counts)), (len(held), sum(held))


def first_micro_batch(recipe: Recipe) -> dict[str, torch.Tensor]:
    """The run's first micro-batch as the data pipeline hands it to the engine (its rows packed as the recipe
    says: a packed row's documents shape the attention's cost); a DataError or ModelError when the data or the
    model's tokenizer is missing. Not for a preference objective (its micro-batches are pairs)."""
    t, d = recipe.training, recipe.data
    loaded = load_run(recipe, 1)
    stream = batches(
        loaded.data, t.per_device_train_batch_size, loaded.pad_id, d.shuffle, t.seed, d.packing, d.max_seq_len
    )
    return next(stream)


def train(
    recipe: Recipe | str | os.PathLike[str], overrides: tuple[str, ...] = (), progress: bool = True
) -> TrainResult:
    """Run a recipe (a ``Recipe`` or the path of a YAML file) to the end and export the model.

    Relative paths are relative to the current directory; the run directory records them absolute. The run
    directory is locked for the run and checked first (``rundir.RunDirectory``): a directory holding another
    run is refused unless the run resumes or ``training.overwrite_output_dir`` is set, a resumed checkpoint is
    verified against its checksums. ``progress`` prints the banner and a progress bar.

    Raises ConfigError, DataError, ModelError, BudgetError, IntegrityError or DiskFullError with a message that
    says what to change; NonFiniteError when a step's loss or gradient norm is not finite (nothing is saved or
    exported after the last good step); ``Interrupted`` (a KeyboardInterrupt) after SIGINT or SIGTERM, once
    the checkpoint being written is completed within ``STOP_GRACE_S`` or dropped (the newest complete one
    stays) and the offload files are removed.
    """
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    recipe = recipe.with_absolute_paths()
    recipe.model.path = model_directory(recipe.model.path)  # a model id: its snapshot in the hub's cache
    if recipe.objective.distills:
        recipe.objective.teacher.path = model_directory(recipe.objective.teacher.path)
    world = World.from_env()
    run = resolve(recipe, world)
    admit(run)  # every rank: all refuse alike, before the process group
    join(world)  # several processes: the process group, this rank's GPU and threads
    run_dir = RunDirectory(recipe.training.output_dir, world.size)
    with stop_on_signals() as stop:
        try:
            # a data or tokenizer error before the run directory is made
            loaded = load_run(recipe, world.size)
            stop.check()  # a signal during loading that landed where it could not be raised
            # the run directory is rank 0's: it locks, checks and prepares it for all
            with run_dir if world.is_main else contextlib.nullcontext():
                if world.is_main:
                    recover(run_dir.path)
                with stop.at_safe_points():  # from here the run holds chunks and locks
                    return _run(run, run_dir, loaded, progress and world.is_main, stop)
        except Signalled as exc:  # before the first step: what was set up has been unwound
            newest = latest_checkpoint(run_dir.path)
            step = checkpoint_step(newest) if newest else 0
            raise Interrupted(exc.signum, step, newest, run_dir.path / RECIPE_FILE) from None


def admit(run: RunPlan) -> None:
    """Check the run's memory plan (``engine.memory``) against its budgets before anything is loaded: the
    homes and the slots the store reserves for the chunks in use at once. Raises BudgetError naming the
    smallest budgets that work. ``tiertune estimate`` reports the same plan. One rank of several plans its own
    shards (the rank's budgets); the plan is the same on every rank, so all refuse alike."""
    store, engine, memory = run.store, run.engine, run.memory
    budgets = {Tier.DEVICE: store.device_budget, Tier.HOST: store.host_budget}
    local = run.world.local_size
    sharing = {Tier.HOST: local, Tier.DEVICE: local if store.device.type == "cpu" else 1}
    if store.disk_path is None:
        lower = "offload.disk_path, to place state on disk"
    else:
        homes = (("offload.params", engine.params), ("offload.optimizer_states", engine.optimizer_states))
        lower = " and ".join(f"{key}: disk" for key, home in homes if home != "disk")
    why = memory.refusal(budgets, lower, sharing, BESIDE_SHARE if run.recipe.beside else 1)
    if why:
        tier, needed = next(iter(memory.short(budgets).items()))
        raise BudgetError(
            tier.value,
            needed,
            budgets[tier],
            BUDGET_SETTING[tier],
            message=f"the run does not fit its budgets, checked before loading the model: {why}",
        )


@dataclass
class Loaded:
    """The tokenized data of a run and the steps it makes."""

    tokenizer: Any
    data: Any
    pad_id: int
    per_epoch: int
    steps: int
    eval_data: Any = None  # the held-out set (data.eval_path), when the run evaluates


_LOADED: dict[Any, Loaded] | None = None
"""``load_run``'s results while ``data_read_once`` is entered (None: nothing kept)."""


@contextlib.contextmanager
def data_read_once() -> Iterator[None]:
    """Within the block, ``load_run`` reads and tokenizes a recipe's data once for all its callers (``estimate``
    asks for the steps, the first micro-batch, the held-out set and a teacher's rows: each read the data again,
    a minute a few million rows); what it kept is dropped at the block's end. Nested blocks share the
    outermost's."""
    global _LOADED
    outermost = _LOADED is None
    if outermost:
        _LOADED = {}
    try:
        yield
    finally:
        if outermost:
            _LOADED = None


def _files_of(recipe: Recipe) -> tuple[Any, ...]:
    """What ``load_run``'s result depends on beside the recipe: its data files' sizes and modification times."""
    out: list[Any] = []
    for path in (recipe.data.path, recipe.data.eval_path):
        try:
            stat = os.stat(path) if path else None
        except OSError:
            stat = None
        out.append((path, stat.st_size, stat.st_mtime_ns) if stat is not None else (path, None, None))
    return tuple(out)


def load_run(recipe: Recipe, ranks: int) -> Loaded:
    """Tokenizer and data (no chunk store yet: a signal may stop this anywhere). Steps count global batches:
    per-device batch x the launch's ranks. Within ``data_read_once`` the same recipe's data is read once."""
    torch.manual_seed(recipe.training.seed)
    if _LOADED is None:
        return _load_run(recipe, ranks)
    key = (ranks, recipe.to_yaml(), _files_of(recipe))
    if key not in _LOADED:
        _LOADED[key] = _load_run(recipe, ranks)
    return _LOADED[key]


def _load_run(recipe: Recipe, ranks: int) -> Loaded:
    t, d = recipe.training, recipe.data
    tokenizer = tokenizer_of(recipe.model.path)
    o = recipe.objective
    # GRPO: a prompt leaves room for its completion
    longest = d.max_seq_len - o.max_completion_length if o.rollouts else d.max_seq_len
    data = load_data(
        d.path,
        tokenizer,
        d.format,
        longest,
        d.add_eos,
        d.skip_bad_rows,
        kl_block=t.per_device_train_batch_size,
    )
    _check_vocabulary(data, recipe.model.path)
    if recipe.objective.distills:  # before any weight is read
        check_tokenizers(recipe.model.path, recipe.objective.teacher.path)
        check_quantization(recipe.objective.teacher)
        vocab = vocabulary_size(recipe.model.path)
        if recipe.objective.top_k >= vocab:
            raise ConfigError(
                f"objective.top_k is {recipe.objective.top_k}, and the vocabulary has {vocab} tokens: keep fewer "
                f"than it (at most {vocab - 1})"
            )
    pad_id = pad_id_of(tokenizer)
    rows = math.ceil(data.tokens / d.max_seq_len) if d.packing else len(data)  # packing: about full rows
    if o.rollouts:  # GRPO: a prompt's rows are its completions, each generation trained num_iterations times
        rows *= o.num_generations * o.num_iterations
    per_epoch = math.ceil(rows / (t.per_device_train_batch_size * ranks))
    steps = (
        t.max_steps
        if t.max_steps > 0
        else max(1, math.ceil(t.num_train_epochs * per_epoch / t.gradient_accumulation_steps))
    )
    eval_data = None
    if recipe.evaluates:
        eval_data = load_data(
            d.eval_path,
            tokenizer,
            d.format,
            longest,
            d.add_eos,
            d.skip_bad_rows,
            kl_block=t.per_device_train_batch_size,  # KTO: each batch's KL sequences its own rows', as in training
        )
        _check_vocabulary(eval_data, recipe.model.path)
    return Loaded(tokenizer, data, pad_id, per_epoch, steps, eval_data)


def _run(
    run: RunPlan, run_dir: RunDirectory, loaded: Loaded, progress: bool, stop: StopOnSignals
) -> TrainResult:
    """The run in its directory: decide, prepare, build the trainer, train, checkpoint, export. Called with
    signals stopping it at safe points only. Of several ranks, rank 0 decides, prepares, logs and writes the
    run's files; every rank trains and exports (each chunk gathered in turn)."""
    recipe, world = run.recipe, run.world
    t, d = recipe.training, recipe.data
    out = run_dir.path
    data, tokenizer, steps, per_epoch = loaded.data, loaded.tokenizer, loaded.steps, loaded.per_epoch
    recipe_path = out / RECIPE_FILE

    def settle() -> Decision:
        decision = run_dir.decide(recipe, steps)  # every check before anything in the directory changes
        removed = run_dir.prepare(decision)
        for path in removed:
            log.debug("removed %s", path)
        if decision.clear:
            log.info("started over in %s: the previous run's checkpoints, log and model were removed", out)
        return decision

    decision = decided_by_main(world, settle)
    result = TrainResult(out)
    # the global batches (of ``rows``: per-device x ranks), and this rank's rows of each
    rows = t.per_device_train_batch_size * world.size
    stream = rows_of(world, batches(data, rows, loaded.pad_id, d.shuffle, t.seed, d.packing, d.max_seq_len))
    history: list[dict] = []
    first = decision.step
    stop.check()
    engine = dataclasses.replace(run.engine, max_steps=steps)  # the learning rate's schedule runs over them
    beside: TeacherBeside | None = None
    # a distillation's held-out batches with their teacher's figures (``finetune.evaluation``)
    eval_teacher: Callable[[Sequence[dict]], list[dict]] | None = None
    if recipe.objective.beside:  # the teacher beside the student, each within its share of the budgets
        beside = TeacherBeside(recipe, vocabulary_size(recipe.model.path), world, stop.check)
        eval_teacher = beside.scored
    elif recipe.objective.distills:  # the teacher's figures first: its pass holds the budgets alone
        stream, eval_teacher, teacher_pass = carried_figures(recipe, loaded, stream, world, stop.check)
        result.teacher_pass = teacher_pass.record()
        stop.check()
    rollouts: Rollouts | None = None
    eval_reference = None
    try:
        trainer = StreamedTrainer(recipe.model.path, run.store, engine, safe_point=stop.check, world=world)
    except BaseException:
        if beside is not None:
            beside.close()
        raise
    try:
        # the initial weights' figures of the data, first (GRPO's completions are scored as they come)
        if recipe.objective.reference and trainer.adapters is None and not recipe.reference_beside:
            reference = reference_logps(trainer, data, recipe, loaded.pad_id, write=world.is_main)
            stream = with_reference(stream, reference)
            if loaded.eval_data is not None:  # the held-out pairs' too, by the same initial weights
                eval_reference = reference_logps(
                    trainer, loaded.eval_data, recipe, loaded.pad_id, write=world.is_main
                )
        if decision.resume is not None:
            state = load_checkpoint(trainer, decision.resume)
            # the steps up to the checkpoint's (one written by an older tiertune may hold later ones)
            history = [r for r in state["log_history"] if int(r.get("step", 0)) <= first]
            skip = batches_done(state["tiertune"], rows)  # the data position: the same batches follow
            for _ in range(skip if not recipe.objective.rollouts else 0):
                next(stream)
        if beside is not None:  # scored a step at a time from here (none for the batches skipped)
            stream = beside_teacher(stream, beside, t.gradient_accumulation_steps)
        if recipe.objective.rollouts:  # GRPO: each step's micro-batches sampled by the model as it is then
            sampler = None
            served_by = recipe.objective.rollout_engine
            if served_by != "tiertune":  # or by a server the adapter is pushed to (llama.cpp, vLLM, SGLang)
                if world.size > 1:
                    raise ConfigError(
                        f"objective.rollout_engine: {served_by} runs in one process in this release; launch one "
                        "process or set rollout_engine: tiertune"
                    )
                model_dir = Path(recipe.model.path)
                sampler = ServedSampler(trainer, recipe, tokenizer, out, model_dir, stop.check)
            rollouts = Rollouts(
                trainer, recipe, data, tokenizer, loaded.pad_id, world, out / SAMPLES_FILE, sampler=sampler
            )
            if recipe.reference_beside:  # the KL term of a full fine-tune: the initial weights beside it
                rollouts.reference = ReferenceBeside.open(recipe, world, stop.check)
            kept = None if decision.resume is None else load_rollouts(decision.resume, world.rank, world.size)
            stream = (mb for step_batches in rollouts.steps(first, kept) for mb in step_batches)
        stop.check()
    except BaseException:
        if rollouts is not None:
            rollouts.close()
        trainer.close()
        if beside is not None:
            beside.close()
        raise
    if world.is_main and recipe.offload.disk_path:  # directories this launch does not use
        for path in sweep_other_ranks(recipe.offload.disk_path, world):
            log.debug("removed %s (a slot file of a launch on another number of processes)", path)
    if world.is_main:  # the run's files, once its model is loaded (a model that cannot be leaves none)
        write_text_atomically(recipe_path, recipe.to_yaml())
        write_text_atomically(out / LAUNCH_FILE, launch_record(world, rows))
        _rewrite_log(result.log_path, history)  # each step once: a resumed run runs the later ones again
        if rollouts is not None:
            rollouts.keep_samples(first)
    counted = dict(trainer.optimizer_counts)  # a resumed run's counters start at its checkpoint's
    eval_passes = (  # (GRPO's held-out prompts are sampled: finetune.grpo_evaluation)
        eval_batches(loaded.eval_data, recipe, loaded.pad_id)
        if loaded.eval_data is not None and rollouts is None
        else []
    )
    early = EarlyStopping.of(recipe, history)  # a resumed run counts from its log's evaluations
    metric, greater = result.best_metric = recipe.best_metric  # what early stopping and the best compare
    kept = best_checkpoint(history, out, metric, greater) if t.load_best_model_at_end else None
    notes = list(decision.notes) + launch_notes(world, dict(os.environ))
    if decision.resume is not None:
        notes.append(f"resumed from {decision.resume} at step {first} of {steps}")
    if result.teacher_pass is not None:
        notes.append(f"teacher pass: {json.dumps(result.teacher_pass)}")
    result.first_step = first + 1
    banner = _banner(recipe, trainer, run.store, steps, first, data)
    for line in (banner, *notes):  # printed below; in the log for a run without a console
        log.debug("%s", line)
    if progress:
        print("\n".join((banner, *notes)), flush=True)
    bar = _Progress(steps, first, t.logging_steps) if progress else None
    writer = CheckpointWriter(trainer, out, t.save_total_limit)
    writer.keep = kept[0] if kept is not None else None  # the best checkpoint outlives save_total_limit
    reporters = None
    start = time.perf_counter()
    done = first
    failure: BaseException | None = None
    try:
        if world.is_main:
            _check_room(trainer, out, t.save_steps > 0 and steps > first)
        reporters = Reporters(t.report_to if world.is_main else "none", out, recipe.to_dict(), first)
        with open(result.log_path if world.is_main else os.devnull, "a") as log_file:

            def logged(record: dict[str, Any]) -> dict[str, Any]:  # a step's or an evaluation's record
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                history.append(record)
                reporters.log(record)
                return record

            def evaluated_at(epoch: float, step: int) -> dict[str, Any]:  # the held-out set's loss, logged
                at = {"epoch": epoch, "step": step}
                if rollouts is not None:  # GRPO: the held-out prompts sampled and rewarded
                    record = evaluate_rollouts(rollouts, loaded.eval_data, step)
                else:
                    record = evaluate(trainer, eval_passes, recipe.objective, eval_reference, eval_teacher)
                return logged(record | at)

            if t.eval_on_start and first == 0:  # the Trainer's eval_on_start: the weights before any step
                early.see(evaluated_at(0.0, 0)[metric])
            for step in range(first, steps):
                began = time.perf_counter()
                micro = [next(stream) for _ in range(t.gradient_accumulation_steps)]
                # the teacher's pass, or GRPO's sampling
                scoring = (
                    time.perf_counter() - began if beside is not None or recipe.objective.rollouts else 0.0
                )
                tokens = sum(int(mb["num_tokens"]) for mb in micro)
                loss = trainer.step(micro)
                report = trainer.last_report
                done = step + 1
                result.losses.append(loss)
                record = report.record(
                    step + 1,
                    (step + 1) * t.gradient_accumulation_steps / per_epoch,
                    tokens / (report.seconds + scoring),
                )
                if beside is not None:
                    record["teacher_seconds"] = round(scoring, 4)
                elif recipe.objective.rollouts:
                    record["generation_seconds"] = round(scoring, 4)
                record.update(micro[0].get(ROLLOUT_METRICS, {}))  # GRPO: its generation's, TRL's names
                if rollouts is not None:  # a served policy's log-probabilities against the step's
                    record.update(rollouts.after_step(micro))
                if (step + 1) % t.logging_steps == 0 or step + 1 == steps:
                    logged(record)
                stopping, evaluated = False, None
                if due(recipe, step + 1, per_epoch, steps):  # the held-out set's loss (finetune.evaluation)
                    writer.wait()  # a checkpoint still being written holds chunks the pass's end puts back home
                    evaluated = evaluated_at(record["epoch"], step + 1)
                    stopping = early.see(evaluated[metric])
                writer.check()  # a checkpoint that failed in the background stops the run now
                stop.check()
                # a checkpoint every save_steps steps and at the last one (as the Hugging Face Trainer), so
                # that a finished run can be trained further
                last = step + 1 == steps or stopping
                saving = t.save_steps > 0 and ((step + 1) % t.save_steps == 0 or last)
                better = evaluated is not None and early.better(evaluated[metric], kept[1] if kept else None)
                if saving and better and t.load_best_model_at_end:  # this step's checkpoint is the best
                    kept = (out / f"{CHECKPOINT_PREFIX}{step + 1}", evaluated[metric])
                    writer.keep = kept[0]
                if saving:
                    trainer_state = {
                        "global_step": step + 1,
                        "max_steps": steps,
                        "epoch": record["epoch"],
                        "log_history": list(history),  # as of this step: the writer serialises it later
                        "tiertune": {
                            "micro_batches": (step + 1) * t.gradient_accumulation_steps,
                            "rows_per_micro_batch": rows,
                        },
                    }
                    rolled = rollouts.state(step + 1) if rollouts is not None else None  # GRPO's generation
                    writer.save(trainer_state, recipe.to_yaml(), rolled)  # written while the next steps run
                if bar is not None:
                    bar.update(step + 1, loss, record["tokens_per_second"], report.peak_bytes)
                if stopping:
                    result.stopped_early = step + 1
                    log.info(
                        "stopped early after step %d: %s did not beat its best (%.6g) by more than %g in %d "
                        "evaluations (training.early_stopping_patience)",
                        step + 1,
                        metric,
                        early.best,
                        early.threshold,
                        early.patience,
                    )
                    break
        writer.wait()
        stop.check()
        best = best_checkpoint(history, out, metric, greater) if t.load_best_model_at_end else None
        if best is not None and best[0].name != f"{CHECKPOINT_PREFIX}{done}":  # the Trainer's best model
            log.info("loading the best model from %s (%s %.6g) to export it", best[0], metric, best[1])
            load_checkpoint(trainer, best[0])
            result.best_checkpoint = best[0]
        _export(trainer, tokenizer, out, world.is_main)
        stop.check()
        if world.is_main:
            final = {"global_step": done, "max_steps": steps, "log_history": history}
            if early.best is not None:  # the Trainer's names
                final["best_metric"] = early.best
                final["best_model_checkpoint"] = str(best[0]) if best is not None else None
            if result.stopped_early:
                final["stopped_early"] = True
            write_text_atomically(out / STATE_FILE, json.dumps(final, indent=2))  # the run is finished
    except BaseException as exc:
        failure = exc
        raise
    finally:
        with stop.deferred():  # a second Ctrl-C or SIGTERM does not cut the clean-up short
            if bar is not None:
                bar.close()
            if reporters is not None:
                reporters.close()
            try:
                if isinstance(failure, RankError):  # the lost rank's part of a checkpoint will not come
                    writer.abandon()
                # a stop takes seconds: the checkpoint being written is completed if it can be within
                # STOP_GRACE_S, else dropped; another failure still completes it
                writer.wait(STOP_GRACE_S if isinstance(failure, KeyboardInterrupt) else None)
            except BaseException as exc:
                if failure is None:
                    raise
                log.error("the checkpoint being written failed too: %s", exc)
            finally:
                if rollouts is not None:
                    rollouts.close()
                trainer.close()
                if beside is not None:
                    beside.close()
                    result.teacher_pass = beside.stats.record()
                for path in partials(out) if world.is_main else ():
                    shutil.rmtree(path, ignore_errors=True)
        if failure is not None:
            _explain(failure, done, steps, out, recipe_path, stop.requested)
    result.steps = done  # the last step run: steps, or where early stopping ended the run
    result.seconds = time.perf_counter() - start
    result.optimizer_counts = {k: n - counted.get(k, 0) for k, n in trainer.optimizer_counts.items()}
    return result


def batches_done(counters: dict, rows: int) -> int:
    """The global micro-batches of ``rows`` rows a resumed run skips: those its checkpoint consumed, or, when
    it was written with micro-batches of another size (a recipe change the run allowed), as many as hold
    the rows it consumed."""
    done = int(counters["micro_batches"])
    then = int(counters.get("rows_per_micro_batch", rows))
    return done if then == rows else done * then // rows


def _explain(
    failure: BaseException, done: int, steps: int, out: Path, recipe_path: Path, pending: int | None = None
) -> None:
    """Turn a stop in the middle of a run into the error a user acts on: what happened, the step reached,
    the newest checkpoint and how to resume. ``pending``: a signal this process received and had not yet acted
    on (at its next safe point)."""
    newest = latest_checkpoint(out)
    if isinstance(failure, RankError) and pending is not None:
        # every rank got the launcher's SIGTERM: another stopped first and this one's collective failed before
        # its next safe point. That is the signal's stop, not a lost rank.
        raise Interrupted(pending, done, newest, recipe_path) from None
    if isinstance(failure, KeyboardInterrupt):
        signum = failure.signum if isinstance(failure, Signalled) else signal.SIGINT
        raise Interrupted(signum, done, newest, recipe_path) from None
    if isinstance(failure, NonFiniteError):
        where = (
            f"the newest checkpoint, {newest}, holds the last good state"
            if newest
            else "no checkpoint was written yet"
        )
        raise NonFiniteError(
            f"step {done + 1} of {steps}: {failure}; the run stopped and nothing was exported; {where}. Lower "
            "training.learning_rate, set training.max_grad_norm (e.g. 1.0), or use model.dtype float32, then "
            "resume with training.resume_from_checkpoint=auto"
        ) from None
    if isinstance(failure, RankError):
        where = f"the newest checkpoint, {newest}, is intact" if newest else "no checkpoint was written yet"
        raise RankError(
            f"{failure}; every rank stopped after step {done} of {steps}; {where}. Resume with "
            "training.resume_from_checkpoint=auto, on this or another number of processes"
        ) from None
    if is_disk_full(failure) and not isinstance(failure, DiskFullError):
        free = shutil.disk_usage(out).free
        raise DiskFullError(
            f"the filesystem of training.output_dir {out} is full ({format_size(free)} free): {failure}; free "
            "space there or point training.output_dir at a larger disk, then resume with "
            "training.resume_from_checkpoint=auto"
        ) from None


def _export(trainer: StreamedTrainer, tokenizer: Any, out: Path, writes: bool = True) -> None:
    """The trained adapter (PEFT) or model (Hugging Face) into the run directory. Of several ranks, only one
    ``writes``; every rank takes part in gathering a sharded model's chunks."""
    if trainer.adapters is not None:  # a PEFT adapter directory (the base is the input model)
        if writes:  # replicated: every rank has it whole
            trainer.save_adapter(out)
            tokenizer.save_pretrained(str(out))
    elif writes:
        export_hf(trainer, tokenizer, out)
    else:
        for _ in trainer.weights():  # the gathers rank 0 makes, chunk by chunk
            pass


def _check_room(trainer: StreamedTrainer, out: Path, saves: bool) -> None:
    """Whether the run directory's filesystem holds what the run will write: a checkpoint (when it saves)
    and the model at the end. A full disk found now costs nothing; found at the end, it costs the run."""
    model = 1 << 20 if trainer.adapters is not None else trainer.state_bytes()["weights"]
    needed = model + (checkpoint_bytes(trainer) if saves else 0)
    free = shutil.disk_usage(out).free
    if needed > free:
        raise DiskFullError(
            f"training.output_dir {out} has {format_size(free)} free, and the run will write "
            f"{format_size(needed)} there (one checkpoint and the model); free space there, point "
            "training.output_dir at a larger disk, or save no checkpoints (training.save_steps=0)"
        )


def tokenizer_of(model_path: str) -> Any:
    """The tokenizer of the model at ``model_path``; ModelError saying what is there where transformers cannot
    load one."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        why = " ".join(str(exc).split("\n")[0].split()).rstrip(": ") or type(exc).__name__  # its first line
        found = [p.name for p in Path(model_path).glob("tokenizer*")]
        raise ModelError(
            f"model.path {model_path} has no tokenizer that transformers can load ("
            + (
                f"{', '.join(sorted(found))} there: {why}"
                if found
                else "no tokenizer.json or tokenizer_config.json"
            )
            + "); save the model's tokenizer there (tokenizer.save_pretrained)"
        ) from None


def _check_vocabulary(data: Any, model_path: str) -> None:
    """Token ids the model has no embedding for would fail deep in the first step: say so before loading."""
    from tiertune.loading.model import decoder_config

    vocab = getattr(decoder_config(model_path), "vocab_size", None)
    if vocab is None or len(data) == 0:
        return
    top = data.max_token_id
    if top >= vocab:
        raise DataError(
            f"the tokenizer in {model_path} gives token ids up to {top}, but the model's vocabulary has {vocab} "
            "entries (vocab_size in config.json): use the tokenizer the model was trained with, or resize the "
            "model's embeddings (model.resize_token_embeddings) and save it before fine-tuning"
        )


def _banner(
    recipe: Recipe, trainer: StreamedTrainer, store: StoreConfig, steps: int, first: int, data: Any
) -> str:
    """What the run is about to do: what is trained, on what data, the effective batch, where each state
    lives, budgets, and how the optimizer runs."""
    t, cfg = recipe.training, trainer.config
    counts = trainer.parameter_counts()
    trained, total = counts["trained"], counts["total"]
    world = trainer.world
    batch = t.per_device_train_batch_size * t.gradient_accumulation_steps * world.size
    fused = [describe(trainer.kernel_counts)] if trainer.kernel_counts else []
    if trainer.fused_loss:
        fused.append("fused loss")
    if trainer.attention_kept is None:
        fused.append("segment attention")
    homes = {
        "weights": cfg.params,
        "gradients": cfg.gradients,
        "master": cfg.optimizer_states,
        "moments": cfg.optimizer_states,
        "projections": cfg.optimizer_states,
        "twins": cfg.optimizer_states,
    }
    where = ", ".join(
        f"{kind} {format_size(n)} on {homes[kind]}" for kind, n in trainer.state_bytes().items() if n
    )
    if trainer.adapters is not None:
        where += f", adapters and their states on {trainer.device.type}"
    method = recipe.method.type + (
        f" on a {recipe.model.quantize} base" if recipe.model.quantize != "none" else ""
    )
    left_out = [f"{data.skipped} bad rows skipped"] if data.skipped else []
    if data.dropped:
        left_out.append(f"{data.dropped} rows with nothing to predict dropped")
    lines = [
        f"tiertune: {method}, {trained:,} of {total:,} parameters trained ({100 * trained / max(total, 1):.2f}%)",
        f"  data: {len(data):,} rows, {data.tokens:,} tokens from {recipe.data.path}"
        + (f" ({', '.join(left_out)})" if left_out else ""),
        f"  steps {first + 1}-{steps} of {steps}, effective batch {batch} sequences "
        f"({t.per_device_train_batch_size} x {t.gradient_accumulation_steps} accumulated"
        + (f" x {world.size} ranks" if world.size > 1 else "")
        + "), "
        f"max_seq_len {recipe.data.max_seq_len}{', packed' if recipe.data.packing else ''}",
        f"  state{f' (of each of {world.size} ranks)' if world.size > 1 else ''}: {where}",
        f"  budgets: device ({store.device}) {format_size(store.device_budget)}, host {format_size(store.host_budget)}"
        + (f", disk {store.disk_path}" if store.disk_path else "")
        + (
            f"; per rank of {world.size} (ZeRO-3: each keeps 1/{world.size} of every chunk; offload.host_budget"
            f" is the node's, shared by its {world.local_size} ranks)"
            if world.size > 1
            else ""
        ),
        f"  optimizer: {optimizer_description(recipe, trainer)}",
        f"  micro-batches: {_waves(trainer, t.gradient_accumulation_steps)}; the hidden states at the layer "
        f"boundaries on the {cfg.activations}; output {t.output_dir}",
        f"  kernels: {trainer.kernel_backend} ({', '.join(fused) or 'none fused: the model modules, unfused loss'})",
    ]
    return "\n".join(lines)


def _waves(trainer: StreamedTrainer, micro_batches: int) -> str:
    """How a step runs its micro-batches (``engine.schedule``), in words."""
    waves = trainer.schedule.waves(micro_batches)
    if len(waves) == 1:
        return (
            f"{micro_batches} a step, through each layer while it is loaded (the weights stream once a step)"
        )
    return (
        f"{micro_batches} a step in {len(waves)} waves of up to {len(waves[0])} (their layer boundaries do not "
        "fit the budgets at once; the weights stream once a wave)"
    )


def optimizer_description(recipe: Recipe, trainer: StreamedTrainer) -> str:
    """Which optimizer runs and when, as it will really happen (said in the banner)."""
    cfg, g = trainer.config, recipe.method.galore
    eight = cfg.optim == "adamw_bnb_8bit"
    if recipe.method.type == "galore":
        name = (
            f"GaLore {'8-bit ' if eight else ''}AdamW (rank {g.rank}, projections refreshed every "
            f"{g.update_proj_gap} steps, scale {g.scale}; full-rank AdamW for the other weights)"
        )
    else:
        name = "8-bit AdamW (bitsandbytes)" if eight else "AdamW (torch, fused)"
    if trainer.adapters is not None:
        return f"{name} on the adapters, after backward"
    clipping = cfg.clips
    if cfg.delay_update:
        return (
            f"{name} on the CPU during the next step, which computes on the weights before it "
            "(offload.delay_update: one step stale; the norm known first, exact clipping, no twins)"
        )
    if not trainer.overlap:
        why = (  # EngineConfig made overlap_optimizer one of auto/on/off
            "offload.overlap_optimizer: false"
            if cfg.overlap_optimizer == "off"
            else "its twin states do not fit the budgets"
        )
        return f"{name} on the CPU after backward ({why})"
    if not clipping:
        return f"{name} on the CPU during backward, layer by layer, in place (no clipping)"
    return (
        f"{name} on the CPU during backward, speculatively: a step whose gradient norm exceeds "
        f"max_grad_norm {cfg.max_grad_norm} is redone after backward, and the step after it waits for the norm"
    )


class _Progress:
    """How a run shows its progress: a bar in a terminal (tqdm) or a notebook with ipywidgets (tqdm's widget),
    else one plain line per logged step (loss, tokens/s, peak bytes per tier): a log file or a pipe gets no
    bar frames, and a notebook without ipywidgets no "IProgress not found" warning."""

    def __init__(self, total: int, done: int, every: int) -> None:
        self.total, self.every = total, every
        self._bar = None
        notebook = _in_notebook()
        if notebook and importlib.util.find_spec("ipywidgets") is not None:
            from tqdm.notebook import tqdm
        elif not notebook and sys.stderr.isatty():
            from tqdm import tqdm
        else:
            return
        self._bar = tqdm(total=total, initial=done, desc="tiertune", unit="step")

    def update(self, step: int, loss: float, tokens_per_second: float, peaks: dict[str, int]) -> None:
        memory = {k: format_size(v) for k, v in peaks.items()}
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:.0f}", **memory)
            self._bar.update(1)
        elif step % self.every == 0 or step == self.total:
            peak = ", ".join(f"{k} {v}" for k, v in memory.items())
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_second:,.0f} tokens/s  peak {peak}",
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _rewrite_log(path: Path, records: list[dict]) -> None:
    """Replace the JSON-lines log with ``records``."""
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in records))


def export_hf(trainer: StreamedTrainer, tokenizer: object, out: Path) -> None:
    """Write the trained model as a Hugging Face directory in ``out``, streaming chunk by chunk."""
    config = trainer.model.config
    config.use_cache = True

    def parts() -> Iterator[dict[str, torch.Tensor]]:
        for part in trainer.weights():
            if trainer.safe_point is not None:  # between parts: the export's temporary directory is removed
                trainer.safe_point()
            yield part

    write_hf(parts(), config, tokenizer, out)
