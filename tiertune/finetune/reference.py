"""A preference objective's reference for a full or GaLore fine-tune: the log-probabilities of every pair's
two completions under the initial weights, computed in one streamed pass over the data before the first
step (the weights as loaded, before any checkpoint is restored), and cached on disk.

The pass runs the rows in file order, ``per_device_train_batch_size`` pairs a micro-batch and
``gradient_accumulation_steps`` micro-batches a layer visit (``StreamedTrainer.sequence_logps``): the weights
are read once per visit, as a step reads them. The result, one fp32 pair per row, is cached in
``<offload.disk_path or training.output_dir>/reference-logps/<key>.safetensors``, where the key hashes what
the figures depend on (the model's config and weight files by name, size and modification time, its dtype and
quantization, the kernels, the objective's type, every token and label of the data), so a resumed or repeated
run reads them instead (written to a temporary name, synced, then renamed: a stopped pass leaves no file).
Each step's micro-batches then carry their rows' figures (``ref_logps``), as TRL's
``precompute_ref_log_probs`` does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import DataError
from tiertune.files import fsync_dir, fsync_file

log = logging.getLogger("tiertune.finetune")

CACHE_DIR = "reference-logps"


def hashed(model_dir: str, settings: list[Any], data: Any, columns: tuple[str, ...]) -> str:
    """A cache key: a hash of a model's config and weight files (by name, size and modification time), the
    ``settings`` (JSON) and every row of ``data``'s ``columns`` (token ids)."""
    h = hashlib.sha256()
    model = Path(model_dir)
    h.update(
        (model / "config.json").read_bytes() if (model / "config.json").is_file() else str(model).encode()
    )
    for path in sorted(model.glob("*.safetensors")) + sorted(model.glob("*.bin")):
        stat = path.stat()
        h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    h.update(json.dumps(settings).encode())
    for column in columns:
        for values in data.rows[column]:
            h.update(torch.tensor(values, dtype=torch.int64).numpy().tobytes())
            h.update(b"|")
    return h.hexdigest()[:32]


def cache_key(recipe: Any, data: Any) -> str:
    """A hash of everything the reference's figures depend on (the module's docstring)."""
    settings = [recipe.model.dtype, recipe.model.quantize, recipe.kernels, recipe.objective.type, len(data)]
    return hashed(
        recipe.model.path, settings, data, ("input_ids", "labels", "rejected_ids", "rejected_labels")
    )


def cache_path(recipe: Any, key: str) -> Path:
    """Where the reference of ``key`` is kept: beside the offload files, else in the run's directory."""
    root = Path(recipe.offload.disk_path or recipe.training.output_dir)
    return root / CACHE_DIR / f"{key}.safetensors"


def reference_logps(trainer: Any, data: Any, recipe: Any, pad_id: int, write: bool = True) -> torch.Tensor:
    """Every row's reference log-probabilities ([rows, 2]: chosen, rejected), read from the cache or computed
    by ``trainer`` as its weights are now (before the first step), then cached (``write``: this process writes
    the run's files)."""
    from safetensors.torch import load_file, save_file

    from tiertune.finetune.data import batches

    key = cache_key(recipe, data)
    path = cache_path(recipe, key)
    if path.is_file():
        try:
            cached = load_file(path)["logps"]
        except Exception:  # a damaged file: computed again and replaced
            log.warning(
                "the cached reference log-probabilities at %s cannot be read; computing them again", path
            )
        else:
            if cached.shape == (len(data), 2):
                log.info("reference log-probabilities read from %s", path)
                return cached
    t = recipe.training
    pairs = t.per_device_train_batch_size
    out = torch.full((len(data), 2), float("nan"))
    stream = batches(data, pairs, pad_id, shuffle=False, seed=0)
    per_visit = t.gradient_accumulation_steps
    total = -(-len(data) // pairs)
    done = 0
    while done < total:
        group = [next(stream) for _ in range(min(per_visit, total - done))]
        for batch, logps in zip(group, trainer.sequence_logps(group), strict=True):
            n = int(batch["pairs"])
            out[batch["rows"], 0], out[batch["rows"], 1] = logps[:n].float().cpu(), logps[n:].float().cpu()
        done += len(group)
        log.info("reference log-probabilities: %d of %d rows", min(done * pairs, len(data)), len(data))
    if torch.isnan(out).any():
        raise DataError("the reference pass left rows without log-probabilities (the data changed under it?)")
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"logps": out}, str(temporary), metadata={"key": key})
        fsync_file(temporary)
        temporary.replace(path)
        fsync_dir(path.parent)
        log.info("reference log-probabilities cached at %s", path)
    return out


def with_reference(
    stream: Iterator[dict[str, torch.Tensor]], logps: torch.Tensor
) -> Iterator[dict[str, torch.Tensor]]:
    """``stream``'s batches of pairs, each with its rows' reference log-probabilities (``ref_logps``: the
    chosen sequences', then the rejected ones', as the batch orders its rows)."""
    for batch in stream:
        rows = batch["rows"]
        yield {**batch, "ref_logps": torch.cat([logps[rows, 0], logps[rows, 1]])}


__all__ = ["cache_key", "cache_path", "hashed", "reference_logps", "with_reference"]
