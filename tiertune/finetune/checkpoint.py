"""Checkpoints of a run, written atomically, and exact resume from them.

``checkpoint-<step>/`` in the run directory holds everything the next step depends on:

- ``state/<chunk>.safetensors``: the contents of every chunk of training state (weights, fp32 master
  weights, Adam moments, 8-bit moments with their absmax, GaLore projections), read from wherever the store
  keeps them (device, host or disk), one chunk at a time;
- for LoRA: the adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``: the checkpoint
  directory loads with ``PeftModel.from_pretrained``) and ``adapter_optimizer.pt`` (weights and optimizer
  state as trained);
- ``rng_state.pth``: Python's and torch's random states (CPU and CUDA);
- ``recipe.yaml``: the resolved recipe (``tiertune export`` and ``merge`` read it);
- ``trainer_state.json``: the step, the epoch, the micro-batches of data consumed, the engine's counters and
  the log history, as the Hugging Face Trainer names them. It is written last.

A checkpoint is written in the background (``CheckpointWriter``) into ``.checkpoint-<step>.partial/``, every
file fsynced, then renamed into place and the run directory fsynced: a crash at any moment leaves the
previous checkpoints intact and, at worst, a partial directory that the next run removes.
``save_total_limit`` keeps the newest complete ones.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiertune.errors import ConfigError
from tiertune.finetune.files import fsync_dir, fsync_file

if TYPE_CHECKING:
    from tiertune.finetune.engine import StreamedTrainer

log = logging.getLogger("tiertune.checkpoint")

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
RECIPE_FILE = "recipe.yaml"  # the resolved recipe of the run, in the run directory and in each checkpoint
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints of a run directory, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run directory, or None."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete checkpoints whose writing was interrupted; returns what was removed."""
    run_dir = Path(run_dir)
    partial = [p for p in run_dir.glob(f".{PREFIX}*.partial") if p.is_dir()] if run_dir.is_dir() else []
    for path in partial:
        shutil.rmtree(path)
    return partial


