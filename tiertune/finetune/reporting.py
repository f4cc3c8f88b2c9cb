"""Where logged steps go besides ``trainer_log.jsonl``: TensorBoard and Weights & Biases (``training.report_to``).

``auto`` reports to TensorBoard when the ``tensorboard`` package is installed (event files in
``<output_dir>/runs``), ``tensorboard`` and ``wandb`` ask for one (an error says what to install when it is
missing), ``none`` writes only the JSON lines.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tiertune.errors import ConfigError

CHOICES = ("auto", "none", "tensorboard", "wandb")


class Reporters:
    """The loggers a run reports each logged step to."""

    def __init__(self, report_to: str, output_dir: Path, config: dict[str, Any], resumed_at: int = 0) -> None:
        if report_to not in CHOICES:
            raise ValueError(
                f"Reporters take report_to in {', '.join(CHOICES)} (a recipe's training.report_to), got {report_to!r}"
            )
        self._tensorboard = None
        self._wandb = None
        has_tb = importlib.util.find_spec("tensorboard") is not None
        if report_to == "tensorboard" and not has_tb:
            raise ConfigError(
                "training.report_to: tensorboard needs the tensorboard package (pip install tensorboard)"
            )
        if report_to == "wandb" and importlib.util.find_spec("wandb") is None:
            raise ConfigError("training.report_to: wandb needs the wandb package (pip install wandb)")
        if report_to == "tensorboard" or (report_to == "auto" and has_tb):
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(
                log_dir=str(output_dir / "runs"), purge_step=resumed_at + 1 or None
            )
        if report_to == "wandb":
            import wandb

            self._wandb = wandb.init(
                dir=str(output_dir), config=config, resume="allow", reinit="finish_previous"
            )

    @property
    def active(self) -> list[str]:
        return [name for name, on in (("tensorboard", self._tensorboard), ("wandb", self._wandb)) if on]

    def log(self, record: dict[str, Any]) -> None:
        """Report one logged step (the ``trainer_log.jsonl`` record): numbers, and bytes per tier."""
        step = record["step"]
        scalars = {  # an evaluation's as the Trainer names them: eval/loss, eval/runtime, ...
            (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v
            for k, v in record.items()
            if isinstance(v, int | float) and k != "step"
        }
        scalars.update({f"memory/peak_{tier}_bytes": v for tier, v in record.get("peak_bytes", {}).items()})
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
