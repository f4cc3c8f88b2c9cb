"""What a distillation's teacher pass costs (``finetune.teacher``), for ``estimate``: the teacher's weights as the
pass streams them, its waves over the data and then the held-out set (the first reads the weights; each later
one what the budgets do not keep from the one before, replayed on the teacher's own ledger store; unreplayed,
the weights once a wave), the bytes read per scored token (falling with the wave's rows), the cache on disk
(``top_k`` x (4 + 4) + 4 bytes a scored token: ids, log-probabilities, the tail), and, with rates measured, the
pass's time: the longer of its reads at the disk's rate and its forward's FLOPs at the compute rate the
student's step is estimated with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertune.offload.disk import slot_bytes

BLOCK = 1 << 20
"""The disk tier's checksum block (``StoreConfig.block_size``'s default)."""

QUANTIZED_BYTES = {"nf4": 0.5 + 4 / 64, "fp4": 0.5 + 4 / 64, "int8": 1.0 + 4 / 4096}
"""Bytes a decoder layer's linear weight takes a parameter, quantized on load (4 bits and an fp32 absmax per
block of 64; int8: a byte and a row scale)."""


@dataclass
class TeacherEstimate:
    """The teacher pass's figures (the module's docstring); ``rows`` and ``scored_tokens`` are the data's
    (counted as the run tokenizes it), ``seconds`` None unless rates were measured."""

    parameters: int
    weight_bytes: int
    basis: str  # how the weight bytes were counted
    wave_rows: int
    rows: int
    scored_tokens: int
    top_k: int
    seconds: float | None = None
    bound: str | None = None
    # ``top_k: 0``: the teacher beside the student, a wave a step (``wave_rows``: a step's rows), nothing cached;
    # its head's copy held on the device for the run (``engine.teacher.WholeHead``)
    beside: bool = False
    head_bytes: int = 0
    # replayed on the teacher's own ledger store: the disk bytes of its first passes, the last of them each later
    # one's (what its budgets, or beside its half of them, keep stays between waves or steps; the first pass
    # runs cold and without a trace, so the next ones differ); None: its weights once a wave
    pass_bytes: tuple[int, ...] | None = None
    pass_copied: tuple[int, ...] | None = None  # ... and the bytes each copied from the host to the device
    # the held-out set's rows and scored tokens (``data.eval_path``): scored in the same pass after the data's,
    # waves of their own, cached apart; beside, a pass of each evaluation's (priced with the evaluation)
    held_out_rows: int = 0
    held_out_tokens: int = 0

    @property
    def waves(self) -> int:
        """The pass's waves: the data's, then (cached top-k) the held-out set's."""
        held = 0 if self.beside else math.ceil(self.held_out_rows / self.wave_rows)
        return max(1, math.ceil(self.rows / self.wave_rows)) + held

    @property
    def cached_tokens(self) -> int:
        """The scored tokens the pass keeps figures of: the data's and the held-out set's (beside: none)."""
        return 0 if self.beside else self.scored_tokens + self.held_out_tokens

    @property
    def read_bytes(self) -> int:
        """Bytes the pass reads (``bytes_over`` its waves)."""
        return self.bytes_over(self.waves)

    @property
    def later_pass(self) -> int:
        """The disk bytes of a pass after the first ones (replayed; else the weights)."""
        return self.pass_bytes[-1] if self.pass_bytes is not None else self.weight_bytes

    def bytes_over(self, waves: int) -> int:
        """Bytes ``waves`` waves read: replayed, the first ones' as they were, then each later one's; else the
        weights once a wave."""
        if self.pass_bytes is None:
            return self.weight_bytes * waves
        return _over(self.pass_bytes, waves)

    def copied_per_token_at(self, wave_rows: int) -> float:
        """Bytes copied to the device per scored token of the data were a wave ``wave_rows`` rows (replayed)."""
        assert self.pass_copied is not None
        return _over(self.pass_copied, max(1, math.ceil(self.rows / wave_rows))) / max(self.scored_tokens, 1)

    @property
    def copied_bytes(self) -> int | None:
        """Bytes the pass copies from the host to the device (replayed; None: not)."""
        return None if self.pass_copied is None else _over(self.pass_copied, self.waves)

    @property
    def bytes_per_token(self) -> float:
        return self.read_bytes / max(self.scored_tokens + (0 if self.beside else self.held_out_tokens), 1)

    def bytes_per_token_at(self, wave_rows: int) -> float:
        """Bytes read per scored token of the data were a wave ``wave_rows`` rows (as ``read_bytes``)."""
        return self.bytes_over(max(1, math.ceil(self.rows / wave_rows))) / max(self.scored_tokens, 1)

    @property
    def cache_bytes(self) -> int:
        return self.cached_tokens * (self.top_k * 8 + 4)

    def as_json(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_basis": self.basis,
            "wave_rows": self.wave_rows,
            "waves": self.waves,
            "rows": self.rows,
            "scored_tokens": self.scored_tokens,
            "held_out_rows": self.held_out_rows,
            "held_out_scored_tokens": self.held_out_tokens,
            "read_bytes": self.read_bytes,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "cache_bytes": self.cache_bytes,
            "seconds": self.seconds,
            "bound": self.bound,
            "bytes_per_token_at_wave": {
                str(w): round(self.bytes_per_token_at(w), 1) for w in sorted({1, 8, 64, self.wave_rows})
            },
            "beside": self.beside,
            "head_bytes": self.head_bytes,
            "pass_bytes": list(self.pass_bytes) if self.pass_bytes is not None else None,
            "pass_copied_bytes": list(self.pass_copied) if self.pass_copied is not None else None,
            "copied_bytes": self.copied_bytes,
        }


