"""The run directory (``training.output_dir``): one run owns it at a time, and a run never mixes with another.

- **Lock.** A live run holds an exclusive ``flock`` on ``.tiertune.lock`` in the directory (as the disk tier
  locks its slot file): a second run on the same directory stops at once and names the first one's pid. The
  kernel drops the lock when the process dies, so ``kill -9`` never leaves a stale one.
- **Whose directory.** As with Hugging Face's ``output_dir``: a directory that holds another run's outputs (its
  log, recipe, checkpoints or model) or files that are not a run's is refused unless the run resumes from one
  of its checkpoints or ``training.overwrite_output_dir`` is set (the previous run's outputs are then removed;
  files tiertune did not write are left alone). ``resume_from_checkpoint: auto`` with no checkpoint starts
  over only where the directory holds the same run (its first checkpoint was never written).
- **Resume.** The checkpoint must be intact (every file against its checksum, ``checkpoint.verify``; ``auto``
  falls back to the newest intact one and says so), not past ``max_steps``, and written by the same run: a
  change of model, method, data, batch, optimizer or schedule is refused unless
  ``training.allow_recipe_changes``, and the message lists the settings that differ.

Nothing is written or removed until every check has passed (``RunDirectory.decide`` reads only;
``RunDirectory.prepare`` then acts), so a refused run leaves the directory as it was.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tiertune.config.recipe import Recipe, build, flatten
from tiertune.distributed.world import World
from tiertune.errors import ConfigError, IntegrityError, StorageError
from tiertune.finetune.checkpoint import (
    PREFIX,
    RECIPE_FILE,
    STATE_FILE,
    checkpoint_dirs,
    checkpoints,
    partials,
    read_state,
    verify,
)
from tiertune.finetune.evaluation import EarlyStopping

log = logging.getLogger("tiertune.train")

LOCK_FILE = ".tiertune.lock"
LOG_NAME = "trainer_log.jsonl"
LAUNCH_FILE = (
    "launch.json"  # the processes a run was launched on and its global micro-batch, beside its recipe
)

# what a run writes into its directory, besides its checkpoints: the log, the resolved recipe, the final
# trainer state, TensorBoard/W&B event files, and the exported model or adapter
_RUN_FILES = (LOG_NAME, RECIPE_FILE, LAUNCH_FILE, STATE_FILE, "runs", "wandb")
_MODEL_FILES = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json"
    r"|adapter_config\.json|adapter_model\.safetensors"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja)$"
)
_MARKS = {LOG_NAME, RECIPE_FILE, STATE_FILE, "config.json", "adapter_config.json"}  # "a run was here"

# settings a resumed run may change: where and how often it logs and saves, how far it goes, where its
# states live and which kernels compute (none of them changes what the steps already taken compute)
RESUMABLE_CHANGES = (
    "training.output_dir",
    "training.max_steps",
    "training.num_train_epochs",
    "training.save_steps",
    "training.save_total_limit",
    "training.logging_steps",
    "training.report_to",
    "training.eval_strategy",
    "training.eval_steps",
    "training.eval_on_start",
    "training.early_stopping_patience",
    "training.early_stopping_threshold",
    "training.load_best_model_at_end",
    "training.metric_for_best_model",
    "data.eval_path",
    "training.resume_from_checkpoint",
    "training.overwrite_output_dir",
    "training.allow_recipe_changes",
    "offload.",
    "kernels",
)


@dataclass
class Decision:
    """What a run does with its directory: start (``resume`` None) or resume from ``resume`` at ``step``;
    ``clear`` says the previous run's outputs are removed first; ``notes`` are said to the user."""

    resume: Path | None = None
    step: int = 0
    clear: bool = False
    notes: tuple[str, ...] = ()


