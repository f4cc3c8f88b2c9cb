"""What a run of several LoRA adapters over one base needs (``tiertune estimate a.yaml b.yaml``, a recipe's
``sweep:``): the engine's own step of all of them on a ledger (``engine.replay``: ``step_adapters`` over the
store's placement, eviction and prefetch), beside the first recipe's step alone.

The bytes a step reads stay those of one adapter's step (the base streamed once for all); what grows with the
adapters is on the device: each adapter's weights and AdamW states, the wave's hidden states at the layer
boundaries (every adapter's micro-batches), a stack's activations. Where the adapters do not fit, the estimate
finds the most of them (the first k of the recipes) that do, each k replayed; where they fit, it says how many
more like the last would, from the growth per adapter between one and all of them (linear: each adapter adds
its own states and micro-batches)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch

from tiertune.config.recipe import Recipe
from tiertune.distributed.world import World
from tiertune.errors import BudgetError, ConfigError, StateError
from tiertune.estimates.speed import resolve_gpu
from tiertune.loading.hub import config_directory
from tiertune.units import format_size

READ_LINKS = ("disk->host", "host->device")
"""The links the base's read crosses each step (what ``read_ratio`` compares)."""


@dataclass
class Fit:
    """A step of the first ``adapters`` recipes' adapters on a ledger: each tier's peak and the bytes each link
    moved in the step (empty: it could not run within the budgets, ``why``), and the device bytes outside the
    store (the adapters' weights and states, the wave's boundaries and a layer's activations)."""

    adapters: int
    peaks: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)
    outside: int = 0
    why: str | None = None

    def device_bytes(self, on_gpu: bool) -> int:
        """What the compute device holds at the step's peak: its tier's and the bytes outside the store (on a
        CPU, the host tier's too: both are RAM)."""
        held = self.peaks.get("device", 0) + self.outside
        return held if on_gpu else held + self.peaks.get("host", 0)


@dataclass
class AdaptersEstimate:
    """Several adapters over one base: the run's step (``all``) beside the first adapter's alone (``one``), the
    memory the compute device has (``limit``: the GPU's, or this machine's RAM) and what fits."""

    recipes: int
    one: Fit
    all: Fit
    limit: int
    on_gpu: bool
    largest: int  # the most of the recipes (the first k) whose step fits
    more: int = 0  # of a run that fits: how many more adapters like the last would (linear in the adapters)
    tried: list[Fit] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.largest == self.recipes

    @property
    def read_ratio(self) -> float:
        """Bytes the step of all the adapters reads (``READ_LINKS``) over the first adapter's alone."""
        mine, one = (sum(f.moved.get(k, 0) for k in READ_LINKS) for f in (self.all, self.one))
        return mine / one if one else float("nan")

    def as_json(self) -> dict:
        def fit(f: Fit) -> dict:
            return {
                "adapters": f.adapters,
                "peak_bytes": f.peaks,
                "moved_per_step": f.moved,
                "outside_store_bytes": f.outside,
                "device_bytes": f.device_bytes(self.on_gpu),
                "why": f.why,
            }

        return {
            "adapters": self.recipes,
            "fits": self.fits,
            "largest_that_fits": self.largest,
            "more_that_fit": self.more,
            "read_ratio": round(self.read_ratio, 4),
            "memory_limit_bytes": self.limit,
            "one": fit(self.one),
            "all": fit(self.all),
            "tried": [fit(f) for f in self.tried],
        }


def estimate_adapters(recipes: list[Recipe], gpu: str = "auto") -> AdaptersEstimate:
    """The run of ``recipes`` (two or more that share a base: ``config.sweep.shared_base``) as several adapters
    over one base: its step and the first adapter's alone replayed on a ledger, what fits on the compute
    device (``gpu``: ``speed.resolve_gpu``'s choice) and, where they do not all fit, the most of them that do."""
    from tiertune.config.plan import resolve
    from tiertune.config.sweep import shared_base

    if len(recipes) < 2:
        raise ConfigError("an estimate of several adapters takes two or more recipes (or a sweep: section)")
    recipes = [copy.deepcopy(r).with_absolute_paths() for r in recipes]
    shared_base(recipes)
    for r in recipes:
        r.model.path = config_directory(r.model.path)
    target = resolve_gpu(gpu)
    device_type, memory_of = ("cuda", target.memory) if target is not None else ("cpu", None)
    runs = [resolve(r, World(), device_type, memory_of) for r in recipes]
    return fit_adapters(runs, target.memory if target is not None else None)


