"""A distillation's teacher pass: before the first step, the teacher (``objective.teacher``, any model tiertune
reads, frozen: ``EngineConfig.method`` frozen) runs over the data once, and over the held-out set after it
(``data.eval_path``: its figures cached apart, for the evaluations), layer-major over waves of rows (each wave a
pass scheduled as a step: the first reads the weights, a later one what the budgets did not keep from the wave
before, so bytes per teacher token fall as the wave grows), and keeps per scored token its
``top_k`` most likely token ids, their log-probabilities and the log of the mass left outside them, all at
the objective's temperature (``kernels.ops.distill.topk_logprobs``).

The figures are cached in ``<offload.disk_path or training.output_dir>/teacher-topk/<key>/``, one file per wave
(``wave-<first row>.safetensors``: its rows' scored tokens in order, row after row, and each row's count),
written to a temporary name, synced and renamed, so a pass killed at any point restarts after its last
finished wave; ``key`` hashes what the figures depend on (the teacher's config and weight files by name, size
and modification time, its dtype and quantization, the kernels, ``top_k``, the temperature, the student's
vocabulary, every token and label of the data). Rows are scored alone, in file order, ``
per_device_train_batch_size`` a micro-batch; a packed or padded student batch's scored tokens are its rows'
in order, so each step's batches carry their rows' figures (``with_teacher``, ``engine.teacher``).

Teacher and student must share a tokenizer (the same vocabulary, token for token): said before any weight is
read. A teacher head wider than the student's (a padded vocabulary) keeps its extra tokens in the tail.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertune.engine.teacher import KEYS, topk_head
from tiertune.errors import ConfigError, DataError, DiskFullError
from tiertune.files import fsync_dir, fsync_file
from tiertune.finetune.checkpoint import is_disk_full
from tiertune.finetune.reference import disk_bytes, frozen_trainer, hashed
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

log = logging.getLogger("tiertune.finetune")

CACHE_DIR = "teacher-topk"
WAVE_ACTIVATION_SHARE = 4
"""A wave's boundaries (its rows' hidden states, held through the pass) take at most 1 / this of the device
budget when ``objective.teacher.wave_size`` is 0."""


@dataclass
class TeacherPass:
    """What a teacher pass did: the rows it scored now (0: all read from the cache), its scored tokens, its
    seconds, the bytes its store moved from disk, its waves and their rows."""

    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    disk_bytes: int = 0
    waves: int = 0
    wave_rows: int = 0
    copied_bytes: int = 0  # its store's copies from the host to the device

    def record(self) -> dict[str, Any]:
        """The pass as the run's log records it (``teacher_pass``)."""
        per_token = self.disk_bytes / self.tokens if self.tokens else 0.0
        return {
            "rows": self.rows,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens / self.seconds, 3) if self.seconds else 0.0,
            "disk_bytes": self.disk_bytes,
            "disk_bytes_per_token": round(per_token, 1),
            "host_to_device_bytes": self.copied_bytes,
            "waves": self.waves,
            "wave_rows": self.wave_rows,
        }


def check_tokenizers(student_path: str, teacher_path: str) -> None:
    """Refuse a teacher whose tokenizer is not the student's (ConfigError, before any weight is read)."""
    from transformers import AutoTokenizer

    try:
        student = AutoTokenizer.from_pretrained(student_path)
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"objective.teacher.path {teacher_path}: its tokenizer cannot be read ({exc})"
        ) from None
    if student.get_vocab() != teacher.get_vocab():
        ours, theirs = student.get_vocab(), teacher.get_vocab()
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=str)[:3]
        raise ConfigError(
            f"objective.teacher.path {teacher_path} has another tokenizer than model.path {student_path} "
            f"({len(theirs)} tokens against {len(ours)}; first differences {differ}): distillation compares "
            "the two models token by token, so use a teacher of the student's family (the same tokenizer)"
        )


