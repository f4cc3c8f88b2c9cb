"""Checkpoints of a run, written atomically, and exact resume from them.

``checkpoint-<step>/`` in the run directory holds everything the next step depends on:

- ``state/``: the contents of every chunk of training state (weights, fp32 master weights, Adam moments,
  8-bit moments with their absmax, GaLore projections), read from wherever the store keeps them (device, host
  or disk), one chunk at a time: ``state/<chunk>.safetensors`` from one process, ``state/rank-<r>/`` from
  each rank of several (its shards only), and ``state/index.json``, where each tensor lies, which does not
  depend on the number of processes: a checkpoint resumes in any number (``state_index``);
- for LoRA: the adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``: the checkpoint
  directory loads with ``PeftModel.from_pretrained``) and ``adapter_optimizer.pt`` (weights and optimizer
  state as trained);
- ``rng_state.pth`` (``rng_state_<rank>.pth`` of several): Python's and torch's random states (CPU, CUDA);
- ``recipe.yaml``: the resolved recipe (``tiertune export`` and ``merge`` read it);
- ``trainer_state.json``: the step, the epoch, the micro-batches of data consumed, the engine's counters and
  the log history, as the Hugging Face Trainer names them;
- ``checksums.json``: the size and xxh3-64 of every other file, written last. ``verify`` checks them all
  before a resume, so a flipped bit, a truncated or missing file is found before it can train into a wrong
  model (``IntegrityError`` naming the file).

A checkpoint is written in the background (``CheckpointWriter``) into ``.checkpoint-<step>.partial/``, every
file fsynced, then renamed into place and the run directory fsynced: a crash at any moment leaves the
previous checkpoints intact and, at worst, a partial directory that the next run removes.
``save_total_limit`` keeps the newest complete ones. Before writing, the writer checks that the filesystem
has room for the checkpoint; a full disk is a ``DiskFullError`` with the bytes needed and free, and the
partial directory is removed at once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from tiertune.distributed.collectives import guarded
from tiertune.errors import ConfigError, DiskFullError, IntegrityError, StateError
from tiertune.files import fsync_dir, fsync_file, write_text_atomically
from tiertune.finetune.ranks import decided_by_main
from tiertune.finetune.state_index import INDEX_FILE, StateReader, merge, placements, rank_index
from tiertune.offload.disk import is_no_space
from tiertune.units import format_size

if TYPE_CHECKING:
    from tiertune.engine import StreamedTrainer

log = logging.getLogger("tiertune.checkpoint")

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
CHECKSUMS = (
    "checksums.json"  # {relative path: {"bytes": n, "xxh3_64": hex}} of every other file, written last
)
RECIPE_FILE = "recipe.yaml"  # the resolved recipe of the run, in the run directory and in each checkpoint
STOP_GRACE_S = 2.0
"""Seconds a run stopping for a signal gives the checkpoint being written to complete before it drops it (the
whole stop is to take a few seconds; a small checkpoint completes, a large one on a busy disk is dropped)."""
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_dirs(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Every ``checkpoint-<step>`` directory of a run directory, oldest first, complete or not (a complete one
    has its ``trainer_state.json``: one without was damaged, since a checkpoint is renamed into place whole)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first."""
    return [p for p in checkpoint_dirs(run_dir) if (p / STATE_FILE).is_file()]


