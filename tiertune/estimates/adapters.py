"""What a run of several LoRA adapters over one base needs (``tiertune estimate a.yaml b.yaml``, a recipe's
``sweep:``): ``estimate`` of all of them in one run (``estimate(others=...)``: the engine's own step of all
their micro-batches on a ledger, ``StreamedTrainer.step_adapters``) beside the first recipe's alone.

The bytes a step reads stay those of one adapter's step (the base streamed once for all); what grows with the
adapters is compute (every adapter's tokens) and what the device holds: each adapter's weights and AdamW states,
the wave's hidden states at the layer boundaries (every adapter's micro-batches), a stack's activations. Whether
they fit is ``config.several``'s verdict, the one ``tiertune train`` checks: where they do not, the most of them
(the first k of the recipes) that do; where they fit, about how many more like them would, from the growth per
adapter between one and all of them (linear: each adapter adds its own states and micro-batches). Each adapter
that evaluates has its evaluations priced as the run makes them, passes of the base with it alone
(``Estimate.adapter_evaluations``, ``estimates.evaluation``). Each distillation's teacher pass is priced as its
recipe's alone (``estimates.teacher``), once for the adapters of one teacher, its settings and data: the later
ones read the first's cached figures."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from tiertune.config.recipe import Recipe
from tiertune.config.several import Fit, Fitting, fit, fitting
from tiertune.errors import ConfigError, TiertuneError
from tiertune.estimates.evaluation import format_evaluation
from tiertune.estimates.report import Estimate, estimate, reads_data_once
from tiertune.estimates.speed import Probes, resolve_gpu
from tiertune.estimates.teacher import TeacherEstimate, format_teacher
from tiertune.loading.hub import config_directory
from tiertune.units import format_seconds, format_size

READ_LINKS = ("disk->host", "host->device")
"""The links the base's read crosses each step (what ``read_ratio`` compares)."""


@dataclass
class AdaptersEstimate:
    """Several adapters over one base: the estimate of their run (``all``) beside the first adapter's alone
    (``one``), whether they fit (``fitting``: the most of the first k recipes that do) and, where all fit, about
    how many more would."""

    recipes: int
    one: Estimate
    all: Estimate
    fitting: Fitting
    alone: Fit  # the first adapter's step alone on the ledger (what ``more`` grows from)
    more: int = 0
    # each distilling adapter's teacher pass, by its place among the recipes, or the place of the adapter whose
    # cached figures it reads (the same teacher, settings and data)
    teachers: dict[int, TeacherEstimate | int] | None = None

    @property
    def fits(self) -> bool:
        return self.fitting.fits

    @property
    def largest(self) -> int:
        return self.fitting.largest

    @property
    def read_ratio(self) -> float:
        """Bytes the step of all the adapters reads (``READ_LINKS``) over the first adapter's alone."""
        mine, one = (sum(e.moved_per_step.get(k, 0) for k in READ_LINKS) for e in (self.all, self.one))
        return mine / one if one else float("nan")

    def step_seconds(self, which: Estimate) -> float | None:
        """A step's seconds in ``which`` (None: not measured)."""
        return which.speed.seconds if which.speed is not None else None

    def as_json(self) -> dict:
        f = self.fitting
        return {
            "adapters": self.recipes,
            "fits": self.fits,
            "largest_that_fits": self.largest,
            "more_that_fit": self.more,
            "read_ratio": None if math.isnan(self.read_ratio) else round(self.read_ratio, 4),
            "step_seconds": {"one": self.step_seconds(self.one), "all": self.step_seconds(self.all)},
            "memory_limit_bytes": f.limit,
            "tried": [
                {"adapters": t.adapters, "holds_bytes": t.held(f.on_gpu), "why": t.why} for t in f.tried
            ],
            "refusal": f.refusal(),
            "evaluations": {str(i): e.as_json() for i, e in self.all.adapter_evaluations.items()},
            "teacher_passes": {
                str(i): {"reads_the_figures_of": t} if isinstance(t, int) else t.as_json()
                for i, t in (self.teachers or {}).items()
            },
            "one": self.one.as_json(),
            "all": self.all.as_json(),
        }