def _batch_split(
    changes: list[tuple[str, Any, Any]], recipe: Recipe, counters: dict, ranks: int
) -> tuple[list[tuple[str, Any, Any]], str, str]:
    """The changes of a resumed run, counting the global micro-batch (per-device batch x ranks) rather than
    its split: a run launched on another number of processes continues the same steps when the per-device
    batch times the ranks is what it was (elastic resume). Returns the changes, a note when the split
    changed, and the setting that keeps the batch when the batch changed. ``counters``: the checkpoint's
    trainer state's ``tiertune`` part (the processes and rows that wrote it)."""
    key = "training.per_device_train_batch_size"
    per_device = recipe.training.per_device_train_batch_size
    then_per_device = next((a for k, a, _ in changes if k == key), per_device)
    ranks_then = int(counters.get("world_size", 1))
    rows_then = int(counters.get("rows_per_micro_batch", then_per_device * ranks_then))
    rows = per_device * ranks
    others = [c for c in changes if c[0] != key]
    if ranks == ranks_then:
        return changes, "", ""
    if rows == rows_then:
        note = (
            f"resuming on {ranks} process(es) a run written by {ranks_then}: the global micro-batch stays "
            f"{rows} rows ({per_device} per device x {ranks})"
        )
        return others, note, ""
    split = (
        "global micro-batch (per_device_train_batch_size x processes)",
        f"{then_per_device} x {ranks_then}",
        f"{per_device} x {ranks}",
    )
    keep = (
        f" (to keep its {rows_then} rows on {ranks} process(es): {key}={rows_then // ranks})"
        if rows_then % ranks == 0
        else ""
    )
    return [*others, split], "", keep