def checkpoint_step(path: Path) -> int:
    """The step of a ``checkpoint-<step>`` directory, from its name."""
    match = _NAME.match(path.name)
    if match is None:
        raise ValueError(f"{path} is not named {PREFIX}<step>")
    return int(match.group(1))


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def partials(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint writes that were interrupted (``.checkpoint-<step>.partial``) and replaced checkpoints
    left behind (``.checkpoint-<step>.old`` beside their successor)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return [p for p in run_dir.glob(f".{PREFIX}*") if p.is_dir() and p.suffix in (".partial", ".old")]


def recover(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Put back a checkpoint that was being replaced by a new write of the same step when the process died
    between the two renames (``.checkpoint-<step>.old`` without ``checkpoint-<step>``); returns them."""
    restored = []
    for old in partials(run_dir):
        final = old.with_name(old.name[1:].removesuffix(".old"))
        if old.suffix == ".old" and not final.exists() and (old / STATE_FILE).is_file():
            os.replace(old, final)
            restored.append(final)
    return restored


def file_digest(path: Path) -> str:
    """xxh3-64 of a file's bytes, read in 8 MiB pieces."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


def checksum(path: Path) -> dict:
    """A file's entry in ``checksums.json``: its size and xxh3-64."""
    return {"bytes": path.stat().st_size, "xxh3_64": file_digest(path)}


def write_checksums(
    directory: Path, known: dict[str, dict] | None = None, going: Callable[[], None] = lambda: None
) -> None:
    """Record the size and xxh3-64 of every file under ``directory`` in its ``checksums.json``; those of
    ``known`` (relative path -> entry: the other ranks' files, hashed by them) are taken as they are.
    ``going`` is called before each file (it raises to stop the work)."""
    known = known or {}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    table = {}
    for p in files:
        going()
        name = str(p.relative_to(directory))
        table[name] = known.get(name) or checksum(p)
    (directory / CHECKSUMS).write_text(json.dumps(table, indent=1))


def read_state(path: Path) -> dict:
    """A ``trainer_state.json``; IntegrityError naming the file when it is missing or cannot be read."""
    if not path.is_file():
        raise IntegrityError(f"{path} is missing: the checkpoint is damaged")
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{path} cannot be read ({exc}): the checkpoint is damaged") from None
    if not isinstance(state, dict) or "global_step" not in state:
        raise IntegrityError(f"{path} is not a trainer state (no global_step): the checkpoint is damaged")
    return state


def verify(path: str | os.PathLike[str]) -> None:
    """Check every file of a checkpoint against its ``checksums.json``: present, of its size, of its hash.
    Raises IntegrityError naming the first damaged file. A checkpoint written before checksums existed is
    checked for its files only, and the log says it could not be verified."""
    path = Path(path)
    state = read_state(path / STATE_FILE)
    table_path = path / CHECKSUMS
    if not table_path.is_file():
        if state.get("tiertune", {}).get("checksums"):
            raise IntegrityError(f"{table_path} is missing: the checkpoint is damaged")
        log.warning("%s has no checksums (written by an older tiertune): its files are not verified", path)
        names = state.get("tiertune", {}).get("state_chunks", [])
        for name in names:
            file = path / "state" / f"{name}.safetensors"
            if not file.is_file() or file.stat().st_size == 0:
                raise IntegrityError(f"{file} is missing or empty: the checkpoint is damaged")
        return
    try:
        table = json.loads(table_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntegrityError(f"{table_path} cannot be read ({exc}): the checkpoint is damaged") from None
    for name, expected in table.items():
        file = path / name
        if not file.is_file():
            raise IntegrityError(f"{file} is missing: the checkpoint is damaged")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise IntegrityError(
                f"{file} has {size} bytes, {expected['bytes']} were written: the checkpoint is damaged"
            )
        if file_digest(file) != expected["xxh3_64"]:
            raise IntegrityError(f"{file} does not match its checksum: the checkpoint is damaged")


def checkpoint_bytes(trainer: StreamedTrainer) -> int:
    """The bytes a checkpoint of ``trainer`` takes on disk (its state chunks; the adapter is small)."""
    return sum(sum(t.nbytes for t in c.tensors) for c in trainer.state_chunks()) + (1 << 20)


def is_disk_full(exc: BaseException) -> bool:
    """Whether an error is a full filesystem (an OSError's ENOSPC, or safetensors' message for it)."""
    return is_no_space(exc) or "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


class CheckpointWriter:
    """Writes checkpoints on a background thread while training goes on.

    ``save`` snapshots the small parts (RNG states, counters, the LoRA adapter and its optimizer) at once and
    returns; the chunks of training state are written by the writer thread, in the order the next step's
    optimizer will change them. Before the optimizer changes a chunk (``capture``, called by the engine on
    its optimizer thread), a chunk not yet written is written first, by the thread that wants to change it:
    the checkpoint is the state of one step boundary, and no copy of the whole state is ever held. ``wait``
    blocks until the checkpoint is complete and re-raises the writer's error.

    Of several ranks, every rank calls ``save`` at the same step (it is a collective: rank 0 prepares the
    directory and checks the room for all); each writes its own shards into ``state/rank-<r>/`` and, once
    they are fsynced, ``state/rank-<r>.json`` (its pieces of the index and its files' checksums). Rank 0's
    writer waits for every rank's, merges them into ``state/index.json`` and ``checksums.json``, and commits.
    The writer threads exchange only files, never collectives; a rank that stops (killed, or failed) leaves
    the checkpoint uncommitted: rank 0 gives up once no rank has written a byte for the collective timeout,
    and the partial directory is removed.

    ``cancel`` drops the checkpoint being written: the writer stops at its next file (a chunk, a checksum, an
    fsync), its partial directory is removed, and the newest complete checkpoint stays the newest. A run
    stopping for a signal gives it ``STOP_GRACE_S`` to complete (``wait(within=...)``), then drops it:
    completing a large one on a busy disk could take minutes, and a stop must take seconds.
    """

    def __init__(self, trainer: StreamedTrainer, run_dir: str | os.PathLike[str], limit: int | None) -> None:
        self._trainer = trainer
        self._world = trainer.world
        self._run_dir = Path(run_dir)
        self._limit = limit
        self._cond = threading.Condition()
        self._state: dict[int, str] = {}  # chunk id -> "pending" | "writing" | "done", for the current save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._failed: BaseException | None = None  # the first failed chunk write of the current save
        self._files: dict[int, Path] = {}  # chunk id -> its file in the checkpoint being written
        self._abandoned = threading.Event()  # rank 0 stops waiting for the other ranks' parts
        self._cancelled = threading.Event()  # the checkpoint being written is dropped (``cancel``)
        self.blocked_s = 0.0  # time the training threads waited for chunks to be written first
        self.last: Path | None = None
        self.keep: Path | None = None  # a checkpoint save_total_limit does not remove (the best one)

    def save(self, trainer_state: dict, recipe_yaml: str | None = None, rollouts: Any = None) -> Path:
        """Start writing ``checkpoint-<global_step>`` (with the run's ``recipe.yaml``, when given; GRPO's
        generation in progress, ``rollouts``, when the next step trains it again); returns the path it will have
        once complete. Of several ranks, every rank calls it at the same step."""
        self.wait()
        self._cancelled.clear()  # a cancel or an abandon drops one checkpoint, not the ones after it
        self._abandoned.clear()
        trainer, world = self._trainer, self._world
        step = int(trainer_state["global_step"])
        final = self._run_dir / f"{PREFIX}{step}"
        tmp = self._run_dir / f".{PREFIX}{step}.partial"
        # room for it, counting the checkpoint of this step it replaces (a resumed run saving it again)
        needed = int(trainer.total(checkpoint_bytes(trainer), torch.int64))  # the ranks' parts, all of them

        def prepare() -> None:  # rank 0 (of several)
            shutil.rmtree(tmp, ignore_errors=True)
            free = shutil.disk_usage(self._run_dir).free + _size_of(final)
            if needed > free:
                raise self._disk_full(step, needed, free)
            try:
                (tmp / "state").mkdir(parents=True)
                if trainer.adapters is not None:  # small, in memory, replicated: written now
                    trainer.save_adapter(tmp)
                    torch.save(trainer.adapters.training_state(), tmp / "adapter_optimizer.pt")
                if recipe_yaml is not None:
                    (tmp / RECIPE_FILE).write_text(recipe_yaml)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if is_disk_full(exc):
                    raise self._disk_full(step, needed, shutil.disk_usage(self._run_dir).free) from None
                raise

        decided_by_main(world, prepare)
        own = tmp / "state" / f"rank-{world.rank}" if world.size > 1 else tmp / "state"
        try:
            own.mkdir(parents=True, exist_ok=True)
            torch.save(_rng_states(), tmp / rng_file(world.rank, world.size))
            if rollouts is not None:
                torch.save(rollouts, tmp / rollouts_file(world.rank, world.size))
        except BaseException as exc:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(exc):
                raise self._disk_full(step, needed, shutil.disk_usage(self._run_dir).free) from None
            raise
        trainer.settle()  # a delayed update in flight is the step's: its states as it leaves them
        chunks = trainer.state_chunks(in_update_order=True)
        placed = placements(trainer)
        self._files = {c.id: own / f"{c.name}.safetensors" for c in chunks if placed[c.id]}
        files = [
            (str(self._files[c.id].relative_to(tmp)), placed[c.id])
            for c in trainer.state_chunks()
            if c.id in self._files
        ]
        state = dict(trainer_state, tiertune=dict(trainer_state.get("tiertune", {}), **trainer.counters()))
        state["tiertune"]["checksums"] = CHECKSUMS
        state["tiertune"]["world_size"] = world.size
        self._needed = needed
        with self._cond:
            self._state = {c.id: "pending" for c in chunks}
            self._failed = None
        trainer.before_update = self.capture
        self._thread = threading.Thread(
            target=self._run,
            args=(chunks, rank_index(files), tmp, final, state),
            name="tiertune-checkpoint",
            daemon=True,
        )
        self._thread.start()
        return final

    def capture(self, chunks: tuple | list) -> None:
        """Make sure ``chunks`` are in the checkpoint before they change (on the calling thread if need be)."""
        began = time.perf_counter()
        for chunk in chunks:
            if self._claim(chunk):
                self._write(chunk)
        self.blocked_s += time.perf_counter() - began

    def wait(self, within: float | None = None) -> Path | None:
        """Block until the checkpoint being written is complete (or dropped, after ``cancel``); returns the
        newest one written (re-raises a write error). ``within``: seconds it may take to complete; past them
        it is dropped (``cancel``) and the wait ends as soon as its writer has cleaned up."""
        if self._thread is not None:
            self._thread.join(within)
            if self._thread.is_alive():
                self.cancel()
                self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and not isinstance(error, _Cancelled):
            raise error
        return self.last

    def cancel(self) -> None:
        """Drop the checkpoint being written, if one is (a run stopping for a signal): nothing more is written
        for it, and ``wait`` returns once its writer has removed the partial directory. Not committed: the
        checkpoints before it stay as they are. A later ``save`` writes its checkpoint as usual."""
        self._cancelled.set()
        self._abandoned.set()

    def abandon(self) -> None:
        """Stop waiting for the other ranks' parts of the checkpoint being written (a rank was lost: they will
        not come); it is not committed, the checkpoints before it stay as they are."""
        self._abandoned.set()

    def check(self) -> None:
        """Re-raise the writer's error now if it has failed (called after every step, so a failed write, a
        full disk say, stops the run at once rather than at the next save)."""
        if self._thread is not None and (self._failed is not None or not self._thread.is_alive()):
            self.wait()

    def _disk_full(self, step: int, needed: int, free: int) -> DiskFullError:
        return DiskFullError(
            f"no room for {PREFIX}{step} in {self._run_dir}: it needs {format_size(needed)} and the filesystem "
            f"has {format_size(free)} free; free space there, point training.output_dir at a larger disk, or "
            "keep fewer checkpoints (training.save_total_limit) or none (training.save_steps=0)"
        )

    def _claim(self, chunk) -> bool:
        """True if the caller is to write ``chunk`` now; waits while another thread writes it. Nothing more
        is written once a write has failed (nor a chunk of no tensors: a rank's empty share of a small one)."""
        with self._cond:
            while self._state.get(chunk.id) == "writing":
                self._cond.wait()
            if self._state.get(chunk.id) != "pending" or self._failed is not None or self._cancelled.is_set():
                return False
            if chunk.id not in self._files:
                self._state[chunk.id] = "done"
                return False
            self._state[chunk.id] = "writing"
            return True

    def _write(self, chunk) -> None:
        """Write one chunk's file; a failure is kept for the writer thread to report (an optimizer thread
        that writes a chunk first must not fail the training step for it)."""
        from safetensors.torch import save_file

        try:
            save_file(self._trainer.read_chunk(chunk), self._files[chunk.id])
        except BaseException as exc:
            with self._cond:
                self._failed = self._failed or exc
        finally:
            with self._cond:
                self._state[chunk.id] = "done"
                self._cond.notify_all()

    def _run(self, chunks: list, pieces: dict[str, dict], tmp: Path, final: Path, state: dict) -> None:
        world = self._world
        going = self._going
        try:
            for chunk in chunks:
                if self._claim(chunk):
                    self._write(chunk)
            going()
            if self._failed is not None:
                raise self._failed
            if world.size > 1:
                _hand_in(tmp, world.rank, world.size, pieces, going)
                if not world.is_main:
                    return  # rank 0 commits
                parts = _collect(tmp, world.size, state["global_step"], self._abandoned)
                index = merge([p["pieces"] for p in parts], world.size)
                known = {name: entry for p in parts for name, entry in p["checksums"].items()}
                for r in range(world.size):
                    (tmp / "state" / f"rank-{r}.json").unlink()
            else:
                index, known = merge([pieces], 1), {}
            (tmp / "state" / INDEX_FILE).write_text(json.dumps(index, indent=1))
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            write_checksums(tmp, known, going)
            _commit(tmp, final, self._run_dir, going)
            for stale in prune(self._run_dir, self._limit, self.keep):
                log.debug("removed %s (save_total_limit %d)", stale, self._limit)
            self.last = final
            log.info("saved %s", final)
        except BaseException as caught:  # re-raised by wait() on the training thread
            # dropped: whatever the writer stopped on (a rank's part that will not come, say)
            exc = _Cancelled() if self._cancelled.is_set() else caught
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # never a partial left behind by a failed write
            if is_disk_full(exc):
                step = int(state["global_step"])
                exc = self._disk_full(step, self._needed, shutil.disk_usage(self._run_dir).free)
            self._error = exc
        finally:
            self._trainer.before_update = None

    def _going(self) -> None:
        """Raise ``_Cancelled`` once the checkpoint being written has been dropped (between its files)."""
        if self._cancelled.is_set():
            raise _Cancelled


class _Cancelled(Exception):
    """The writer stopped because ``CheckpointWriter.cancel`` dropped the checkpoint it was writing."""


def rng_file(rank: int, world_size: int) -> str:
    """A process's random states in a checkpoint: ``rng_state.pth`` for one, ``rng_state_<rank>.pth`` of
    several (as the Hugging Face Trainer names them)."""
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def rollouts_file(rank: int, world_size: int) -> str:
    """A process's GRPO generation in progress in a checkpoint (its micro-batches, advantages and old
    log-probabilities: what the steps left of it train on)."""
    return "rollouts.pt" if world_size == 1 else f"rollouts_{rank}.pt"


def load_rollouts(path: str | os.PathLike[str], rank: int, world_size: int) -> Any:
    """The generation in progress a checkpoint holds for ``rank`` (None: the checkpoint is at a generation's
    boundary, or of another objective)."""
    file = Path(path) / rollouts_file(rank, world_size)
    if not file.is_file():
        return None
    return read_part(file, partial(torch.load, weights_only=True))


def _hand_in(
    tmp: Path, rank: int, world_size: int, pieces: dict[str, dict], going: Callable[[], None] = lambda: None
) -> None:
    """A rank's part done: its files fsynced, then ``state/rank-<r>.json`` (its index entries and its files'
    checksums) written under a temporary name and renamed, which tells rank 0 it is complete."""
    own = tmp / "state" / f"rank-{rank}"
    files = [*sorted(p for p in own.iterdir() if p.is_file()), tmp / rng_file(rank, world_size)]
    files += [f for f in (tmp / rollouts_file(rank, world_size),) if f.is_file()]
    checksums = {}
    for path in files:
        going()
        fsync_file(path)
        checksums[str(path.relative_to(tmp))] = checksum(path)
    fsync_dir(own)
    part = tmp / "state" / f"rank-{rank}.json"
    write_text_atomically(part, json.dumps({"pieces": pieces, "checksums": checksums}))


def _collect(tmp: Path, world_size: int, step: int, abandoned: threading.Event) -> list[dict]:
    """Every rank's hand-in (``_hand_in``), waited for as long as some rank keeps writing: StateError once
    none has written a byte for the collective timeout (a rank that died or failed), or at once when the
    training thread has ``abandoned`` the checkpoint."""
    from tiertune.distributed.world import collective_timeout

    patience = collective_timeout().total_seconds()
    parts: dict[int, dict] = {}
    seen, quiet_since, pause = -1, time.monotonic(), 0.02
    while True:
        for r in range(world_size):
            path = tmp / "state" / f"rank-{r}.json"
            if r not in parts and path.is_file():
                parts[r] = json.loads(path.read_text())
        if len(parts) == world_size:
            return [parts[r] for r in range(world_size)]
        written = _size_of(tmp)
        if written != seen:
            seen, quiet_since = written, time.monotonic()
        elif abandoned.is_set() or time.monotonic() - quiet_since > patience:
            missing = [r for r in range(world_size) if r not in parts]
            why = (
                "stopped" if abandoned.is_set() else f"wrote nothing for {patience:.0f} s (stopped or failed)"
            )
            raise StateError(
                f"{PREFIX}{step} was not written: rank(s) {missing} {why}; the checkpoints before it are intact"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _size_of(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _commit(tmp: Path, final: Path, run_dir: Path, going: Callable[[], None] = lambda: None) -> None:
    """fsync every file of ``tmp`` (the trainer state last), then rename it to ``final`` and fsync the run
    directory. An existing ``final`` (the same step saved again by a resumed run) is replaced whole.
    ``going`` is called before each fsync (it raises to stop before the rename; after it, nothing stops)."""
    for path in sorted(tmp.rglob("*"), key=lambda p: p.name == STATE_FILE):
        if path.is_file():
            going()
            fsync_file(path)
    going()
    fsync_dir(tmp / "state")
    fsync_dir(tmp)
    if final.exists():
        old = run_dir / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(run_dir)


def save_in_place(
    run_dir: str | os.PathLike[str],
    trainer_state: dict,
    write: Callable[[Path], None],
    recipe_yaml: str,
    limit: int | None,
    keep: Path | None = None,
) -> Path:
    """A checkpoint whose state is small and in memory (one adapter of several over one base), written now on
    the calling thread as ``CheckpointWriter`` commits its own: ``write(directory)`` puts the state's files in
    the partial directory, beside the random states, the recipe, an empty state index and the trainer state;
    then the checksums, fsync, rename, and ``save_total_limit``. A full disk is a DiskFullError and leaves the
    checkpoints before it as they were."""
    run_dir = Path(run_dir)
    step = int(trainer_state["global_step"])
    final, tmp = run_dir / f"{PREFIX}{step}", run_dir / f".{PREFIX}{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "state").mkdir(parents=True)
        write(tmp)
        torch.save(_rng_states(), tmp / rng_file(0, 1))
        (tmp / RECIPE_FILE).write_text(recipe_yaml)
        (tmp / "state" / INDEX_FILE).write_text(json.dumps(merge([rank_index([])], 1), indent=1))
        state = dict(trainer_state)
        state["tiertune"] = dict(state.get("tiertune", {}), checksums=CHECKSUMS, world_size=1)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        write_checksums(tmp)
        _commit(tmp, final, run_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            free = shutil.disk_usage(run_dir).free
            raise DiskFullError(
                f"no room for {final.name} in {run_dir} ({format_size(free)} free): free some space or set "
                "training.save_total_limit; the checkpoints before it are intact"
            ) from None
        raise
    for stale in prune(run_dir, limit, keep):
        log.debug("removed %s (save_total_limit %d)", stale, limit)
    log.info("saved %s", final)
    return final


def prune(run_dir: str | os.PathLike[str], limit: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``, but ``keep`` (the best one, with
    ``load_best_model_at_end``: kept beside the newest, as the Trainer keeps it); returns what was removed."""
    if not limit or limit < 1:
        return []
    stale = [path for path in checkpoints(run_dir)[:-limit] if keep is None or path.name != keep.name]
    for path in stale:
        shutil.rmtree(path)
    return stale


def load_checkpoint(trainer: StreamedTrainer, path: str | os.PathLike[str]) -> dict:
    """Put a checkpoint's state into a freshly built trainer of the same recipe; returns its trainer state.
    The checkpoint may have been written by another number of processes: each reads the ranges it holds
    (``state_index``). Of several ranks, every rank calls it (the check of the state is agreed on)."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(
            f"{path} is not a complete tiertune checkpoint (no {STATE_FILE}); point "
            "training.resume_from_checkpoint at a checkpoint-<step> directory, or use auto"
        )
    state = read_state(state_file)
    placed = placements(trainer)
    wanted = {p.key: (p.shape, p.dtype) for found in placed.values() for p in found}
    world = trainer.world
    if world.size > 1:  # every rank checks the whole state's names, so that all agree
        import torch.distributed as dist

        everyone: list[dict] = [{} for _ in range(world.size)]
        with guarded("all_gather_object"):
            dist.all_gather_object(everyone, wanted)
        wanted = {k: v for part in everyone for k, v in part.items()}
    with StateReader(path, state) as reader:
        reader.check(wanted)
        for chunk in trainer.state_chunks():
            with trainer.writing(chunk) as views:
                for p in placed[chunk.id]:
                    reader.read(p.key, p.start, p.end, views[p.name].reshape(-1))
    if trainer.adapters is not None:
        cfg = trainer.config
        blob = read_part(path / "adapter_optimizer.pt", partial(torch.load, weights_only=False))
        trainer.adapters.load_training_state(
            blob, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon
        )
    trainer.restore_counters(state["tiertune"])
    rng = [path / rng_file(world.rank, world.size), path / rng_file(0, 1), path / rng_file(0, 2)]
    found = next((f for f in rng if f.is_file()), rng[0])  # of another world size: rank 0's (or the only) one
    _set_rng_states(read_part(found, partial(torch.load, weights_only=False)))
    return state


def read_part(file: Path, reader: Callable[[Path], Any]) -> Any:
    """``reader(file)``, with any failure to read or parse it an IntegrityError naming the file."""
    if not file.is_file():
        raise IntegrityError(f"{file} is missing: the checkpoint is damaged")
    try:
        return reader(file)
    except Exception as exc:  # OS errors, and safetensors' and pickle's for a truncated or damaged file
        raise IntegrityError(
            f"{file} cannot be read ({type(exc).__name__}: {exc}): the checkpoint is damaged"
        ) from None


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