def _over(passes: tuple[int, ...], waves: int) -> int:
    """The bytes of ``waves`` passes: the replayed ``passes``' first ones as they were, the last one's for each
    after them."""
    first = passes[:waves]
    return sum(first) + passes[-1] * (waves - len(first))


def teacher_estimate(
    recipe: Any, device_budget: int, rows: int, scored_tokens: int, held_out: tuple[int, int] = (0, 0)
) -> TeacherEstimate:
    """The teacher pass of ``recipe`` over ``rows`` rows scoring ``scored_tokens`` tokens (and ``held_out``'s
    rows and scored tokens, a held-out set's), its waves sized for ``device_budget`` as the run sizes them
    (``finetune.teacher.wave_rows``); beside the student (``top_k: 0``), a wave a step of a step's rows, and its
    head's copy on the device."""
    from tiertune.engine.prepare import meta_skeleton
    from tiertune.finetune.teacher import wave_rows
    from tiertune.loading.model import decoder_config, split_model

    t = recipe.objective.teacher
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(t.dtype, torch.bfloat16)
    model = meta_skeleton(t.path, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    files = sum(f.stat().st_size for f in Path(t.path).glob("*.safetensors"))
    if t.dtype == "auto" and t.quantize == "none" and files:
        weight_bytes, basis = files, "the checkpoint's files, read in place as they ship"
    else:
        # each group (a decoder layer, the embeddings, the head, the rest) one chunk of the disk tier: a slot's
        # header before its data, read with it
        per_param = QUANTIZED_BYTES.get(t.quantize)
        weight_bytes = 0
        for group in split_model(model).groups:
            if per_param is not None and group.kind == "layer":  # its matrices quantized, its norms not
                size = sum(
                    int(p.numel() * (per_param if p.dim() == 2 else dtype.itemsize))
                    for p in group.params.values()
                )
            else:
                size = group.numel * dtype.itemsize
            weight_bytes += slot_bytes(size, BLOCK)
        what = str(dtype).removeprefix("torch.")
        basis = f"{t.quantize} decoder-layer linear weights, the rest in {what}" if per_param else f"{what}"
        basis += ", homed on the disk tier"
    config = decoder_config(t.path)
    est = TeacherEstimate(parameters, weight_bytes, basis, 0, rows, scored_tokens, recipe.objective.top_k)
    est.held_out_rows, est.held_out_tokens = held_out
    if recipe.objective.beside:
        tr = recipe.training
        est.beside = True
        est.wave_rows = tr.per_device_train_batch_size * tr.gradient_accumulation_steps
        est.head_bytes = int(config.hidden_size * config.vocab_size * dtype.itemsize)
    else:
        est.wave_rows = wave_rows(recipe, device_budget, config.hidden_size, dtype.itemsize)
    return est


def time_teacher(
    est: TeacherEstimate,
    disk_read: float | None,
    compute_rate: float | None,
    host_to_device: float | None = None,
) -> None:
    """``est``'s seconds and bound: its reads at ``disk_read`` bytes/s, its copies to the device at
    ``host_to_device`` (replayed ones) and its forward (2 FLOPs a parameter a token, every token of a row
    counted as scored; the held-out set's too, cached top-k) at ``compute_rate`` FLOP/s; the longest is the
    bound."""
    parts = {}
    if disk_read:
        parts["disk"] = est.read_bytes / disk_read
    if host_to_device and est.copied_bytes is not None:
        parts["host_to_device"] = est.copied_bytes / host_to_device
    if compute_rate:
        tokens = est.scored_tokens + (0 if est.beside else est.held_out_tokens)
        parts["compute"] = 2 * est.parameters * tokens / compute_rate
    if parts:
        est.bound = max(parts, key=parts.__getitem__)
        est.seconds = parts[est.bound]


def time_beside_evaluation(
    est: TeacherEstimate, passes: int, disk_read: float | None, compute_rate: float | None
) -> float | None:
    """The seconds of the teacher beside's ``passes`` passes over a held-out set (an evaluation's): the longer
    of its later passes' reads at ``disk_read`` and its forward over the set's scored tokens at
    ``compute_rate`` (None without either rate)."""
    parts = []
    if disk_read and est.pass_bytes is not None:
        parts.append(passes * est.later_pass / disk_read)
    if compute_rate:
        parts.append(2 * est.parameters * est.held_out_tokens / compute_rate)
    return max(parts) if parts else None


def format_teacher(est: TeacherEstimate) -> list[str]:
    """The teacher pass's lines in ``estimate``'s report."""
    from tiertune.units import format_size

    if est.beside:
        passes = (
            f"read at most once a step of {est.wave_rows} rows (the first step {format_size(est.pass_bytes[0])}, "
            f"a later one {format_size(est.later_pass)} from the disk: what its half of the budgets keeps "
            "stays)"
            if est.pass_bytes is not None
            else f"read once a step of {est.wave_rows} rows"
        )
        lines = [
            f"teacher beside the student (top_k: 0): {est.parameters / 1e9:.2f} B parameters, "
            f"{format_size(est.weight_bytes)} of weights ({est.basis}) {passes}, "
            f"{est.bytes_per_token / 1e3:,.1f} kB per scored token, {format_size(est.read_bytes)} an epoch "
            f"({est.scored_tokens:,} tokens of {est.rows:,} rows); its head's copy {format_size(est.head_bytes)} "
            "on the device beside the two stores (each within half the budgets); nothing cached",
        ]
        if est.seconds is not None:
            lines.append(
                f"teacher time an epoch: {est.seconds:,.0f} s ({est.bound}-bound), beside the student's"
            )
        return lines
    tokens = f"{est.scored_tokens:,} tokens of {est.rows:,} rows" + (
        f", then the held-out set's {est.held_out_tokens:,} of {est.held_out_rows:,}"
        if est.held_out_rows
        else ""
    )
    if est.pass_bytes is not None:
        read = (
            f"from the disk the first wave reads {format_size(est.pass_bytes[0])}, a later one "
            f"{format_size(est.later_pass)} (what the budgets keep stays)"
        )
    else:
        read = "the weights read from the disk once per wave"
    copies = ""
    if est.pass_copied is not None and est.copied_bytes is not None:
        copies = (
            f"; to the device a wave copies {format_size(est.pass_copied[-1])} ({format_size(est.copied_bytes)} in "
            "all)"
        )
    sizes = sorted({1, 8, 64, est.wave_rows})
    if est.read_bytes or est.copied_bytes is None:
        by_wave = "teacher reads a scored token by the rows of a wave: " + ", ".join(
            f"{w}: {est.bytes_per_token_at(w) / 1e3:,.1f} kB" for w in sizes
        )
    else:  # nothing read again: the copies to the device are what a wave repeats
        by_wave = "teacher copies to the device a scored token by the rows of a wave: " + ", ".join(
            f"{w}: {est.copied_per_token_at(w) / 1e3:,.1f} kB" for w in sizes
        )
    lines = [
        f"teacher pass: {est.parameters / 1e9:.2f} B parameters, {format_size(est.weight_bytes)} of weights "
        f"({est.basis}) in {est.waves} waves of {est.wave_rows} rows: {read}, {format_size(est.read_bytes)} in "
        f"all, {est.bytes_per_token / 1e3:,.1f} kB per scored token{copies} ({tokens})",
        by_wave + " (objective.teacher.wave_size; larger waves hold more hidden states on the device)",
        f"teacher cache: {format_size(est.cache_bytes)} on disk (top {est.top_k}: {est.top_k * 8 + 4} bytes a "
        "scored token), kept for later runs of the same teacher and data",
    ]
    if est.seconds is not None:
        lines.append(f"teacher pass time: {est.seconds:,.0f} s ({est.bound}-bound)")
    return lines


__all__ = ["TeacherEstimate", "format_teacher", "teacher_estimate", "time_beside_evaluation", "time_teacher"]
