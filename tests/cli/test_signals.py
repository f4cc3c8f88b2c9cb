"""SIGTERM (what schedulers send) and SIGINT (Ctrl-C) stop a run cleanly: the checkpoint being written is
completed, the offload files and partial directories are removed, and the command says where it stopped,
the newest checkpoint and how to resume, with exit code 128 + the signal."""

import os
import signal
import threading
import time

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.finetune.checkpoint import checkpoints, verify


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_cleanly_and_says_how_to_resume(tmp_path, model_dir, write_recipe, signum):
    recipe = write_recipe(
        tmp_path, model_dir,
        training={"max_steps": 1000, "save_steps": 2, "save_total_limit": 2},
        offload={"params": "disk", "optimizer_states": "disk", "device_budget": "4MiB", "host_budget": "1MiB"},
    )  # fmt: skip
    run_dir, disk = tmp_path / "run", tmp_path / "nvme"

    def send() -> None:  # once the second checkpoint is being written or done
        deadline = time.monotonic() + 120
        while not (list(run_dir.glob(".checkpoint-4.partial")) or (run_dir / "checkpoint-4").exists()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        (run_dir / ".checkpoint-999.partial").mkdir()  # as a write interrupted at the signal: removed too
        os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()
    result = CliRunner().invoke(app, ["train", str(recipe), "-q"])
    assert result.exit_code == 128 + signum, result.output
    assert "Traceback" not in result.output
    name = signal.Signals(signum).name
    newest = checkpoints(run_dir)[-1]
    # the checkpoint being written when the signal came was completed, or dropped whole if its writer had not
    # started: either way the newest one is intact
    assert newest.name in ("checkpoint-2", "checkpoint-4")
    verify(newest)
    assert f"stopped by {name} after step" in result.output
    assert f"the newest checkpoint is {newest}" in result.output
    resume = f"resume with: tiertune train {run_dir / 'recipe.yaml'} training.resume_from_checkpoint=auto"
    assert resume in result.output
    assert not list(disk.glob("tiertune-store-*")) and not list(disk.glob(".tiertune-*"))
    assert not list(run_dir.glob(".checkpoint-*")) and not list(run_dir.glob(".export-*"))
    assert not (run_dir / "model.safetensors").exists()
    step = int(newest.name.split("-")[1])
    again = CliRunner().invoke(
        app,
        ["train", str(run_dir / "recipe.yaml"), "training.resume_from_checkpoint=auto",
         f"training.max_steps={step + 2}"],
    )  # fmt: skip
    assert again.exit_code == 0, again.output
    assert f"steps {step + 1}-{step + 2}" in again.output and (run_dir / "model.safetensors").exists()


def test_a_lost_rank_while_this_one_was_stopping_for_sigterm_is_the_signal_s_stop(tmp_path, capsys):
    """Under a launcher's SIGTERM every rank stops; one that is inside a collective when another has already
    stopped sees it fail before its next safe point. Its stop is the signal's (exit 143, where and how to
    resume), not a lost rank's RankError: the signal noted at that point, or during the clean-up, says so."""
    from tiertune.errors import Interrupted, RankError
    from tiertune.finetune.signals import StopOnSignals
    from tiertune.finetune.train import _explain

    with pytest.raises(Interrupted, match="stopped by SIGTERM after step 2") as info:
        _explain(RankError("all_gather failed"), 2, 10, tmp_path, tmp_path / "recipe.yaml", signal.SIGTERM)
    assert info.value.signal == signal.SIGTERM
    with pytest.raises(RankError):
        _explain(RankError("all_gather failed"), 2, 10, tmp_path, tmp_path / "recipe.yaml", None)
    stop = StopOnSignals()
    stop._note(signal.SIGTERM, None)  # first signal in a clean-up that a lost rank began: noted, not printed
    assert stop.requested == signal.SIGTERM and capsys.readouterr().err == ""
    stop.raised = signal.SIGINT  # a stop by Ctrl-C, then SIGTERM during its clean-up: said
    stop._note(signal.SIGTERM, None)
    assert "SIGTERM received again" in capsys.readouterr().err
