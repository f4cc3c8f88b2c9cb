"""The longest sequence a recipe trains at within its budgets: ``data.max_seq_len`` searched with ``estimate``'s
own plan (doubled until it no longer fits, then bisected), so that the answer counts what the run counts: the
layer boundaries where the plan puts them, a layer's activations and temporaries (traced), the boundary
gradients and the loss chunk.

A length fits when every tier's needs are within its budget and what computes holds the rest: on a GPU, the
device tier's needs plus the bytes outside the store within the GPU's memory; on the CPU, the host and device
tiers' needs plus those bytes within this machine's RAM."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tiertune.config.recipe import Recipe


@dataclass
class Longest:
    """``tokens``: the longest ``data.max_seq_len`` (a multiple of ``multiple``) that fits, 0 when not even
    ``multiple`` does; ``tried``: each length estimated, with whether it fit and, if not, why not."""

    tokens: int
    batch: int  # per_device_train_batch_size: the rows of a micro-batch, each that long
    multiple: int
    tried: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"tokens": self.tokens, "batch": self.batch, "multiple": self.multiple, "tried": self.tried}


def why_not(est) -> str | None:
    """None when ``est`` (an ``Estimate``) fits as ``longest_sequence`` counts it; else the first reason."""
    for name, tier in est.tiers.items():
        if est.needed(name) > tier.budget:
            return f"the {name} tier needs {est.needed(name):,} B of its {tier.budget:,} B budget"
    on = est.computes_on()
    if on is not None and on[2] > on[1]:
        what, room, total = on
        return f"{what} has {room:,} B and the run needs {total:,} B there (the store's tiers and what is outside it)"
    return None


def longest_sequence(
    recipe: Recipe, gpu: str = "auto", multiple: int = 1024, limit: int = 1 << 22
) -> Longest:
    """The longest ``data.max_seq_len``, a multiple of ``multiple`` up to ``limit``, at which ``recipe`` fits
    (``why_not``), for ``gpu`` as ``estimate`` takes it. About 2 log2(limit / multiple) estimates at most."""
    from tiertune.estimates.report import estimate

    found = Longest(0, recipe.training.per_device_train_batch_size, multiple)

    def fits(tokens: int) -> bool:
        trial = copy.deepcopy(recipe)
        trial.data.max_seq_len = tokens
        reason = why_not(estimate(trial, measure=False, gpu=gpu))
        found.tried.append(
            {"tokens": tokens, "fits": reason is None, **({"why_not": reason} if reason else {})}
        )
        return reason is None

    if not fits(multiple):
        return found
    low, high = multiple, None
    while high is None and low < limit:  # double until a length does not fit
        if fits(min(2 * low, limit)):
            low = min(2 * low, limit)
        else:
            high = min(2 * low, limit)
    while high is not None and high - low > multiple:  # low fits, high does not
        mid = (low + high) // 2 // multiple * multiple
        low, high = (mid, high) if fits(mid) else (low, mid)
    found.tokens = low
    return found


__all__ = ["Longest", "longest_sequence", "why_not"]
