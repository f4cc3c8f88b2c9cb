"""Micro-batches stacked into one batch for a layer's visit (``engine.schedule.LayerMajor.stacks``): whether a
layer may draw random numbers, and one call for several micro-batches' calls that differ only along the batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tiertune.engine.compute import Call


def draws_random(layer: nn.Module) -> bool:
    """Whether ``layer`` may draw random numbers in training: a dropout module, or a dropout probability an
    attention implementation reads (``attention_dropout``, ``dropout``), above 0 anywhere in it."""
    for module in layer.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for name in ("attention_dropout", "dropout"):
            value = getattr(module, name, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


def _same(a: object, b: object) -> bool:
    """Whether two leaves of a layer's call are the same value (tensors: shape and elements)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # an object without a plain equality
        return False


def stack_calls(calls: Sequence[Call], batches: Sequence[int]) -> Call | None:
    """One call for micro-batches of ``batches`` rows stacked along the batch, or None where their ``calls``
    differ otherwise: a tensor of two or more dimensions whose first is each micro-batch's batch (masks,
    position ids, rotary tables) is concatenated; every other leaf must be the same in all."""
    flat, spec = tree_flatten(calls[0])
    others = []
    for call in calls[1:]:
        leaves, other_spec = tree_flatten(call)
        if other_spec != spec:
            return None
        others.append(leaves)
    out = []
    for k, leaf in enumerate(flat):
        column = [leaf, *(leaves[k] for leaves in others)]
        batched = all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == b and t.shape[1:] == leaf.shape[1:]
            for t, b in zip(column, batches, strict=True)
        )
        if batched:
            out.append(torch.cat(column))
        elif all(_same(leaf, t) for t in column[1:]):
            out.append(leaf)
        else:
            return None
    return tree_unflatten(out, spec)


def first_fit(micro: Sequence[Any], limit: int, joins: Callable[[Any, Any], bool]) -> list[list[int]]:
    """``micro`` (indices) in stacks of at most ``limit`` tokens: each micro-batch joins the first stack whose
    first micro-batch it ``joins`` and that has room for it, else starts one."""
    groups: list[list[int]] = []
    tokens: list[int] = []
    for j, mb in enumerate(micro):
        n = math.prod(mb.shape[:-1])
        for g, group in enumerate(groups):
            if tokens[g] + n <= limit and joins(micro[group[0]], mb):
                group.append(j)
                tokens[g] += n
                break
        else:
            groups.append([j])
            tokens.append(n)
    return groups


__all__ = ["draws_random", "first_fit", "stack_calls"]