def fit_adapters(runs: list, gpu_memory: int | None = None) -> AdaptersEstimate:
    """What fits of ``runs`` (resolved recipes sharing a base) as adapters over one base: computed on a GPU of
    ``gpu_memory`` bytes, else on this machine's CPU (its RAM)."""
    import psutil

    on_gpu = gpu_memory is not None
    limit = gpu_memory if gpu_memory is not None else psutil.virtual_memory().total

    def fits(f: Fit) -> bool:
        return f.why is None and f.device_bytes(on_gpu) <= limit

    one, whole = _fit(runs, 1, on_gpu), _fit(runs, len(runs), on_gpu)
    tried = [one, whole]
    if fits(whole):
        largest = len(runs)
        per = (whole.device_bytes(on_gpu) - one.device_bytes(on_gpu)) / (len(runs) - 1)
        more = int((limit - whole.device_bytes(on_gpu)) // per) if per > 0 else 0
    else:
        more = 0
        lo, hi = (1 if fits(one) else 0), len(runs) - 1  # the most that fit lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            f = _fit(runs, mid, on_gpu)
            tried.append(f)
            lo, hi = (mid, hi) if fits(f) else (lo, mid - 1)
        largest = lo
    return AdaptersEstimate(len(runs), one, whole, limit, on_gpu, largest, more, tried)


def refusal(est: AdaptersEstimate) -> str | None:
    """Why a run of the estimate's adapters cannot start, naming the most that fit (None: they fit)."""
    if est.fits:
        return None
    where = "the GPU" if est.on_gpu else "this machine's RAM"
    why = est.all.why or (
        f"they hold {format_size(est.all.device_bytes(est.on_gpu))} of {where}'s {format_size(est.limit)}"
    )
    return (
        f"{est.recipes} adapters over one base do not fit ({why}); the most that do: {est.largest} (the first "
        f"{est.largest} recipes). Train fewer at once, lower their micro-batches, or raise the budgets"
    )


def _fit(runs: list, k: int, on_gpu: bool) -> Fit:
    """The step of the first ``k`` runs' adapters replayed on a ledger under the first run's budgets."""
    from tiertune.config.sweep import shared_engine
    from tiertune.engine import replay as replaying
    from tiertune.engine.activations import outside_bytes
    from tiertune.engine.prepare import meta_skeleton

    chosen = runs[:k]
    first = chosen[0]
    cfg = shared_engine(chosen, [2] * k) if k > 1 else first.engine
    shapes = [
        (
            r.recipe.training.per_device_train_batch_size,
            r.recipe.data.max_seq_len,
            r.recipe.training.gradient_accumulation_steps,
        )
        for r in chosen
    ]
    model = meta_skeleton(first.recipe.model.path, cfg.dtype)
    wave = sum(r.laid.wave for r in chosen)
    stash_chunks = cfg.activations == "host"
    outside = outside_bytes(model, cfg, wave, on_gpu, [], stash_chunks=stash_chunks)
    lora = (
        sum(r.laid.trained for r in chosen) * 16
    )  # each adapter's fp32 weights, gradients and AdamW moments
    fit = Fit(k, outside=sum(outside.values()) + lora)
    rows, tokens, micro = shapes[0]
    device = torch.device("cuda" if on_gpu else "cpu")
    try:
        replayed = replaying.replay(
            first.recipe.model.path,
            dataclasses.replace(first.store, disk_budget=None),
            cfg,
            rows,
            tokens,
            micro,
            replaying.CLIPPED[:2],
            device,
            first.world,
            shapes=shapes if k > 1 else (),
        )
    except (BudgetError, StateError) as exc:  # the store's own refusal, as the run would meet it
        fit.why = str(exc)
        return fit
    fit.peaks, fit.moved = replayed.peaks, replayed.moved
    return fit


def format_adapters(est: AdaptersEstimate, title: str) -> str:
    """The estimate as a table: one adapter's step beside all of theirs, then what fits."""
    where = "the GPU" if est.on_gpu else "this machine's RAM"
    lines = [title, f"{'':28}{'one adapter':>16}{f'{est.recipes} adapters':>16}"]
    for label, of in (
        ("device tier peak", lambda f: f.peaks.get("device", 0)),
        ("host tier peak", lambda f: f.peaks.get("host", 0)),
        ("outside the store (device)", lambda f: f.outside),
        ("read a step (disk, PCIe)", lambda f: sum(f.moved.get(k, 0) for k in READ_LINKS)),
    ):
        lines.append(f"{label:28}{format_size(of(est.one)):>16}{format_size(of(est.all)):>16}")
    lines.append(f"bytes read a step: {est.read_ratio:.2f}x one adapter's (the base streamed once for all)")
    held = est.all.device_bytes(est.on_gpu)
    if est.fits:
        lines.append(
            f"fits: {est.recipes} adapters hold {format_size(held)} of {where}'s {format_size(est.limit)}; "
            f"about {est.more} more like the last would fit"
        )
    else:
        lines.append(f"does not fit: {refusal(est)}")
    return "\n".join(lines)


__all__ = ["AdaptersEstimate", "Fit", "estimate_adapters", "fit_adapters", "format_adapters", "refusal"]