def check_quantization(teacher: Any) -> None:
    """Refuse a teacher whose checkpoint is bitsandbytes-quantized under another ``objective.teacher.quantize``
    than its own (ConfigError naming the setting to change)."""
    path = Path(teacher.path) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "bitsandbytes":
        return
    ships = (
        q.get("bnb_4bit_quant_type", "nf4")
        if q.get("load_in_4bit")
        else "int8"
        if q.get("load_in_8bit")
        else None
    )
    if ships and teacher.quantize != ships:
        raise ConfigError(
            f"objective.teacher.path {teacher.path} holds weights quantized by bitsandbytes ({ships}): set "
            f"objective.teacher.quantize: {ships} (it is {teacher.quantize}) to read them as they are"
        )


def teacher_recipe(recipe: Any) -> Any:
    """The recipe the teacher is planned with: the run's, its model the teacher's, nothing trained (offload
    files in a directory of their own beside the run's)."""
    out = copy.deepcopy(recipe)
    t = recipe.objective.teacher
    out.model = dataclasses.replace(out.model, path=t.path, dtype=t.dtype, quantize=t.quantize)
    out.method = dataclasses.replace(out.method, type="lora")  # a frozen base: what plan() allows quantized
    if out.offload.disk_path:
        out.offload = dataclasses.replace(out.offload, disk_path=str(Path(out.offload.disk_path) / "teacher"))
    return out


def cache_key(recipe: Any, data: Any, vocab: int) -> str:
    """A hash of everything the teacher's figures depend on (the module's docstring)."""
    t, o = recipe.objective.teacher, recipe.objective
    settings = [t.dtype, t.quantize, recipe.kernels, o.top_k, o.temperature, vocab, len(data)]
    return hashed(t.path, settings, data, ("input_ids", "labels"))


def cache_dir(recipe: Any, key: str) -> Path:
    """Where the teacher's figures of ``key`` are kept: beside the offload files, else in the run's directory."""
    root = Path(recipe.offload.disk_path or recipe.training.output_dir)
    return root / CACHE_DIR / key


def scored_counts(data: Any) -> list[int]:
    """Each row's scored tokens (its labels after the first that are not ``IGNORE_INDEX``)."""
    return [sum(1 for v in labels[1:] if v != IGNORE_INDEX) for labels in data.rows["labels"]]


