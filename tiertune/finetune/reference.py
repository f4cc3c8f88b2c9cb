"""The reference of a full or GaLore fine-tune: the initial weights' log-probabilities, in one of two ways.

A preference objective's data is fixed: the log-probabilities of every pair's two completions are computed in
one streamed pass over the data before the first step (the weights as loaded, before any checkpoint is
restored), and cached on disk. GRPO's completions are new every generation: the initial weights stream beside
the policy (``ReferenceBeside``), a frozen trainer of ``model.path`` as it ships, and score each generation's
completions once.

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

import copy
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


def frozen_trainer(recipe: Any, world: Any, safe_point: Any = None) -> tuple[Any, Any]:
    """``recipe``'s model as a frozen trainer (nothing trained, no optimizer: a teacher, a reference), planned
    by ``config.plan.plan`` (within its share of the budgets where it runs beside the trained model:
    ``Recipe.beside``), and its store's settings."""
    from tiertune.config.plan import plan
    from tiertune.engine import StreamedTrainer

    store, engine = plan(recipe, world=world)
    engine = frozen_engine(engine)
    return StreamedTrainer(recipe.model.path, store, engine, safe_point=safe_point, world=world), store


def frozen_engine(engine: Any) -> Any:
    """``engine``'s settings for a frozen model: nothing trained, no optimizer, its passes' boundaries on the
    device, a plain objective (its heads are the pass's own)."""
    return dataclasses.replace(
        engine,
        method="frozen",
        overlap_optimizer="off",
        delay_update=False,
        activations="device",
        gradient_accumulation_steps=1,
        objective=dataclasses.replace(engine.objective, type="sft"),
    )


def disk_bytes(trainer: Any) -> int:
    """The bytes ``trainer``'s store has read from its disk so far."""
    return sum(v for link, v in trainer.store_stats().bytes_moved.items() if link.startswith("disk->"))


def reference_recipe(recipe: Any) -> Any:
    """The recipe GRPO's reference is planned with: the run's (its model, dtype, method and budgets: ``plan``
    gives it its share), its offload files in a directory of their own beside the run's."""
    out = copy.deepcopy(recipe)
    if out.offload.disk_path:
        out.offload = dataclasses.replace(
            out.offload, disk_path=str(Path(out.offload.disk_path) / "reference")
        )
    return out


@dataclass
class ReferenceBeside:
    """GRPO's reference for a full or GaLore fine-tune (``Recipe.reference_beside``): the initial weights
    (``model.path`` as it ships: a resumed run's reference is still them), a frozen trainer beside the policy
    within its share of the budgets, that scores each generation's completion tokens once (``score``: one pass
    over all its micro-batches, the weights read at most once a generation, what its budgets keep staying for
    the next; the reference does not change, so a generation's later iterations reuse the figures). ``seconds``, ``passes`` and ``disk_bytes`` count its
    passes."""

    trainer: Any
    temperature: float
    seconds: float = 0.0
    passes: int = 0
    disk_bytes: int = 0

    @classmethod
    def open(cls, recipe: Any, world: Any, safe_point: Any = None) -> ReferenceBeside:
        """The reference of ``recipe``'s run (built here: its weights streamed as the policy's are)."""
        trainer, _ = frozen_trainer(reference_recipe(recipe), world, safe_point)
        return cls(trainer, recipe.objective.temperature)

    def score(self, micro_batches: list[dict[str, Any]]) -> None:
        """Write into each micro-batch its completion tokens' log-probabilities under the reference at the
        sampling temperature (``ref_logps``: [rows, length - 1], as the policy's token losses)."""
        from tiertune.engine.grpo import token_logps_head

        began = time.perf_counter()
        before = disk_bytes(self.trainer)
        # a pass a generation, the same accesses each time: scheduled as steps, what its budgets keep stays
        figures = self.trainer.sequence_logps(micro_batches, token_logps_head(self.temperature), repeat=True)
        for mb, logps in zip(micro_batches, figures, strict=True):
            mb["ref_logps"] = logps
        self.seconds += time.perf_counter() - began
        self.passes += 1
        self.disk_bytes += disk_bytes(self.trainer) - before

    def close(self) -> None:
        """Free the reference's store."""
        self.trainer.close()


__all__ = [
    "ReferenceBeside",
    "cache_key",
    "cache_path",
    "disk_bytes",
    "frozen_engine",
    "frozen_trainer",
    "hashed",
    "reference_logps",
    "reference_recipe",
    "with_reference",
]
