"""A distillation's teacher as the student's step sees it: its figures at a micro-batch's scored tokens, carried
with the batch (``teacher_ids``, ``teacher_logps``, ``teacher_tail``: the scored tokens of its rows in order,
row after row, as ``finetune.teacher`` reads them from its cache), and the heads its own pass ends with
(``StreamedTrainer.sequence_logps`` with ``head``: the teacher is a frozen trainer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiertune.kernels.ops.distill import Full, TopK

KEYS = ("teacher_ids", "teacher_logps", "teacher_tail")
"""A batch's keys for its teacher's ``TopK``."""


def teacher_of(batch: dict[str, Any], device: torch.device) -> TopK | Full | None:
    """The teacher's figures a batch carries, on ``device`` (None: it carries none)."""
    if "teacher" in batch:  # the whole vocabulary: the teacher's hidden states and head, made in the step
        return batch["teacher"]
    if KEYS[0] not in batch:
        return None
    ids, logps, tail = (batch[k].to(device) for k in KEYS)
    return TopK(ids, logps, tail)


def cat_teachers(parts: Sequence[TopK | Full | None]) -> TopK | Full | None:
    """The figures of micro-batches stacked (their scored tokens one after the other)."""
    if any(p is None for p in parts):
        return None
    if isinstance(parts[0], Full):
        first = parts[0]
        return Full(torch.cat([p.hidden for p in parts]), first.weight, first.bias, first.softcap)  # type: ignore[union-attr]
    return TopK(*(torch.cat([getattr(p, f) for p in parts]) for f in ("ids", "logps", "tail")))


def topk_head(
    k: int, temperature: float, vocab: int | None = None
) -> Callable[[Any, Any, torch.Tensor], TopK]:
    """A frozen pass's head (``LayerMajor.sequence_logps``) that keeps a teacher's ``TopK`` of each micro-batch's
    scored tokens (the k among the first ``vocab`` tokens: the student's)."""

    def head(engine: Any, mb: Any, last: torch.Tensor) -> TopK:
        limit = vocab or engine.model.get_output_embeddings().weight.shape[0]
        return engine.loss.teacher_topk(mb.ids, mb.extra, mb.target, k, temperature, limit)

    return head


class WholeHead:
    """A frozen pass's head that keeps a teacher's ``Full`` of each micro-batch's scored tokens: its last hidden
    states there, with its head's first ``vocab`` rows (the student's tokens) copied once, when the pass first
    binds them (the teacher is frozen: the copy serves every later step; ``weight`` until then None)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, engine: Any, mb: Any, last: torch.Tensor) -> Full:
        got = engine.loss.teacher_hidden(mb.ids, mb.extra, mb.target)
        if self.weight is None:
            self.weight = got.weight[: self.vocab].detach().clone()
            self.bias = None if got.bias is None else got.bias[: self.vocab].detach().clone()
        return Full(got.hidden, self.weight, self.bias, got.softcap)


__all__ = ["KEYS", "WholeHead", "cat_teachers", "teacher_of", "topk_head"]