class TeacherCache:
    """A teacher pass's figures for every row of the data, in its wave files: ``of(rows)`` reads the rows' scored
    tokens' ``TopK`` tensors, one after the other, from the files (memory-mapped: what a batch reads, not the
    whole cache, is in host memory). A wave ``expect``-ed is one another rank writes: read once its file is
    there."""

    def __init__(
        self,
        directory: Path,
        counts: list[int],
        k: int,
        wait_s: float = 0.0,
        safe_point: Callable[[], None] | None = None,
    ) -> None:
        self.directory, self.k, self.wait_s = directory, k, wait_s
        self.safe_point = safe_point or (
            lambda: None
        )  # called while a wave another rank writes is waited for
        self.offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
        self.offsets[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        self.done = torch.zeros(len(counts), dtype=torch.bool)
        self._first = torch.full((len(counts),), -1, dtype=torch.int64)  # each row's wave: its first row
        self._open: dict[int, Any] = {}  # a wave's file, open (safetensors' safe_open)

    def read(self) -> int:
        """Index every complete wave file there (a damaged one is removed: its rows are scored again); returns
        the rows they cover."""
        from safetensors import SafetensorError, safe_open

        for path in sorted(self.directory.glob("wave-*.safetensors")):
            try:
                first = int(path.stem.removeprefix("wave-"))
                wave = safe_open(str(path), "pt")
                counts = wave.get_tensor("counts")
                shapes = [wave.get_slice(n).get_shape() for n in ("ids", "logps", "tail")]
                self._check(first, counts, shapes)
            except (SafetensorError, ValueError, KeyError, RuntimeError, OSError) as exc:
                log.warning("teacher figures %s cannot be read (%s): its rows are scored again", path, exc)
                path.unlink(missing_ok=True)
                continue
            self._open[first] = wave
            self._index(first, len(counts))
        return int(self.done.sum())

    def _check(self, first: int, counts: torch.Tensor, shapes: list[list[int]]) -> None:
        """Refuse a wave whose rows' counts or tensors are not the data's (ValueError)."""
        n = len(counts)
        expected = self.offsets[first + 1 : first + n + 1] - self.offsets[first : first + n]
        tokens = int(counts.sum()) if n else 0
        if (
            len(expected) != n
            or not torch.equal(expected, counts.long())
            or shapes != [[tokens, self.k], [tokens, self.k], [tokens]]
        ):
            raise ValueError("its rows do not match the data's")

    def _index(self, first: int, n: int) -> None:
        self._first[first : first + n] = first
        self.done[first : first + n] = True

    def expect(self, first: int, counts: list[int]) -> None:
        """A wave of rows from ``first`` that another rank writes (rank 0): ``of`` waits for its file."""
        self._index(first, len(counts))

    def write(
        self, first: int, counts: list[int], ids: torch.Tensor, logps: torch.Tensor, tail: torch.Tensor
    ) -> None:
        """A wave's figures, from row ``first``: written to its file (temporary name, sync, rename)."""
        from safetensors.torch import save_file

        tensors = {
            "counts": torch.tensor(counts, dtype=torch.int64),
            "ids": ids.contiguous(),
            "logps": logps.contiguous(),
            "tail": tail.contiguous(),
        }
        self._check(first, tensors["counts"], [list(ids.shape), list(logps.shape), list(tail.shape)])
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(first)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(temporary))
            fsync_file(temporary)
            temporary.replace(path)
        except Exception as exc:
            temporary.unlink(missing_ok=True)
            if is_disk_full(exc):
                raise DiskFullError(
                    f"no room left for the teacher's figures in {self.directory} ({int(counts_bytes(tensors)):,} bytes "
                    f"a wave; the waves written so far are kept and a new run continues after them): free space "
                    "there, or point offload.disk_path at a larger disk"
                ) from None
            raise
        fsync_dir(self.directory)
        self._index(first, len(counts))

    def _path(self, first: int) -> Path:
        return self.directory / f"wave-{first:09d}.safetensors"

    def _wave(self, first: int) -> Any:
        """A wave's file, open; one another rank writes is waited for (``wait_s``), then said missing."""
        from safetensors import safe_open

        if first not in self._open:
            path = self._path(first)
            deadline = time.monotonic() + self.wait_s
            while not path.is_file() and time.monotonic() < deadline:
                self.safe_point()  # a stop is not held up by the wait (up to the collective timeout)
                time.sleep(0.05)
            if not path.is_file():
                raise DataError(
                    f"the teacher's figures {path} are missing (removed during the run?): run again to score "
                    "its rows again"
                )
            self._open[first] = safe_open(str(path), "pt")
        return self._open[first]

    def of(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scored tokens' figures of ``rows``, one row after the other, read from their waves' files."""
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for r in rows:
            first = int(self._first[r])
            if first < 0:
                raise DataError(f"row {r} has no teacher figures: the teacher pass did not score it")
            base = int(self.offsets[first])
            lo, hi = int(self.offsets[r]) - base, int(self.offsets[r + 1]) - base
            wave = self._wave(first)
            parts.append(tuple(wave.get_slice(n)[lo:hi] for n in ("ids", "logps", "tail")))  # type: ignore[arg-type]
        if not parts:
            return (
                torch.empty(0, self.k, dtype=torch.int32),
                torch.empty(0, self.k),
                torch.empty(0),
            )
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]

    def carried(self, batches: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """``batches``, each with its scored tokens' figures (``with_teacher``)."""
        return list(with_teacher(iter(batches), self))

    @property
    def disk_bytes(self) -> int:
        """The bytes of the figures its wave files hold (their tensors)."""
        per_token = self.k * 8 + 4
        return int(self.offsets[-1]) * per_token


def counts_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """The bytes of a wave's tensors."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def wave_rows(recipe: Any, device_budget: int, hidden: int, itemsize: int) -> int:
    """Rows a teacher wave holds: ``objective.teacher.wave_size``, else as many as keep its boundaries (two
    hidden states a token) within ``1 / WAVE_ACTIVATION_SHARE`` of the device budget, whole micro-batches."""
    batch = recipe.training.per_device_train_batch_size
    asked = getattr(recipe.objective.teacher, "wave_size", 0)
    if asked:
        return max(batch, asked - asked % batch)
    per_row = 2 * recipe.data.max_seq_len * hidden * itemsize
    rows = device_budget // WAVE_ACTIVATION_SHARE // max(per_row, 1)
    return max(batch, min(rows - rows % batch, 4096))


def teacher_figures(
    recipe: Any, data: Any, pad_id: int, vocab: int, world: Any = None, safe_point: Any = None
) -> tuple[TeacherCache, TeacherPass]:
    """Every row's teacher figures of ``data`` (``teacher_figures_of`` of that one set)."""
    caches, stats = teacher_figures_of(recipe, [data], pad_id, vocab, world, safe_point)
    return caches[0], stats


def teacher_figures_of(
    recipe: Any, sets: Sequence[Any], pad_id: int, vocab: int, world: Any = None, safe_point: Any = None
) -> tuple[list[TeacherCache], TeacherPass]:
    """Every row's teacher figures of each of ``sets`` (the training data, then a held-out set's), a cache of
    each: read from the cache, the rows it lacks scored by the teacher (built once, when a set first lacks
    some, run and closed here, within the run's budgets; of several processes each runs the pass, its weights
    sharded as the student's, and rank 0 writes) wave by wave, each wave cached as it ends. ``TeacherPass``
    counts the rows scored now of all the sets."""
    from tiertune.distributed.world import World, collective_timeout

    check_quantization(recipe.objective.teacher)
    world = world or World.from_env()
    stats = TeacherPass()
    caches: list[TeacherCache] = []
    teacher: Any = None
    try:
        for n, data in enumerate(sets):
            cache = TeacherCache(
                cache_dir(recipe, cache_key(recipe, data, vocab)),
                scored_counts(data),
                recipe.objective.top_k,
                collective_timeout().total_seconds(),
                safe_point,
            )
            caches.append(cache)
            what = "the held-out set's " if n else ""
            done, rows = cache.read(), len(cache.done)
            if done == rows:
                log.info("teacher figures of %s%d rows read from %s", what, rows, cache.directory)
                continue
            if done:
                log.info(
                    "teacher pass: %d of %s%d rows cached in %s; scoring the rest",
                    done,
                    what,
                    rows,
                    cache.directory,
                )
            if teacher is None:
                teacher, store = frozen_teacher(recipe, vocab, world, safe_point)
                config = teacher.model.config.get_text_config(decoder=True)
                itemsize = torch.finfo(teacher.config.dtype).bits // 8
                stats.wave_rows = wave_rows(recipe, store.device_budget, config.hidden_size, itemsize)
                moved = _moved(teacher)
                began = time.perf_counter()
            _score(teacher, recipe, data, cache, stats, pad_id, vocab, world.is_main, (began, *moved))
    finally:
        if teacher is not None:
            teacher.close()
    return caches, stats


def carried_figures(
    recipe: Any, loaded: Any, stream: Iterator[dict[str, torch.Tensor]], world: Any, safe_point: Any = None
) -> tuple[
    Iterator[dict[str, torch.Tensor]], Callable[..., list[dict[str, torch.Tensor]]] | None, TeacherPass
]:
    """A run's teacher figures (``teacher_figures_of`` of ``loaded``'s data, then its held-out set): ``stream``'s
    batches carrying theirs (``with_teacher``), what gives an evaluation pass's batches theirs (None: no held-out
    set), and the pass."""
    from tiertune.loading.model import vocabulary_size

    sets = [loaded.data] if loaded.eval_data is None else [loaded.data, loaded.eval_data]
    vocab = vocabulary_size(recipe.model.path)
    caches, ran = teacher_figures_of(recipe, sets, loaded.pad_id, vocab, world, safe_point)
    return with_teacher(stream, caches[0]), (caches[1].carried if len(caches) > 1 else None), ran


def _score(
    teacher: Any,
    recipe: Any,
    data: Any,
    cache: TeacherCache,
    stats: TeacherPass,
    pad_id: int,
    vocab: int,
    write: bool,
    since: tuple[float, int, int],
) -> None:
    """The rows of ``data`` that ``cache`` lacks scored by ``teacher``, a wave (``stats.wave_rows`` rows) at a
    time, each wave written to the cache (by the process that ``write``-s; the others read it from there) and
    counted into ``stats`` (its seconds and bytes since ``since``: the pass's start and the teacher's store's
    bytes read from disk and copied to the device then)."""
    from tiertune.finetune.data import row_batches

    o = recipe.objective
    head = topk_head(o.top_k, o.temperature, vocab)
    counts = [int(n) for n in (cache.offsets[1:] - cache.offsets[:-1])]
    per_wave, batch = stats.wave_rows, recipe.training.per_device_train_batch_size
    for first in range(0, len(counts), per_wave):
        rows = list(range(first, min(first + per_wave, len(counts))))
        if bool(cache.done[rows].all()):
            continue
        figures = teacher.sequence_logps(row_batches(data, rows, batch, pad_id), head, repeat=True)
        ids, logps, tail = (
            torch.cat([getattr(f, n).cpu() for f in figures]) for n in ("ids", "logps", "tail")
        )
        wave_counts = [counts[r] for r in rows]
        if len(ids) != sum(wave_counts):
            raise DataError(
                "the teacher pass scored another number of tokens than the data holds (changed under it?)"
            )
        if write:
            cache.write(first, wave_counts, ids, logps, tail)
        else:  # rank 0 writes it: read from its file
            cache.expect(first, wave_counts)
        stats.rows += len(rows)
        stats.tokens += len(ids)
        stats.waves += 1
        read, copied = _moved(teacher)
        stats.seconds, stats.disk_bytes, stats.copied_bytes = (
            time.perf_counter() - since[0],
            read - since[1],
            copied - since[2],
        )
        log.info(
            "teacher pass: %s",
            json.dumps({"rows_done": int(cache.done.sum()), "of": len(counts), **stats.record()}),
        )


def _moved(trainer: Any) -> tuple[int, int]:
    """The bytes ``trainer``'s store has read from its disk and copied from the host to the device so far."""
    return disk_bytes(trainer), trainer.store_stats().bytes_moved.get("host->device", 0)


def frozen_teacher(recipe: Any, vocab: int, world: Any, safe_point: Any = None) -> tuple[Any, Any]:
    """The teacher as a frozen trainer planned within the run's budgets (``teacher_recipe``; beside the
    student, within its share of them: ``config.plan.BESIDE_SHARE``), and its store's settings; refused
    (ConfigError, the trainer closed) when its head has fewer tokens than the student's ``vocab``."""
    o = recipe.objective
    teacher, store = frozen_trainer(teacher_recipe(recipe), world, safe_point)
    heads = teacher.model.config.get_text_config(decoder=True).vocab_size
    if heads < vocab:
        teacher.close()
        raise ConfigError(
            f"objective.teacher.path {o.teacher.path}: its head has {heads} tokens, fewer than the "
            f"student's {vocab}; use a teacher of the student's family"
        )
    return teacher, store


class TeacherBeside:
    """The teacher beside the student (``objective.top_k: 0``): every step, before the student's, one frozen pass of
    the teacher over the step's micro-batches (its weights read at most once a step, layer by layer, for all of
    them; what its half of the budgets keeps stays for the next step), keeping at each scored token its last
    hidden state; the student's fused head makes the teacher's logits from them and the teacher's head (copied
    once: ``engine.teacher.WholeHead``) a chunk at a time, over the whole vocabulary. ``stats`` counts the
    passes as a ``TeacherPass`` (a wave a step)."""

    def __init__(self, recipe: Any, vocab: int, world: Any, safe_point: Any = None) -> None:
        from tiertune.engine.teacher import WholeHead

        check_quantization(recipe.objective.teacher)
        self.trainer, _ = frozen_teacher(recipe, vocab, world, safe_point)
        self.head = WholeHead(vocab)
        self.stats = TeacherPass()
        self._moved = _moved(self.trainer)

    def scored(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """``micro_batches`` (a step's, or a held-out pass's), each with its ``Full`` (``teacher``:
        ``engine.teacher.teacher_of``), scored in one pass."""
        return [{**b, "teacher": f} for b, f in zip(micro_batches, self.figures(micro_batches), strict=True)]

    def figures(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[Any]:
        """The teacher's ``Full`` of each micro-batch (one pass over its layers for all of them)."""
        began = time.perf_counter()
        # a pass a step, the same accesses each time: scheduled as steps, what its budgets keep stays
        out = self.trainer.sequence_logps(micro_batches, self.head, repeat=True)
        s = self.stats
        s.seconds += time.perf_counter() - began
        s.rows += sum(len(b["input_ids"]) for b in micro_batches)
        s.tokens += sum(len(f.hidden) for f in out)
        s.waves += 1
        s.wave_rows = max(s.wave_rows, sum(len(b["input_ids"]) for b in micro_batches))
        read, copied = _moved(self.trainer)
        s.disk_bytes, s.copied_bytes = read - self._moved[0], copied - self._moved[1]
        return out

    def close(self) -> None:
        """Free the teacher's store and its head's copy."""
        self.head.weight = self.head.bias = None
        self.trainer.close()


def beside_teacher(
    stream: Iterator[dict[str, torch.Tensor]], teacher: TeacherBeside, per_step: int
) -> Iterator[dict[str, torch.Tensor]]:
    """``stream``'s batches, ``per_step`` (a step's micro-batches) at a time scored by ``teacher`` in one pass
    before the first of them is handed on, each carrying its ``Full`` (``teacher``: ``engine.teacher.teacher_of``)."""
    while True:
        group = []
        for _ in range(per_step):
            try:
                group.append(next(stream))
            except StopIteration:
                break
        if not group:
            return
        yield from teacher.scored(group)


def with_teacher(
    stream: Iterator[dict[str, torch.Tensor]], cache: TeacherCache
) -> Iterator[dict[str, torch.Tensor]]:
    """``stream``'s batches, each with its scored tokens' teacher figures (``engine.teacher.KEYS``), from the
    rows each of its sequences holds (``row_ids``); a batch without targets (a rank's padding) carries none."""
    for batch in stream:
        labels = batch.get("labels", batch["input_ids"])
        scored = int((labels[:, 1:] != IGNORE_INDEX).sum())
        rows = [int(r) for r in batch["row_ids"].reshape(-1) if r >= 0] if scored else []
        figures = cache.of(rows)
        if len(figures[0]) != scored:
            raise DataError(
                f"a batch scores {scored} tokens where its rows' teacher figures cover {len(figures[0])}: the "
                f"teacher's cache in {cache.directory} is not this data's; remove it to score the data again"
            )
        yield {**batch, **dict(zip(KEYS, figures, strict=True))}


__all__ = [
    "TeacherBeside",
    "TeacherCache",
    "TeacherPass",
    "beside_teacher",
    "cache_dir",
    "cache_key",
    "carried_figures",
    "check_quantization",
    "check_tokenizers",
    "frozen_teacher",
    "teacher_figures",
    "teacher_figures_of",
    "teacher_recipe",
    "with_teacher",
]
