"""What a run's evaluations cost (``finetune.evaluation``), for ``estimate``.

An evaluation scores the held-out set (``data.eval_path``) in passes of the layers without autograd,
``gradient_accumulation_steps`` batches of ``per_device_train_batch_size`` rows (pairs) a pass, a LoRA DPO's or
KTO's pass twice (its reference is the base with the adapters off), every ``eval_steps`` steps or at each
epoch's end (``finetune.evaluation.due``), and once more before the first step with ``eval_on_start``. Each
pass reads the weights again, less what the budgets keep cached, and leaves them cached, so the step after an
evaluation reads about what a step reads (``ChunkStore.forget_pass``). The bytes are the store's own, counted on
a ledger (``engine.replay``'s ``evaluate``: two passes after the replayed steps, then one more step); the
seconds, where rates are measured, are the timeline's (``estimates.timeline``) of each pass and of the step
after them, at the step's own rates. Every pass is priced
as a full one (the set's last may hold fewer batches), and every evaluation the run may make is counted (early
stopping may end the run sooner). Of several adapters over one base, each evaluating adapter's are priced apart:
its passes of the base with it alone, replayed one adapter after another after the steps of all of them. A
distillation's held-out figures come from the teacher pass before the run (cached top-k: priced with it,
``estimates.teacher``), or from the teacher beside the student, a pass of its own store before each of the
student's (``top_k: 0``: its later passes' bytes, and their time as the teacher's: the longer of its reads and
its forward over the set's scored tokens). GRPO's held-out prompts are sampled first (``finetune.grpo_evaluation``):
``num_generations_eval`` completions of each, a step's generation at a time (each priced as the step's,
``estimates.generation``, its reference beside it included), then scored in passes of the completions (a LoRA
run's with ``beta`` twice: the base without its adapters is the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tiertune.units import format_seconds, format_size


@dataclass
class EvalEstimate:
    """A run's evaluations: how many, of how many passes, the bytes each moves (see the module docstring).
    ``rows`` and ``evaluations`` are None where the data cannot be read here (``why`` says so)."""

    rows: int | None  # the held-out set's rows (a preference objective's: pairs)
    passes: int | None  # passes of the layers an evaluation
    evaluations: int | None  # evaluations over the run, at most
    first_pass: dict[str, int] = field(default_factory=dict)  # bytes by link: an evaluation's first pass
    later_pass: dict[str, int] = field(default_factory=dict)  # ... each pass after it
    step_after: dict[str, int] = field(default_factory=dict)  # ... the step after an evaluation
    why: str = ""  # why the set's rows are not known
    replayed: bool = False  # whether its passes were replayed (not where no step could be)
    pass_seconds: tuple[float, float] | None = None  # (the first pass, each later one), timed
    step_after_extra: float | None = None  # seconds the step after an evaluation takes beyond a step
    # a distillation's teacher beside the student (``top_k: 0``): the disk bytes its store reads a pass (its
    # later passes', replayed: ``estimates.teacher``), and its passes' seconds an evaluation (timed)
    teacher_pass_bytes: int | None = None
    teacher_seconds: float | None = None
    # GRPO's: the generations an evaluation samples (a step's each), the bytes one reads by link and its seconds
    generations: int = 0
    generation_bytes: dict[str, int] = field(default_factory=dict)
    generation_seconds: float | None = None

    @property
    def seconds(self) -> float | None:
        """One evaluation's seconds: its passes (the teacher's beside them first) and what the step after it
        takes more than a step."""
        if self.pass_seconds is None or self.passes is None:
            return None
        first, later = self.pass_seconds
        if self.generations and self.generation_seconds is None:
            return None
        return (
            first
            + (self.passes - 1) * later
            + (self.step_after_extra or 0.0)
            + (self.teacher_seconds or 0.0)
            + self.generations * (self.generation_seconds or 0.0)
        )

    @property
    def total_seconds(self) -> float | None:
        """All the run's evaluations, seconds."""
        return None if self.seconds is None or self.evaluations is None else self.evaluations * self.seconds

    def as_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "passes_per_evaluation": self.passes,
            "evaluations": self.evaluations,
            "first_pass_bytes": self.first_pass,
            "later_pass_bytes": self.later_pass,
            "step_after_bytes": self.step_after,
            "pass_seconds": list(self.pass_seconds) if self.pass_seconds is not None else None,
            "step_after_extra_seconds": self.step_after_extra,
            "seconds_per_evaluation": self.seconds,
            "total_seconds": self.total_seconds,
            "teacher_pass_bytes": self.teacher_pass_bytes,
            "teacher_seconds": self.teacher_seconds,
            "generations": self.generations,
            "generation_bytes": self.generation_bytes,
            "generation_seconds": self.generation_seconds,
            "why_unknown": self.why or None,
            "replayed": self.replayed,
        }


