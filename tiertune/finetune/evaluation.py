"""Evaluation during a run: the loss over a held-out set (``data.eval_path``, in the run's ``data.format``) every
``training.eval_steps`` steps and after the last (``eval_strategy: steps``, as transformers 5's Trainer) or at
each epoch's end (``epoch``), before the first step too with ``eval_on_start``, and early stopping on it (GRPO's
held-out prompts are sampled and rewarded: ``finetune.grpo_evaluation``).

The figure is ``eval_loss``: the cross-entropy of every scored token of the set, summed and divided by their
number (the training loss's definition, over the whole set at once), a distillation's loss against its teacher
over the same tokens, or a preference objective's loss over the set's pairs with TRL's metrics (``evaluate``), by
the weights as they are after the step, dropout off, without autograd. Batches are of the step's shapes
(``per_device_train_batch_size`` rows, up to ``max_seq_len`` tokens), ``gradient_accumulation_steps`` of them a
pass of the layers: the budgets were planned for those. The pass's accesses are not the steps' trace
(``StreamedTrainer.sequence_logps``); what the tiers cache stays cached, as after a step, so the next step reads
about what it would have read without the evaluation. Of several processes each runs the whole set (the sharded
weights are gathered by every rank alike): the figure is the same on each. A distillation's batches carry their
teacher's figures (``evaluate``'s ``teacher``).

Records are the Hugging Face Trainer's: one of its own in ``trainer_log.jsonl`` and ``log_history`` with
``eval_loss``, ``eval_runtime``, ``eval_samples_per_second``, ``eval_steps_per_second``, ``epoch`` and ``step``,
and, as a step's record, ``bytes_moved`` (per link, counted from the start: what the passes read).

Early stopping is transformers' ``EarlyStoppingCallback`` on ``training.metric_for_best_model`` (``eval_loss``,
lower is better; GRPO's ``eval_reward``, higher is): an evaluation
better than the best before it by more than ``early_stopping_threshold`` resets the count, any other adds one;
at ``early_stopping_patience`` the run ends after that step as at its last (its checkpoint, the model exported;
``trainer_state.json`` says ``stopped_early``). A resumed run counts again from the evaluations of its log.
The model exported is the last step's, or with ``load_best_model_at_end`` the checkpoint of the best evaluation
(``best_checkpoint``; ``save_steps`` a multiple of ``eval_steps``), which ``save_total_limit`` keeps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertune.engine.objective import add_metric
from tiertune.errors import DataError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX


def due(recipe: Any, step: int, per_epoch: int, steps: int) -> bool:
    """Whether a run of ``steps`` steps evaluates after step ``step`` (counted from 1): every ``eval_steps`` and
    after the last step (transformers 5's Trainer: at the end of training too where the last step falls
    between two), or (``eval_strategy: epoch``) where the step took an epoch's last micro-batch (``per_epoch``
    of them: the global batches of the data)."""
    if recipe.training.eval_strategy == "epoch":
        accumulated = recipe.training.gradient_accumulation_steps
        return step * accumulated // per_epoch > (step - 1) * accumulated // per_epoch
    every = recipe.eval_every
    return every > 0 and (step % every == 0 or step == steps)


def count_evaluations(recipe: Any, steps: int, per_epoch: int) -> int:
    """The evaluations a run of ``steps`` steps makes at most (early stopping may end it sooner): one before the
    first step with ``eval_on_start``, and one after each step ``due`` says."""
    if not recipe.evaluates:
        return 0
    due_steps = sum(due(recipe, step, per_epoch, steps) for step in range(1, steps + 1))
    return int(recipe.training.eval_on_start) + due_steps


def eval_batches(data: Any, recipe: Any, pad_id: int) -> list[list[dict[str, torch.Tensor]]]:
    """The held-out set as passes: groups of up to ``gradient_accumulation_steps`` batches of
    ``per_device_train_batch_size`` rows (of pairs, for a preference objective), in the file's order, unpacked."""
    from tiertune.finetune.data import batches, row_batches

    t = recipe.training
    size = t.per_device_train_batch_size
    if recipe.objective.paired:  # each batch its chosen sequences, then its rejected ones
        stream = batches(data, size, pad_id, shuffle=False, seed=0)
        rows = [next(stream) for _ in range(-(-len(data) // size))]
    else:
        rows = row_batches(data, list(range(len(data))), size, pad_id)
    group = t.gradient_accumulation_steps
    return [rows[i : i + group] for i in range(0, len(rows), group)]


def scored_tokens(batch: dict[str, torch.Tensor]) -> int:
    """A batch's tokens with a target (its labels shifted by one, -100 left out)."""
    labels = batch.get("labels", batch["input_ids"])
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def evaluate(
    trainer: Any,
    passes: Sequence[Sequence[dict[str, torch.Tensor]]],
    objective: Any = None,
    reference: torch.Tensor | None = None,
    teacher: Callable[[Sequence[dict[str, torch.Tensor]]], list[dict[str, torch.Tensor]]] | None = None,
) -> dict[str, float]:
    """``trainer``'s loss over ``passes`` (``eval_batches``) with the weights as they are: the Trainer's
    record of an evaluation (without ``epoch`` and ``step``, which the run adds). Dropout is off for the pass
    and back on after it. With ``offload.delay_update`` the weights are those the next step computes on (one
    update behind); the update in flight is waited for first, as a checkpoint does.

    For a preference ``objective`` (DPO, SimPO, ORPO, KTO) ``eval_loss`` is its loss, and its metrics are TRL's
    with ``eval_`` before them (``eval_rewards/margins``, ...), each the mean over the set's pairs (KTO's, as
    ``KTOTrainer`` logs them, the mean over the batches of each batch's: its rows with their KL sequences, the
    batch's KL estimate); the reference is the base with the adapters off (LoRA: a second pass) or ``reference``,
    the set's log-probabilities by the initial weights ([rows, 2], ``finetune.reference.reference_logps``).

    For a distillation, ``eval_loss`` is its loss over the set's scored tokens (``alpha`` x the cross-entropy +
    (1 - ``alpha``) x the divergence from the teacher, as a step's), with ``eval_kd_loss`` and ``eval_ce_loss``
    (each a mean by token, as a step logs ``kd_loss`` and ``ce_loss``); ``teacher`` gives a pass's batches with
    their teacher's figures (read from the held-out set's cache, or the teacher beside scoring them then)."""
    began = time.perf_counter()
    trainer.settle()  # a delayed update in flight (offload.delay_update) done; the weights stay one update behind
    model = trainer.model
    was_training = model.training
    paired = objective is not None and objective.paired
    total, tokens, rows = 0.0, 0, 0
    sums: dict[str, tuple[float, float]] = {}
    model.eval()
    try:
        for group in passes:
            if objective is not None and objective.distills:
                assert teacher is not None  # the run attaches the held-out set's figures
                loss, scored = _distilled(trainer, teacher(group), objective, sums)
                total, tokens = total + loss, tokens + scored
                rows += sum(len(b["input_ids"]) for b in group)
                continue
            if paired:
                loss, pairs = _pairs(trainer, group, objective, reference, sums)
                total, tokens, rows = total + loss, tokens + pairs, rows + pairs
                continue
            for batch, logps in zip(group, trainer.sequence_logps(group), strict=True):
                total -= float(logps.double().sum())
                tokens += scored_tokens(batch)
                rows += int(batch["input_ids"].shape[0])
    finally:
        model.train(was_training)
    if tokens == 0:
        raise DataError(
            f"the evaluation set has no scored {'pairs' if paired else 'tokens'} (every label is -100): check "
            "data.eval_path and data.max_seq_len"
        )
    runtime = time.perf_counter() - began
    return {
        "eval_loss": total / tokens,
        **{f"eval_{name}": value / count for name, (value, count) in sums.items() if count},
        "eval_runtime": round(runtime, 4),
        "eval_samples_per_second": round(rows / runtime, 3),
        "eval_steps_per_second": round(sum(len(g) for g in passes) / runtime, 3),
        # per link since the store started, as a step's
        "bytes_moved": dict(trainer.store_stats().bytes_moved),
    }


def _distilled(
    trainer: Any,
    group: Sequence[dict[str, torch.Tensor]],
    objective: Any,
    sums: dict[str, tuple[float, float]],
) -> tuple[float, int]:
    """A pass of a distillation's batches (each with its teacher's figures): their summed loss and scored tokens,
    the summed cross-entropy and divergence added into ``sums`` (``kd_loss``, ``ce_loss``, by token)."""
    o = objective

    def head(engine: Any, mb: Any, x: torch.Tensor) -> torch.Tensor:
        args = (mb.ids, mb.extra, mb.target, mb.teacher, o.beta, o.temperature, o.alpha)
        loss, ce, kd = engine.compute.distill(engine.loss, x, *args)
        return torch.stack([loss, ce, kd]).double().cpu()

    total, tokens = 0.0, 0
    for batch, (loss, ce, kd) in zip(group, trainer.sequence_logps(group, head), strict=True):
        n = scored_tokens(batch)
        total, tokens = total + float(loss), tokens + n
        for name, value in (("kd_loss", kd), ("ce_loss", ce)):
            add_metric(sums, name, float(value), n)
    return total, tokens


def _pairs(
    trainer: Any,
    group: Sequence[dict[str, torch.Tensor]],
    objective: Any,
    reference: torch.Tensor | None,
    sums: dict[str, tuple[float, float]],
) -> tuple[float, int]:
    """A pass of preference batches: the summed loss of their pairs and how many (a pair without a target in
    either sequence counts none); their metrics' sums and counts added into ``sums``."""
    from tiertune.engine.objective import counted, pair_losses
    from tiertune.engine.pairs import whole_target

    def token_losses(engine: Any, mb: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        target = whole_target(mb) if objective.whole_sequences else mb.target  # ORPO's: the prompts' too
        return engine.compute.token_losses(engine.loss, x, mb.ids, mb.extra, target).float().cpu(), target

    policy = trainer.sequence_logps(group, token_losses)
    if reference is None and objective.reference:  # LoRA: the base, its adapters off
        with trainer.reference():
            theirs = [logps.float().cpu() for logps in trainer.sequence_logps(group)]
    total, pairs = 0.0, 0
    for k, (batch, (losses_of_tokens, target)) in enumerate(zip(group, policy, strict=True)):
        ref = None
        if objective.reference:  # DPO's, KTO's (a row's, then its KL sequence's)
            if reference is None:
                ref = theirs[k]
            else:
                rows = batch["rows"]
                ref = torch.cat([reference[rows, 0], reference[rows, 1]]).float()
        completion = batch["labels"][:, 1:] != IGNORE_INDEX
        losses, metrics = pair_losses(
            objective, losses_of_tokens, completion, ref, target.cpu() != IGNORE_INDEX, batch.get("label")
        )
        total += float(losses.double().sum())
        pairs += int(counted(completion.sum(1)).sum())  # (KTO's: a row and its KL sequence)
        for name, (value, count) in metrics.items():
            add_metric(sums, name, value, count)
    return total, pairs


@dataclass
class EarlyStopping:
    """transformers' ``EarlyStoppingCallback`` on ``metric`` (``eval_loss``: lower is better; ``greater``: higher
    is, as GRPO's ``eval_reward``): ``best`` the best value so far, ``waited`` the evaluations since one
    improved on the best before it by more than ``threshold``."""

    patience: int
    threshold: float = 0.0
    best: float | None = None
    waited: int = 0
    metric: str = "eval_loss"
    greater: bool = False

    @classmethod
    def of(cls, recipe: Any, history: Iterable[dict[str, Any]] = ()) -> EarlyStopping:
        """The rule of ``recipe``'s settings (``Recipe.best_metric``), having seen the evaluations of ``history``
        (a resumed run's log)."""
        t = recipe.training
        metric, greater = recipe.best_metric
        out = cls(t.early_stopping_patience, t.early_stopping_threshold, metric=metric, greater=greater)
        for record in history:
            if record.get(metric) is not None:
                out.see(float(record[metric]))
        return out

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` beats ``than`` (None: nothing to beat) in the metric's direction."""
        return than is None or (value > than if self.greater else value < than)

    def see(self, value: float) -> bool:
        """Count an evaluation's value; True when the run should stop (patience used up; never without one)."""
        if self.best is None or (self.better(value, self.best) and abs(value - self.best) > self.threshold):
            self.waited = 0
        else:
            self.waited += 1
        if self.better(value, self.best) or math.isnan(self.best or 0.0):
            self.best = value
        return self.patience > 0 and self.waited >= self.patience


def best_checkpoint(
    history: Iterable[dict[str, Any]], run_dir: Path, metric: str = "eval_loss", greater: bool = False
) -> tuple[Path, float] | None:
    """The checkpoint of the best ``metric`` (the lowest, or with ``greater`` the highest) among the evaluations
    of ``history`` whose step has one in ``run_dir`` (the first of equals, as the Trainer's strict comparison
    keeps it), and that value; None without one."""
    from tiertune.finetune.checkpoint import PREFIX

    best: tuple[Path, float] | None = None
    for record in history:
        if record.get(metric) is None:
            continue
        path = run_dir / f"{PREFIX}{int(record['step'])}"
        value = float(record[metric])
        if path.is_dir() and (best is None or (value > best[1] if greater else value < best[1])):
            best = (path, value)
    return best


__all__ = [
    "EarlyStopping",
    "best_checkpoint",
    "count_evaluations",
    "due",
    "eval_batches",
    "evaluate",
    "scored_tokens",
]
