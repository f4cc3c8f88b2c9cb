"""What a distillation's teacher pass costs (``finetune.teacher``), for ``estimate``: the teacher's weights as the
pass streams them, its waves (each reads them once), the bytes read per scored token (falling as 1 / wave),
the cache on disk (``top_k`` x (4 + 4) + 4 bytes a scored token: ids, log-probabilities, the tail), and, with
rates measured, the pass's time: the longer of its reads at the disk's rate and its forward's FLOPs at the
compute rate the student's step is estimated with."""

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
    # beside, replayed on the teacher's own ledger store: the disk bytes of its first pass and of a later one
    # (what its half of the budgets keeps stays between steps); None: its weights once a wave
    pass_bytes: tuple[int, int] | None = None

    @property
    def waves(self) -> int:
        return max(1, math.ceil(self.rows / self.wave_rows))

    @property
    def read_bytes(self) -> int:
        """Bytes the pass reads: the weights once a wave (beside, replayed: the first pass's, then each later
        one's)."""
        if self.pass_bytes is not None:
            first, later = self.pass_bytes
            return first + later * (self.waves - 1)
        return self.weight_bytes * self.waves

    @property
    def bytes_per_token(self) -> float:
        return self.read_bytes / max(self.scored_tokens, 1)

    def bytes_per_token_at(self, wave_rows: int) -> float:
        """Bytes read per scored token were a wave ``wave_rows`` rows (the weights once a wave)."""
        return self.weight_bytes * max(1, math.ceil(self.rows / wave_rows)) / max(self.scored_tokens, 1)

    @property
    def cache_bytes(self) -> int:
        return 0 if self.beside else self.scored_tokens * (self.top_k * 8 + 4)

    def as_json(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_basis": self.basis,
            "wave_rows": self.wave_rows,
            "waves": self.waves,
            "rows": self.rows,
            "scored_tokens": self.scored_tokens,
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
        }


def teacher_estimate(recipe: Any, device_budget: int, rows: int, scored_tokens: int) -> TeacherEstimate:
    """The teacher pass of ``recipe`` over ``rows`` rows scoring ``scored_tokens`` tokens, its waves sized for
    ``device_budget`` as the run sizes them (``finetune.teacher.wave_rows``); beside the student (``top_k:
    0``), a wave a step of a step's rows, and its head's copy on the device."""
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
    if recipe.objective.beside:
        tr = recipe.training
        est.beside = True
        est.wave_rows = tr.per_device_train_batch_size * tr.gradient_accumulation_steps
        est.head_bytes = int(config.hidden_size * config.vocab_size * dtype.itemsize)
    else:
        est.wave_rows = wave_rows(recipe, device_budget, config.hidden_size, dtype.itemsize)
    return est


def time_teacher(est: TeacherEstimate, disk_read: float | None, compute_rate: float | None) -> None:
    """``est``'s seconds and bound: its reads at ``disk_read`` bytes/s and its forward (2 FLOPs a parameter a
    token, every token of a row counted as scored) at ``compute_rate`` FLOP/s; the longer is the bound."""
    parts = {}
    if disk_read:
        parts["disk"] = est.read_bytes / disk_read
    if compute_rate:
        parts["compute"] = 2 * est.parameters * est.scored_tokens / compute_rate
    if parts:
        est.bound = max(parts, key=parts.__getitem__)
        est.seconds = parts[est.bound]


def format_teacher(est: TeacherEstimate) -> list[str]:
    """The teacher pass's lines in ``estimate``'s report."""
    from tiertune.units import format_size

    if est.beside:
        passes = (
            f"read at most once a step of {est.wave_rows} rows (the first step {format_size(est.pass_bytes[0])}, "
            f"a later one {format_size(est.pass_bytes[1])} from the disk: what its half of the budgets keeps "
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
    lines = [
        f"teacher pass: {est.parameters / 1e9:.2f} B parameters, {format_size(est.weight_bytes)} of weights "
        f"({est.basis}) read once per wave of {est.wave_rows} rows: {est.waves} waves, "
        f"{format_size(est.read_bytes)} read, {est.bytes_per_token / 1e3:,.1f} kB per scored token "
        f"({est.scored_tokens:,} tokens of {est.rows:,} rows)",
        "teacher reads a scored token by the rows of a wave: "
        + ", ".join(
            f"{w}: {est.bytes_per_token_at(w) / 1e3:,.1f} kB" for w in sorted({1, 8, 64, est.wave_rows})
        )
        + " (objective.teacher.wave_size; larger waves hold more hidden states on the device)",
        f"teacher cache: {format_size(est.cache_bytes)} on disk (top {est.top_k}: {est.top_k * 8 + 4} bytes a "
        "scored token), kept for later runs of the same teacher and data",
    ]
    if est.seconds is not None:
        lines.append(f"teacher pass time: {est.seconds:,.0f} s ({est.bound}-bound)")
    return lines


__all__ = ["TeacherEstimate", "format_teacher", "teacher_estimate", "time_teacher"]
