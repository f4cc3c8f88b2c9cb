"""Checkpoints of a run, written atomically, and exact resume from them.

``checkpoint-<step>/`` in the run directory holds everything the next step depends on:

- ``state/<chunk>.safetensors``: the contents of every chunk of training state (weights, fp32 master
  weights, Adam moments, 8-bit moments with their absmax, GaLore projections), read from wherever the store
  keeps them (device, host or disk), one chunk at a time;
- for LoRA: the adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``: the checkpoint
  directory loads with ``PeftModel.from_pretrained``) and ``adapter_optimizer.pt`` (weights and optimizer
  state as trained);
- ``rng_state.pth``: Python's and torch's random states (CPU and CUDA);
- ``trainer_state.json``: the step, the epoch, the micro-batches of data consumed, the engine's counters and
  the log history, as the Hugging Face Trainer names them. It is written last.

A checkpoint is written into ``.checkpoint-<step>.partial/``, every file fsynced, then renamed into place and
the run directory fsynced: a crash at any moment leaves the previous checkpoints intact and, at worst, a
partial directory that the next run removes. ``save_total_limit`` keeps the newest complete ones.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiertune.errors import ConfigError
from tiertune.finetune.files import fsync_file

if TYPE_CHECKING:
    from tiertune.finetune.engine import StreamedTrainer

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
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


def save_checkpoint(trainer: StreamedTrainer, run_dir: str | os.PathLike[str], trainer_state: dict) -> Path:
    """Write ``checkpoint-<global_step>`` of the trainer's current state (between steps); returns its path."""
    run_dir = Path(run_dir)
    step = int(trainer_state["global_step"])
    final = run_dir / f"{PREFIX}{step}"
    tmp = run_dir / f".{PREFIX}{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "state").mkdir(parents=True)
    from safetensors.torch import save_file

    for chunk in trainer.state_chunks():
        save_file(trainer.store.read(chunk), tmp / "state" / f"{chunk.name}.safetensors")
    if trainer.adapters is not None:
        trainer.save_adapter(tmp)
        torch.save(trainer.adapters.training_state(), tmp / "adapter_optimizer.pt")
    torch.save(_rng_states(), tmp / "rng_state.pth")
    state = dict(trainer_state, tiertune=dict(trainer_state.get("tiertune", {}), **trainer.counters()))
    state["tiertune"]["state_chunks"] = [c.name for c in trainer.state_chunks()]
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
    for path in sorted(tmp.rglob("*"), key=lambda p: p.name == STATE_FILE):
        if path.is_file():
            fsync_file(path)
    _fsync_dir(tmp / "state")
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a resumed run): the new one replaces it whole
        old = run_dir / f".{PREFIX}{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(run_dir)
    return final


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