def model_files(directory: Path) -> list[str]:
    """The files of a model or adapter in ``directory`` (weights, index, configs), by name."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and _MODEL_FILES.match(p.name))


def lock_holder(lock_file: Path) -> str | None:
    """The pid of the live run holding ``lock_file`` (``LOCK_FILE`` of a run directory), or None when no run
    holds it (nor when it does not exist)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunDirectory:
    """``training.output_dir`` for the life of one run: locked on ``open``, checked by ``decide``, made ready by
    ``prepare``, unlocked by ``close``."""

    def __init__(self, path: str | os.PathLike[str], ranks: int = 1) -> None:
        """``ranks``: the processes of the launch that runs in it (its global batch is theirs together)."""
        self.path = Path(path)
        self.ranks = ranks
        self._fd: int | None = None
        self._made: list[Path] = []  # the directories ``open`` made (``__exit__`` removes them if unused)

    # ---------------------------------------------------------------- the lock

    def open(self) -> RunDirectory:
        """Create the directory if need be and take its lock; ConfigError when another run holds it."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(
                f"training.output_dir {self.path} is a file, not a directory; choose a directory for the run"
            )
        try:
            self._made = [p for p in (self.path, *self.path.parents) if not p.exists()]
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(
                f"cannot use training.output_dir {self.path}: {exc.strerror or exc}; choose a writable directory"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(
                    f"training.output_dir {self.path} is in use by another tiertune run (pid {holder}); wait "
                    "for it to finish, stop it, or choose another training.output_dir"
                ) from None
            raise StorageError(f"cannot lock {self.path / LOCK_FILE}: {exc.strerror or exc}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def close(self) -> None:
        """Release the lock (the lock file stays: removing it could let two runs lock different files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirectory:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.remove_if_unused()

    def remove_if_unused(self) -> None:
        """Remove the directories ``open`` made when nothing but its lock file was written into them (a run
        refused before it started leaves no empty output_dir behind)."""
        if not self._made or [p.name for p in self.path.iterdir()] != [LOCK_FILE]:
            return
        with contextlib.suppress(OSError):  # a file appeared meanwhile (another run's): the directory stays
            (self.path / LOCK_FILE).unlink()
            for made in self._made:  # deepest first; rmdir refuses a directory that is not empty
                made.rmdir()
        self._made = []

    # ---------------------------------------------------------------- what it holds

    def holds_run(self) -> bool:
        """Whether a run wrote here: its log, recipe, trainer state, a checkpoint or a model."""
        return any((self.path / name).exists() for name in _MARKS) or bool(self._checkpoint_dirs())

    def is_run(self) -> bool:
        """Whether a run wrote here (its log, recipe, trainer state, lock or a checkpoint), not only a model."""
        marks = (LOG_NAME, RECIPE_FILE, STATE_FILE, LOCK_FILE)
        return any((self.path / name).exists() for name in marks) or bool(self._checkpoint_dirs())

    def foreign(self) -> list[str]:
        """Entries a run did not write (nor its lock, partial checkpoints and exports)."""
        out = []
        for entry in sorted(self.path.iterdir()) if self.path.is_dir() else []:
            name = entry.name
            ours = (
                name == LOCK_FILE
                or name in _RUN_FILES
                or _MODEL_FILES.match(name)
                or name.startswith((PREFIX, f".{PREFIX}", ".export-", f".{LOG_NAME}", f".{RECIPE_FILE}"))
            )
            if not ours:
                out.append(name)
        return out

    def _checkpoint_dirs(self) -> list[Path]:
        return [p for p in self.path.glob(f"{PREFIX}*") if p.is_dir()] if self.path.is_dir() else []

    def finished_at(self) -> int | None:
        """The step a finished run ended at (its final ``trainer_state.json``), or None."""
        path = self.path / STATE_FILE
        if not path.is_file():
            return None
        try:
            return int(read_state(path)["global_step"])
        except (IntegrityError, KeyError, TypeError, ValueError):
            return None

    def _stopped_early(self, recipe: Recipe) -> bool:
        """Whether early stopping ended the finished run, and would end it again at once under ``recipe``'s
        settings (its log's evaluations use up their patience)."""
        try:
            state = read_state(self.path / STATE_FILE)
        except IntegrityError:
            return False
        rule = EarlyStopping.of(recipe, state.get("log_history") or [])
        return bool(state.get("stopped_early")) and 0 < rule.patience <= rule.waited

    # ---------------------------------------------------------------- the decision

    def decide(self, recipe: Recipe, max_steps: int) -> Decision:
        """What the run will do here, after every check (reads only; raises ConfigError or IntegrityError)."""
        t = recipe.training
        setting = t.resume_from_checkpoint
        if setting and setting != "auto":
            path = Path(setting)
            if not path.exists():
                raise ConfigError(
                    f"training.resume_from_checkpoint {setting} does not exist; use auto (the newest checkpoint "
                    f"in the run directory) or one of: {self._names() or 'none in ' + str(self.path)}"
                )
            if not (path / STATE_FILE).is_file() and checkpoint_dirs(path.parent).count(path):
                raise IntegrityError(
                    f"{path / STATE_FILE} is missing: the checkpoint is damaged; use auto (the newest intact "
                    f"checkpoint), or one of: {self._names() or 'none in ' + str(self.path)}"
                )
            if not (path / STATE_FILE).is_file():
                raise ConfigError(
                    f"training.resume_from_checkpoint {setting} is not a complete checkpoint (no {STATE_FILE}); "
                    f"use auto, or one of: {self._names() or 'none in ' + str(self.path)}"
                )
            verify(path)  # a damaged checkpoint named on purpose is an error naming the file
            return self._resume(recipe, path, max_steps, (), auto=False)
        if setting == "auto":
            notes: list[str] = []
            for path in reversed(checkpoint_dirs(self.path)):
                try:
                    verify(path)  # one without its trainer state is damaged too (IntegrityError naming it)
                except IntegrityError as exc:
                    notes.append(f"{path.name} is damaged ({exc}); trying the one before it")
                    log.warning("%s is damaged: %s", path, exc)
                    continue
                if notes:
                    notes.append(f"resuming from {path.name}, the newest intact checkpoint")
                return self._resume(recipe, path, max_steps, tuple(notes), auto=True)
            if notes:
                raise IntegrityError(
                    f"every checkpoint in {self.path} is damaged ({'; '.join(notes)}); start over with "
                    "training.overwrite_output_dir=true (the damaged checkpoints are removed)"
                )
            if self.holds_run() and not t.overwrite_output_dir and not self.before_first_step():
                self._check_same_run(recipe)
            return Decision(clear=self.holds_run(), notes=self._restart_note())
        if t.overwrite_output_dir:
            return Decision(clear=self.holds_run())
        if (
            self.holds_run()
            and not checkpoints(self.path)
            and self.finished_at() is None
            and not self.foreign()
        ):
            # this run's own start, stopped before its first checkpoint: nothing to resume, start it over; a
            # start that failed before its first step (a budget, a data file to fix) is anyone's to start over
            if not self.before_first_step():
                self._check_same_run(recipe)
            return Decision(clear=True, notes=self._restart_note())
        if self.holds_run() or self.foreign():
            raise ConfigError(self._taken_message(None))
        return Decision()

    def _resume(
        self, recipe: Recipe, path: Path, max_steps: int, notes: tuple[str, ...], auto: bool
    ) -> Decision:
        state = read_state(path / STATE_FILE)
        step = int(state["global_step"])
        finished = self.finished_at()
        if auto and finished is not None and self._stopped_early(recipe):
            raise ConfigError(
                f"the run in {self.path} stopped early at step {finished}: its {recipe.best_metric[0]} did not improve in "
                f"{recipe.training.early_stopping_patience} evaluations (training.early_stopping_patience); "
                f"nothing to resume: to train further from {path.name}, raise early_stopping_patience (or set "
                "it 0), or start over with training.overwrite_output_dir=true"
            )
        if auto and finished is not None and finished >= max_steps:  # a path named on purpose runs again
            raise ConfigError(
                f"the run in {self.path} already finished at step {finished} (training.max_steps {max_steps}); "
                f"nothing to resume: raise training.max_steps to train further from {path.name}, or start over "
                "with training.overwrite_output_dir=true"
            )
        if step > max_steps:
            raise ConfigError(
                f"{path.name} is at step {step}, past training.max_steps {max_steps}: a resumed run continues "
                f"after its checkpoint; raise training.max_steps above {step}, resume an earlier checkpoint "
                "with training.resume_from_checkpoint=PATH, or start over with training.overwrite_output_dir=true"
            )
        changes, note, hint = _batch_split(
            self.changes(recipe, path), recipe, state.get("tiertune", {}), self.ranks
        )
        notes += (note,) if note else ()
        if changes and not recipe.training.allow_recipe_changes:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
            raise ConfigError(
                f"{path} was written by another run: {listed}. A resumed run must be the same run: resume with the "
                f"recipe that wrote it{hint}, set training.allow_recipe_changes=true to continue with these changes, "
                "or start a new run in another training.output_dir (or with training.overwrite_output_dir=true)"
            )
        if changes:
            notes += (f"resuming with changed settings: {', '.join(k for k, _, _ in changes)}",)
        return Decision(resume=path, step=step, notes=notes)

    def changes(self, recipe: Recipe, checkpoint: Path) -> list[tuple[str, Any, Any]]:
        """The settings that make a run (all but ``RESUMABLE_CHANGES``) on which ``recipe`` and the recipe
        that wrote ``checkpoint`` differ: ``(key, then, now)``."""
        return _differences(recipe, checkpoint / RECIPE_FILE) or []

    def _check_same_run(self, recipe: Recipe) -> None:
        """ConfigError unless the directory's recipe is ``recipe``'s run (started, then stopped before its first
        checkpoint), counting the global micro-batch, not its split over the processes (``LAUNCH_FILE``)."""
        changes = _differences(recipe, self.path / RECIPE_FILE)
        if changes is None:  # no readable recipe: another run's outputs, or not a run's
            raise ConfigError(self._taken_message("it has no checkpoint to resume"))
        changes, _, hint = _batch_split(changes, recipe, _launch(self.path), self.ranks)
        if changes:
            listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
            raise ConfigError(
                f"training.output_dir {self.path} holds the start of another run (stopped before its first "
                f"checkpoint): {listed}. Start it with the recipe that made it{hint}, choose another "
                "training.output_dir, or set training.overwrite_output_dir=true to start this one there"
            )

    def before_first_step(self) -> bool:
        """Whether the directory holds only the start of a run that stopped before its first step: no
        checkpoint, model or final state, and no step in its log (nothing anyone could lose by starting over)."""
        if (
            checkpoints(self.path)
            or self._checkpoint_dirs()
            or self.finished_at() is not None
            or self.foreign()
        ):
            return False
        if any((self.path / name).exists() for name in ("config.json", "adapter_config.json")):
            return False
        log_path = self.path / LOG_NAME
        try:
            lines = log_path.read_text().splitlines() if log_path.exists() else []
        except OSError:
            return False
        return not any(line.strip() for line in lines)

    def _restart_note(self) -> tuple[str, ...]:
        if not self.holds_run():
            return ()
        if self.before_first_step():
            return (f"{self.path} holds a run that stopped before its first step: starting over from step 1",)
        return (f"{self.path} holds this run's start but no checkpoint: starting over from step 1",)

    def _names(self) -> str:
        return ", ".join(str(p) for p in checkpoints(self.path))

    def _taken_message(self, why: str | None) -> str:
        if self.holds_run():
            done = self.finished_at()
            what = f"a finished run (step {done})" if done is not None else "another run's outputs"
            found = checkpoints(self.path)
            resume = ""
            if found and why is None:
                resume = (
                    f"train it further with training.resume_from_checkpoint=auto and a training.max_steps above "
                    f"{done} (from {found[-1].name}), "
                    if done is not None
                    else f"resume it with training.resume_from_checkpoint=auto (newest: {found[-1].name}), "
                )
        else:
            shown = ", ".join(self.foreign()[:5])
            what, resume = f"files that are not a tiertune run ({shown})", ""
        return (
            f"training.output_dir {self.path} holds {what}{'; ' + why if why else ''}; "
            f"{resume}choose another training.output_dir, or set training.overwrite_output_dir=true to start over "
            "there (the previous run's checkpoints, log and model are removed)"
        )

    # ---------------------------------------------------------------- acting on it

    def prepare(self, decision: Decision) -> list[Path]:
        """Remove interrupted checkpoint writes and exports, and, when starting over, the previous run's
        outputs (files tiertune did not write stay). Returns what was removed."""
        removed = partials(self.path)
        removed += [p for p in self.path.glob(".export-*") if p.is_dir()]
        if decision.clear:
            removed += self._checkpoint_dirs()
            for name in _RUN_FILES:
                if (self.path / name).exists():
                    removed.append(self.path / name)
            removed += [p for p in self.path.iterdir() if _MODEL_FILES.match(p.name)]
        for path in removed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        return removed


def launch_record(world: World, rows: int) -> str:
    """``LAUNCH_FILE``'s text: the processes a run is launched on and the rows of its global micro-batch."""
    return json.dumps({"world_size": world.size, "rows_per_micro_batch": rows}) + "\n"


def _launch(path: Path) -> dict:
    """A run directory's ``LAUNCH_FILE`` (of a run written before it existed: one process)."""
    try:
        found = json.loads((path / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _differences(recipe: Recipe, recipe_file: Path) -> list[tuple[str, Any, Any]] | None:
    """The settings that make a run (all but ``RESUMABLE_CHANGES``) on which ``recipe`` and ``recipe_file``
    differ, as ``(key, then, now)``; None when the file is missing or unreadable."""
    then = _recipe_dict(recipe_file)
    if then is None:
        return None
    now, old = dict(flatten(recipe.to_dict())), dict(flatten(_with_defaults(then)))
    return [
        (k, old.get(k), now.get(k))
        for k in sorted(set(now) | set(old))
        if old.get(k) != now.get(k) and not k.startswith(RESUMABLE_CHANGES)
    ]


def _with_defaults(then: dict[str, Any]) -> dict[str, Any]:
    """A run directory's recipe with the settings it lacks at their defaults: written by an earlier tiertune,
    before those settings existed, it ran as they are by default (not as a difference from this recipe)."""
    try:
        return build(Recipe, then, "").to_dict()
    except (ConfigError, TypeError, ValueError):  # no longer a valid recipe: its settings as written
        return then


def _recipe_dict(path: Path) -> dict[str, Any] | None:
    """A recipe file's settings as a dict, or None when it is missing or unreadable."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None