@reads_data_once
def estimate_adapters(recipes: list[Recipe], measure: bool = True, gpu: str = "auto") -> AdaptersEstimate:
    """The run of ``recipes`` (two or more that share a base: ``config.sweep.shared_base``) as several adapters
    over one base: its estimate and the first adapter's alone (``measure``: their step times too), on what
    ``gpu`` names (``speed.resolve_gpu``); whether they fit and, where they do not all, the most of them that
    do."""
    from tiertune.config.plan import resolve
    from tiertune.config.sweep import shared_base
    from tiertune.distributed.world import World

    if len(recipes) < 2:
        raise ConfigError("an estimate of several adapters takes two or more recipes (or a sweep: section)")
    recipes = [copy.deepcopy(r).with_absolute_paths() for r in recipes]
    shared_base(recipes)
    for r in recipes:
        r.model.path = config_directory(r.model.path)
    first, rest = recipes[0], recipes[1:]
    probes = Probes()  # both steps priced at one set of measured rates
    one = estimate(first, measure=measure, gpu=gpu, probes=probes)
    whole = estimate(first, measure=measure, gpu=gpu, others=rest, probes=probes)
    target = resolve_gpu(gpu)
    device_type, memory_of = ("cuda", target.memory) if target is not None else ("cpu", None)
    runs = [resolve(r, World(), device_type, memory_of) for r in recipes]
    found = fitting(runs, memory_of)
    alone = fit(runs, 1, found.on_gpu)
    more = 0
    if found.fits:
        all_of = found.tried[0].held(found.on_gpu)
        per = (all_of - alone.held(found.on_gpu)) / (len(runs) - 1)
        more = int((found.limit - all_of) // per) if per > 0 else 0
    teachers: dict[int, TeacherEstimate | int] = {}
    made: dict[Any, int] = {}  # a set's teacher figures -> the first adapter whose pass makes them
    for i, r in enumerate(recipes):
        if not r.objective.distills:
            continue
        sets = _figure_sets(r)
        if all(key in made for key in sets):  # every set's figures cached by an earlier adapter's pass
            teachers[i] = made[sets[0]]
            continue
        for key in sets:
            made.setdefault(key, i)
        priced = one if i == 0 else estimate(r, measure=measure, gpu=gpu, probes=probes)
        assert priced.teacher is not None  # a distillation's estimate prices its teacher pass
        teachers[i] = priced.teacher
    return AdaptersEstimate(len(recipes), one, whole, found, alone, more, teachers or None)


def _figure_sets(recipe: Recipe) -> list[Any]:
    """The keys of a distillation's cached teacher figures of its data and held-out set (``finetune.teacher``'s,
    of the data as the run tokenizes it; where it cannot be read here, what the recipe says they depend on): a
    pass scores the sets no earlier one did (one that scores any is priced whole)."""
    from tiertune.finetune.teacher import cache_key
    from tiertune.finetune.train import load_run
    from tiertune.loading.model import vocabulary_size

    recipe = copy.deepcopy(recipe)
    recipe.objective.teacher.path = config_directory(recipe.objective.teacher.path)
    try:
        loaded = load_run(recipe, 1)
        vocab = vocabulary_size(recipe.model.path)
        held = [loaded.eval_data] if loaded.eval_data is not None else []
        return [cache_key(recipe, data, vocab) for data in [loaded.data, *held]]
    except (TiertuneError, OSError):
        t, o, d = recipe.objective.teacher, recipe.objective, recipe.data
        settings = (
            t.path,
            t.dtype,
            t.quantize,
            recipe.kernels,
            o.top_k,
            o.temperature,
            d.format,
            d.max_seq_len,
        )
        paths = [d.path] + ([d.eval_path] if recipe.evaluates and d.eval_path else [])
        return [(*settings, d.add_eos, p) for p in paths]


def _flops(n: float) -> str:
    return f"{n / 1e12:.3g} T" if n >= 1e12 else f"{n / 1e9:.3g} G"


def refusal(est: AdaptersEstimate) -> str | None:
    """Why a run of the estimate's adapters cannot start, naming the most that fit (None: they fit)."""
    return est.fitting.refusal()


def format_adapters(est: AdaptersEstimate, title: str) -> str:
    """The estimate as a table: one adapter's step beside all of theirs, then what fits."""
    one, whole = est.one, est.all
    lines = [title, f"{'':34}{'one adapter':>16}{f'{est.recipes} adapters':>16}"]
    rows = [
        ("device tier peak", lambda e: format_size(e.tiers["device"].peak)),
        ("host tier peak", lambda e: format_size(e.tiers["host"].peak)),
        ("on the device, outside the store", lambda e: format_size(sum(e.outside_store.values()))),
        (
            "read a step (disk, PCIe)",
            lambda e: format_size(sum(e.moved_per_step.get(k, 0) for k in READ_LINKS)),
        ),
        ("FLOPs a step", lambda e: _flops(e.speed.flops.total) if e.speed else "-"),
        ("a step", lambda e: f"{e.speed.seconds:.3g} s" if e.speed else "-"),
    ]
    for label, of in rows:
        lines.append(f"{label:34}{of(one):>16}{of(whole):>16}")
    if math.isnan(est.read_ratio):  # one adapter's step reads nothing: the base stays where it computes
        lines.append("bytes read a step: none, for one adapter or all (the base resident)")
    else:
        lines.append(
            f"bytes read a step: {est.read_ratio:.2f}x one adapter's (the base streamed once for all)"
        )
    for i, evaluated in whole.adapter_evaluations.items():  # each one's passes of the base with it alone
        head, *rest = format_evaluation(evaluated)
        lines += [f"adapter {i + 1}'s {head}", *rest]
    if whole.adapter_evaluations and whole.speed is not None:
        each = [e.total_seconds for e in whole.adapter_evaluations.values()]
        if all(n is not None for n in each):
            lines.append(f"  => their evaluations: {format_seconds(sum(each))} more over the run, at most")
    for i, teacher in (est.teachers or {}).items():
        if isinstance(teacher, int):
            lines.append(
                f"adapter {i + 1}'s teacher figures: adapter {teacher + 1}'s (the same teacher, settings and data)"
            )
            continue
        head, *rest = format_teacher(teacher)
        lines += [f"adapter {i + 1}'s {head}", *rest]
    if est.fits:
        f = est.fitting
        where = "the GPU" if f.on_gpu else "this machine's RAM"
        lines.append(
            f"fits: a step of the {est.recipes} adapters holds {format_size(f.tried[0].held(f.on_gpu))} of "
            f"{where}'s {format_size(f.limit)}; about {est.more} more like them would fit"
        )
    else:
        lines.append(f"does not fit: {refusal(est)}")
    return "\n".join(lines)


__all__ = ["AdaptersEstimate", "estimate_adapters", "format_adapters", "refusal"]