class CheckpointWriter:
    """Writes checkpoints on a background thread while training goes on.

    ``save`` snapshots the small parts (RNG states, counters, the LoRA adapter and its optimizer) at once and
    returns; the chunks of training state are written by the writer thread, in the order the next step's
    optimizer will change them. Before the optimizer changes a chunk (``capture``, called by the engine on
    its optimizer thread), a chunk not yet written is written first, by the thread that wants to change it:
    the checkpoint is the state of one step boundary, and no copy of the whole state is ever held. ``wait``
    blocks until the checkpoint is complete and re-raises the writer's error.
    """

    def __init__(self, trainer: StreamedTrainer, run_dir: str | os.PathLike[str], limit: int | None) -> None:
        self._trainer = trainer
        self._run_dir = Path(run_dir)
        self._limit = limit
        self._cond = threading.Condition()
        self._state: dict[int, str] = {}  # chunk id -> "pending" | "writing" | "done", for the current save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.blocked_s = 0.0  # time the training threads waited for chunks to be written first
        self.last: Path | None = None

    def save(self, trainer_state: dict, recipe_yaml: str | None = None) -> Path:
        """Start writing ``checkpoint-<global_step>`` (with the run's ``recipe.yaml``, when given); returns the
        path it will have once complete."""
        self.wait()
        trainer = self._trainer
        step = int(trainer_state["global_step"])
        final = self._run_dir / f"{PREFIX}{step}"
        tmp = self._run_dir / f".{PREFIX}{step}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "state").mkdir(parents=True)
        if trainer.adapters is not None:  # small, in memory: written now
            trainer.save_adapter(tmp)
            torch.save(trainer.adapters.training_state(), tmp / "adapter_optimizer.pt")
        torch.save(_rng_states(), tmp / "rng_state.pth")
        if recipe_yaml is not None:
            (tmp / RECIPE_FILE).write_text(recipe_yaml)
        chunks = trainer.state_chunks(in_update_order=True)
        state = dict(trainer_state, tiertune=dict(trainer_state.get("tiertune", {}), **trainer.counters()))
        state["tiertune"]["state_chunks"] = [c.name for c in trainer.state_chunks()]
        with self._cond:
            self._state = {c.id: "pending" for c in chunks}
        self._files = tmp / "state"
        trainer.before_update = self.capture
        self._thread = threading.Thread(
            target=self._run, args=(chunks, tmp, final, state), name="tiertune-checkpoint", daemon=True
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

    def wait(self) -> Path | None:
        """Block until the checkpoint being written is complete; returns it (re-raises a write error)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self.last

    def _claim(self, chunk) -> bool:
        """True if the caller is to write ``chunk`` now; waits while another thread writes it."""
        with self._cond:
            while self._state.get(chunk.id) == "writing":
                self._cond.wait()
            if self._state.get(chunk.id) != "pending":
                return False
            self._state[chunk.id] = "writing"
            return True

    def _write(self, chunk) -> None:
        from safetensors.torch import save_file

        try:
            save_file(self._trainer.store.read(chunk), self._files / f"{chunk.name}.safetensors")
        finally:
            with self._cond:
                self._state[chunk.id] = "done"
                self._cond.notify_all()

    def _run(self, chunks: list, tmp: Path, final: Path, state: dict) -> None:
        try:
            for chunk in chunks:
                if self._claim(chunk):
                    self._write(chunk)
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            _commit(tmp, final, self._run_dir)
            for stale in prune(self._run_dir, self._limit):
                log.info("removed %s (save_total_limit %d)", stale, self._limit)
            self.last = final
            log.info("saved %s", final)
        except BaseException as exc:  # re-raised by wait() on the training thread
            self._error = exc
        finally:
            self._trainer.before_update = None


def _commit(tmp: Path, final: Path, run_dir: Path) -> None:
    """fsync every file of ``tmp`` (the trainer state last), then rename it to ``final`` and fsync the run
    directory. An existing ``final`` (the same step saved again by a resumed run) is replaced whole."""
    for path in sorted(tmp.rglob("*"), key=lambda p: p.name == STATE_FILE):
        if path.is_file():
            fsync_file(path)
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


def prune(run_dir: str | os.PathLike[str], limit: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit``; returns what was removed."""
    if not limit or limit < 1:
        return []
    stale = checkpoints(run_dir)[:-limit]
    for path in stale:
        shutil.rmtree(path)
    return stale


def load_checkpoint(trainer: StreamedTrainer, path: str | os.PathLike[str]) -> dict:
    """Put a checkpoint's state into a freshly built trainer of the same recipe; returns its trainer state."""
    from safetensors.torch import load_file

    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise ConfigError(
            f"{path} is not a complete tiertune checkpoint (no {STATE_FILE}); point "
            "training.resume_from_checkpoint at a checkpoint-<step> directory, or use auto"
        )
    state = json.loads(state_file.read_text())
    saved = state.get("tiertune", {}).get("state_chunks")
    ours = [c.name for c in trainer.state_chunks()]
    if saved is None or saved != ours:
        raise ConfigError(
            f"checkpoint {path} was written by a run with other training state (model, method.type, optim "
            "or chunking differ); resume with the recipe that wrote it"
        )
    for chunk in trainer.state_chunks():
        trainer.store.write(chunk, load_file(path / "state" / f"{chunk.name}.safetensors"))
    if trainer.adapters is not None:
        cfg = trainer.config
        blob = torch.load(path / "adapter_optimizer.pt", weights_only=False)
        trainer.adapters.load_training_state(
            blob, cfg.weight_decay, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon
        )
    trainer.restore_counters(state["tiertune"])
    _set_rng_states(torch.load(path / "rng_state.pth", weights_only=False))
    return state


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
