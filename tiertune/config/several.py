"""Whether several LoRA adapters fit over one base (``tiertune train a.yaml b.yaml``, ``sweep:``), checked before
anything is loaded, and the most of them that do: the engine's own step of the first k recipes' adapters on a
ledger (``engine.replay``: ``step_adapters`` over the store's placement, eviction and prefetch, under the first
recipe's budgets), and what the compute device then holds outside the store (each adapter's weights and AdamW
states, the wave's hidden states at the layer boundaries: every adapter's micro-batches). ``tiertune estimate``
gives the same verdict (``estimates.adapters``), beside its figures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tiertune.config.sweep import shared_engine
from tiertune.errors import BudgetError, StateError
from tiertune.units import format_size

if TYPE_CHECKING:
    from tiertune.config.plan import RunPlan


@dataclass
class Fit:
    """A step of the first ``adapters`` runs' adapters on a ledger: each tier's peak and each link's bytes in the
    step (empty: it could not run within the budgets, ``why``), and the device bytes outside the store."""

    adapters: int
    peaks: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)
    outside: int = 0
    why: str | None = None

    def held(self, on_gpu: bool) -> int:
        """What the compute device holds at the step's peak: its tier's and the bytes outside the store (on a
        CPU, the host tier's too: both are RAM)."""
        held = self.peaks.get("device", 0) + self.outside
        return held if on_gpu else held + self.peaks.get("host", 0)


@dataclass
class Fitting:
    """The most of the runs (the first k) whose adapters fit, every count tried, on what memory."""

    runs: int
    largest: int
    tried: list[Fit]
    limit: int  # bytes of the compute device: the GPU's, or this machine's RAM
    on_gpu: bool

    @property
    def fits(self) -> bool:
        return self.largest == self.runs

    def refusal(self) -> str | None:
        """Why the run cannot start, naming the most adapters that fit (None: all fit)."""
        if self.fits:
            return None
        whole = next(f for f in self.tried if f.adapters == self.runs)
        where = "the GPU" if self.on_gpu else "this machine's RAM"
        why = whole.why or (
            f"a step of them holds {format_size(whole.held(self.on_gpu))} of {where}'s {format_size(self.limit)}"
        )
        return (
            f"{self.runs} adapters over one base do not fit ({why}); the most that do: {self.largest} (the first "
            f"{self.largest} recipes). Train fewer at once, lower their micro-batches, or raise the budgets"
        )


def fitting(runs: list[RunPlan], gpu_memory: int | None = None) -> Fitting:
    """The most of ``runs`` (resolved recipes sharing a base) whose adapters fit over one base, computed on a
    GPU of ``gpu_memory`` bytes, else on this machine's CPU (its RAM): all of them first, then, where they do not
    fit, a search over the first k (each count replayed)."""
    import psutil

    on_gpu = gpu_memory is not None
    limit = gpu_memory if gpu_memory is not None else psutil.virtual_memory().total

    def fits(f: Fit) -> bool:
        return f.why is None and f.held(on_gpu) <= limit

    whole = fit(runs, len(runs), on_gpu)
    tried = [whole]
    if fits(whole):
        return Fitting(len(runs), len(runs), tried, limit, on_gpu)
    lo, hi = 0, len(runs) - 1  # the most that fit lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        f = fit(runs, mid, on_gpu)
        tried.append(f)
        lo, hi = (mid, hi) if fits(f) else (lo, mid - 1)
    return Fitting(len(runs), lo, tried, limit, on_gpu)


def fit(runs: list[RunPlan], k: int, on_gpu: bool) -> Fit:
    """The step of the first ``k`` runs' adapters replayed on a ledger under the first run's budgets."""
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
    outside = outside_bytes(model, cfg, wave, on_gpu, [], stash_chunks=cfg.activations == "host")
    lora = (
        sum(r.laid.trained for r in chosen) * 16
    )  # each adapter's fp32 weights, gradients and AdamW moments
    result = Fit(k, outside=sum(outside.values()) + lora)
    rows, tokens, micro = shapes[0]
    try:
        replayed = replaying.replay(
            first.recipe.model.path,
            dataclasses.replace(first.store, disk_budget=None),
            cfg,
            rows,
            tokens,
            micro,
            replaying.CLIPPED[:2],
            torch.device("cuda" if on_gpu else "cpu"),
            first.world,
            shapes=shapes if k > 1 else (),
        )
    except (BudgetError, StateError) as exc:  # the store's own refusal, as the run would meet it
        result.why = str(exc)
        return result
    result.peaks, result.moved = replayed.peaks, replayed.moved
    return result


__all__ = ["Fit", "Fitting", "fit", "fitting"]
