"""What a run of several LoRA adapters over one base needs (``tiertune estimate a.yaml b.yaml``, a recipe's
``sweep:``): ``estimate`` of all of them in one run (``estimate(others=...)``: the engine's own step of all
their micro-batches on a ledger, ``StreamedTrainer.step_adapters``) beside the first recipe's alone.

The bytes a step reads stay those of one adapter's step (the base streamed once for all); what grows with the
adapters is compute (every adapter's tokens) and what the device holds: each adapter's weights and AdamW states,
the wave's hidden states at the layer boundaries (every adapter's micro-batches), a stack's activations. Where
the adapters do not fit, the estimate finds the most of them (the first k of the recipes) that do, each k
estimated; where they fit, it says how many more like them would, from the growth per adapter between one and
all of them (linear: each adapter adds its own states and micro-batches)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiertune.config.recipe import Recipe
from tiertune.errors import ConfigError
from tiertune.estimates.report import Estimate, estimate
from tiertune.units import format_size

READ_LINKS = ("disk->host", "host->device")
"""The links the base's read crosses each step (what ``read_ratio`` compares)."""


@dataclass
class AdaptersEstimate:
    """Several adapters over one base: the estimate of their run (``all``) beside the first adapter's alone
    (``one``), the most of them (the first k recipes) that fit, and, where all fit, about how many more would."""

    recipes: int
    one: Estimate
    all: Estimate
    largest: int
    more: int = 0
    tried: list[tuple[int, bool]] = field(
        default_factory=list
    )  # (adapters, whether they fit), each estimated

    @property
    def fits(self) -> bool:
        return self.largest == self.recipes

    @property
    def read_ratio(self) -> float:
        """Bytes the step of all the adapters reads (``READ_LINKS``) over the first adapter's alone."""
        mine, one = (sum(e.moved_per_step.get(k, 0) for k in READ_LINKS) for e in (self.all, self.one))
        return mine / one if one else float("nan")

    def step_seconds(self, which: Estimate) -> float | None:
        """A step's seconds in ``which`` (None: not measured)."""
        return which.speed.seconds if which.speed is not None else None

    def as_json(self) -> dict:
        return {
            "adapters": self.recipes,
            "fits": self.fits,
            "largest_that_fits": self.largest,
            "more_that_fit": self.more,
            "read_ratio": round(self.read_ratio, 4),
            "step_seconds": {"one": self.step_seconds(self.one), "all": self.step_seconds(self.all)},
            "tried": [{"adapters": k, "fits": ok} for k, ok in self.tried],
            "one": self.one.as_json(),
            "all": self.all.as_json(),
        }


def estimate_adapters(recipes: list[Recipe], measure: bool = True, gpu: str = "auto") -> AdaptersEstimate:
    """The run of ``recipes`` (two or more that share a base: ``config.sweep.shared_base``) as several adapters
    over one base: its estimate and the first adapter's alone (``measure``: their step times too), on what
    ``gpu`` names (``speed.resolve_gpu``); where they do not all fit, the most of them that do."""
    from tiertune.config.sweep import shared_base

    if len(recipes) < 2:
        raise ConfigError("an estimate of several adapters takes two or more recipes (or a sweep: section)")
    recipes = [r.with_absolute_paths() for r in recipes]
    shared_base(recipes)
    first, rest = recipes[0], recipes[1:]
    whole = estimate(first, measure=measure, gpu=gpu, others=rest)
    one = estimate(first, measure=measure, gpu=gpu)
    tried = [(1, one.fits), (len(recipes), whole.fits)]
    more = 0
    if whole.fits:
        largest = len(recipes)
        held, has = _held(whole), _has(whole)
        per = (held - _held(one)) / (len(recipes) - 1)
        if has is not None and per > 0:
            more = int((has - held) // per)
    else:
        lo, hi = (1 if one.fits else 0), len(recipes) - 1  # the most that fit lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ok = estimate(first, measure=False, gpu=gpu, others=recipes[1:mid]).fits
            tried.append((mid, ok))
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        largest = lo
    return AdaptersEstimate(len(recipes), one, whole, largest, more, tried)


def _held(est: Estimate) -> int:
    """What the run holds where it computes (``Estimate.computes_on``: the GPU's or this machine's RAM)."""
    on = est.computes_on()
    return on[2] if on is not None else 0


def _has(est: Estimate) -> int | None:
    on = est.computes_on()
    return on[1] if on is not None else None


def _flops(n: float) -> str:
    return f"{n / 1e12:.3g} T" if n >= 1e12 else f"{n / 1e9:.3g} G"


def refusal(est: AdaptersEstimate) -> str | None:
    """Why a run of the estimate's adapters cannot start, naming the most that fit (None: they fit)."""
    if est.fits:
        return None
    on = est.all.computes_on()
    short = {t: est.all.needed(t) for t, tier in est.all.tiers.items() if est.all.needed(t) > tier.budget}
    if short:
        why = "; ".join(
            f"the {t} tier needs {format_size(n)} of its {format_size(est.all.tiers[t].budget)} budget"
            for t, n in short.items()
        )
    elif on is not None:
        why = f"they hold {format_size(on[2])} of {on[0]}'s {format_size(on[1])}"
    else:
        why = "; ".join(est.all.short_of_machine().values()) or "the budgets do not hold them"
    return (
        f"{est.recipes} adapters over one base do not fit ({why}); the most that do: {est.largest} (the first "
        f"{est.largest} recipes). Train fewer at once, lower their micro-batches, or raise the budgets"
    )


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
    lines.append(f"bytes read a step: {est.read_ratio:.2f}x one adapter's (the base streamed once for all)")
    if est.fits:
        on = whole.computes_on()
        where = f" of {on[0]}'s {format_size(on[1])}" if on is not None else ""
        lines.append(
            f"fits: {est.recipes} adapters hold {format_size(_held(whole))}{where}; about {est.more} more like "
            "them would fit"
        )
    else:
        lines.append(f"does not fit: {refusal(est)}")
    return "\n".join(lines)


__all__ = ["AdaptersEstimate", "estimate_adapters", "format_adapters", "refusal"]