def eval_estimate(recipe: Any, steps: int | None, per_epoch: int | None, rows: int | None) -> EvalEstimate:
    """``recipe``'s evaluations over ``steps`` steps (``per_epoch``: the micro-batches of an epoch, for
    ``eval_strategy: epoch``) of a held-out set of ``rows`` rows (None: unknown here); the bytes are filled in
    from the replay (``engine.replay.Evaluated``)."""
    from tiertune.finetune.evaluation import count_evaluations

    t, o = recipe.training, recipe.objective
    passes, generations = None, 0
    if rows is not None:
        if o.rollouts:  # GRPO: each prompt's completions, sampled a step's generation at a time
            rows *= o.generations_eval
            generations = math.ceil(rows / (t.per_device_train_batch_size * t.gradient_accumulation_steps))
        passes = max(
            1, math.ceil(math.ceil(rows / t.per_device_train_batch_size) / t.gradient_accumulation_steps)
        )
        if o.rollouts and o.beta != 0.0 and recipe.method.type == "lora":  # the base without its adapters
            passes *= 2
    evaluations = None
    if steps is not None and (per_epoch is not None or t.eval_strategy != "epoch"):
        evaluations = count_evaluations(recipe, steps, per_epoch or 1)
    return EvalEstimate(rows, passes, evaluations, generations=generations)


def format_evaluation(est: EvalEstimate) -> list[str]:
    """The evaluations' lines in ``estimate``'s report."""

    def links(moved: dict[str, int]) -> str:
        return ", ".join(f"{k} {format_size(n)}" for k, n in moved.items()) or "nothing (all resident)"

    if est.passes is None:
        head = f"evaluation: the held-out set's size is unknown here ({est.why}); a pass of the layers"
    elif est.generations:
        head = (
            f"evaluation: {est.rows:,} completions of the held-out prompts sampled in {est.generations} "
            f"generation{'s' if est.generations > 1 else ''}, scored in {est.passes} pass"
            f"{'es' if est.passes > 1 else ''} of the layers"
        )
    else:
        head = (
            f"evaluation: {est.rows:,} held-out rows in {est.passes} pass{'es' if est.passes > 1 else ''} of the "
            "layers"
        )
    n = est.evaluations
    count = f"{n:,} evaluation{'' if n == 1 else 's'}" if n is not None else "an unknown number of them"
    lines = [f"{head} ({count} over the run, at most)"]
    if not est.replayed:
        return [*lines, "  its passes not replayed: no step could be (above)"]
    lines += [
        f"  a pass moves {links(est.first_pass)}"
        + (f" (later passes {links(est.later_pass)})" if est.later_pass != est.first_pass else ""),
        f"  the step after an evaluation moves {links(est.step_after)}",
    ]
    if est.generations:
        lines.append(
            f"  a generation reads {links(est.generation_bytes)}"
            + (f" in {format_seconds(est.generation_seconds)}" if est.generation_seconds is not None else "")
        )
    if est.teacher_pass_bytes is not None:
        lines.append(
            f"  the teacher beside scores each pass's batches first: its store reads {format_size(est.teacher_pass_bytes)} "
            "from the disk a pass (what its half of the budgets keeps stays)"
        )
    if est.pass_seconds is not None:
        first, later = est.pass_seconds
        each = format_seconds(est.seconds) if est.seconds is not None else "unknown"
        teacher = (
            f", the teacher's passes {format_seconds(est.teacher_seconds)}"
            if est.teacher_seconds is not None
            else ""
        )
        lines.append(
            f"  a pass {format_seconds(first)} (later ones {format_seconds(later)}){teacher}, the step after it "
            f"{format_seconds(est.step_after_extra or 0.0)} longer: an evaluation {each}"
        )
    return lines
