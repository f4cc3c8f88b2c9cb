"""SIGTERM (what schedulers send) and SIGINT (Ctrl-C) stop a run cleanly: the checkpoint being written is
completed within seconds or dropped (the newest complete one stays), the offload files and partial directories are removed, and the command says where it stopped,
the newest checkpoint and how to resume, with exit code 128 + the signal."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.finetune.checkpoint import checkpoints, verify


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_cleanly_and_says_how_to_resume(tmp_path, model_dir, write_recipe, signum):
    recipe = write_recipe(
        tmp_path,
        model_dir,
        training={"max_steps": 1000, "save_steps": 2, "save_total_limit": 2},
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
    )
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
    # the checkpoint being written when the signal came was completed (within STOP_GRACE_S), or dropped whole:
    # either way the newest one is intact
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
        [
            "train",
            str(run_dir / "recipe.yaml"),
            "training.resume_from_checkpoint=auto",
            f"training.max_steps={step + 2}",
        ],
    )
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


# --- every command, stopped wherever it is -----------------------------------------------------------------------

SIGNALLING = Path(__file__).resolve().parents[1] / "signalling.py"
STOP_SECONDS = 5.0  # from the signal to the process's exit, its interpreter's shutdown included


def _stop(tmp_path: Path, at: str, signum: int, args: list[str], reach: float = 300) -> tuple[str, str]:
    """Run ``tiertune ARGS`` (``tests/signalling.py``) sending itself ``signum`` at ``at``; assert it exits with
    128 + signum within ``STOP_SECONDS`` of the signal, saying so in one line and nothing else on stderr, and
    leaves no process behind (its session is empty). Returns its stdout and stderr."""
    stamp = tmp_path / f"signal-{signum}-{at.replace(':', '-')}"
    name = signal.Signals(signum).name.removeprefix("SIG")
    command = [
        sys.executable,
        str(SIGNALLING),
        "--at",
        at,
        "--signal",
        name,
        "--stamp",
        str(stamp),
        "--",
        *args,
    ]
    out, err = tmp_path / "stop.out", tmp_path / "stop.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(command, stdout=o, stderr=e, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + reach
    try:
        while proc.poll() is None and not stamp.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stamp.exists(), f"never reached {at}: {err.read_text()[-3000:]}"
        sent = float(stamp.read_text())
        while proc.poll() is None and time.time() - sent < 60:
            time.sleep(0.02)
        ended = time.time()
        assert proc.poll() is not None, f"still running 60 s after {name} at {at}: {err.read_text()[-3000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert proc.returncode == 128 + signum, (at, proc.returncode, stderr[-3000:])
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"tiertune: stopped by SIG{name}"), stderr[-3000:]
    print(
        f"stop: {name} at {at}: {ended - sent:.2f} s to the exit"
    )  # shown by pytest -s (the figures reported)
    assert ended - sent <= STOP_SECONDS, f"{ended - sent:.1f} s from {name} at {at} to the exit"
    gone = time.monotonic() + 5
    while True:  # nothing it started is left: its session (process group) has no member
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < gone, f"processes of the stopped command are left: {proc.pid}"
        time.sleep(0.05)
    return stdout, stderr


@pytest.fixture(scope="module")
def stop_recipe(tmp_path_factory, cat_model):
    """A small full fine-tune with its weights and states on disk (so the estimate's replay and a run move
    chunks), checkpoints every 2 steps."""
    from tests.conftest import _write_recipe

    where = tmp_path_factory.mktemp("stop")
    return _write_recipe(
        where,
        cat_model(2),
        training={"max_steps": 6, "save_steps": 2},
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished LoRA run of the cat model (for export and merge)."""
    from tests.conftest import CAT_TEXTS, _write_recipe
    from tiertune.cli.demo import make_model
    from tiertune.finetune.train import train

    where = tmp_path_factory.mktemp("stop-lora")
    model = make_model(where / "model", CAT_TEXTS, layers=2, tokenizer="bpe")  # one llama.cpp reads
    recipe = _write_recipe(
        where,
        model,
        training={"max_steps": 2},
        method={"type": "lora", "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
    )
    train(recipe, progress=False)
    return where / "run"


ESTIMATE_POINTS = [
    ("building the model on meta", "tiertune.loading.model:build_skeleton:1", signal.SIGINT),
    ("the replay, as a ledger transfer lands", "tiertune.offload.aio:IOHandle.part_done:5", signal.SIGTERM),
    ("the replay, in a transfer's completion", "tiertune.offload.store:ChunkStore._done:9", signal.SIGTERM),
    ("the disk probe, reading", "tiertune.offload.disk:DiskTier.read:1", signal.SIGTERM),
    # the replay's four ledger steps first, then the engine's own steps on the model's cuts (``measure_engine``)
    (
        "the compute probe, a cut model's step",
        "tiertune.engine.trainer:StreamedTrainer.step:6",
        signal.SIGINT,
    ),
]


@pytest.mark.parametrize("where,at,signum", ESTIMATE_POINTS, ids=[p[0] for p in ESTIMATE_POINTS])
def test_estimate_stops_on_a_signal_wherever_it_is(tmp_path, stop_recipe, where, at, signum):
    """`tiertune estimate` stopped while it builds the model, replays a step on the ledger (the signal raised
    inside a transfer's completion: the store's close must not wait for a transfer nothing will finish) and
    probes the machine: exit 128 + the signal within seconds, one line, nothing left in the disk's directory."""
    disk = Path(yaml.safe_load(stop_recipe.read_text())["offload"]["disk_path"])
    _stop(tmp_path, at, signum, ["estimate", str(stop_recipe), "--gpu", "cpu"])
    assert not disk.exists() or not list(disk.iterdir())
    assert not list(disk.parent.glob(".probe-*"))
    # the compute probe's cut models (written in the temporary directory this process's children share)
    assert not list(Path(tempfile.gettempdir()).glob("tiertune-measure-*"))


TRAIN_POINTS = [
    # (the first call is the admission's: the run's chunks read from the engine built on a ledger)
    ("loading", "tiertune.loading.model:load_into_store:2", signal.SIGTERM),
    ("mid-step", "tiertune.engine.trainer:StreamedTrainer.layer_weights:10", signal.SIGINT),
    ("writing a checkpoint", "tiertune.finetune.checkpoint:CheckpointWriter._write:2", signal.SIGTERM),
    ("saving the model", "tiertune.finetune.hf_model:write_hf:1", signal.SIGTERM),
]


@pytest.mark.parametrize("where,at,signum", TRAIN_POINTS, ids=[p[0] for p in TRAIN_POINTS])
def test_train_stops_on_a_signal_wherever_it_is(tmp_path, stop_recipe, where, at, signum):
    """`tiertune train` stopped while loading, mid-step, while a checkpoint is written and while the model is
    saved: exit 128 + the signal within seconds, one line (where it stopped, how to resume), the offload files
    and partial directories gone, every checkpoint left intact."""
    run = tmp_path / "run"
    _, stderr = _stop(
        tmp_path,
        at,
        signum,
        [
            "train",
            str(stop_recipe),
            f"training.output_dir={run}",
            f"offload.disk_path={tmp_path / 'nvme'}",
            "-q",
        ],
    )
    assert "resume with: tiertune train" in stderr or "no checkpoint was written yet" in stderr, stderr
    assert not (tmp_path / "nvme").exists() or not list((tmp_path / "nvme").iterdir())
    assert not list(run.glob(".checkpoint-*")) and not list(run.glob(".export-*"))
    for done in checkpoints(run):
        verify(done)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_train_stops_on_a_signal_while_it_evaluates(tmp_path, stop_recipe, signum):
    """Stopped in its second evaluation (after step 4; checkpoint-2 written, checkpoint-4 not yet): exit 128 + the
    signal within seconds, checkpoint-2 intact and named to resume from, the offload files gone."""
    run = tmp_path / "run"
    _, stderr = _stop(
        tmp_path,
        "tiertune.engine.trainer:StreamedTrainer.sequence_logps:4",  # (3 passes an evaluation: 12 rows)
        signum,
        [
            "train",
            str(stop_recipe),
            f"training.output_dir={run}",
            f"offload.disk_path={tmp_path / 'nvme'}",
            f"data.eval_path={stop_recipe.parent / 'data.jsonl'}",
            "training.eval_strategy=steps",
            "training.eval_steps=2",
            "-q",
        ],
    )
    assert (
        "after step 4" in stderr and "checkpoint-2" in stderr and "resume with: tiertune train" in stderr
    ), stderr
    assert [p.name for p in checkpoints(run)] == ["checkpoint-2"]
    verify(checkpoints(run)[0])
    assert not (tmp_path / "nvme").exists() or not list((tmp_path / "nvme").iterdir())


def test_train_stops_on_a_signal_while_its_plan_is_checked(tmp_path, stop_recipe):
    """`tiertune train` stopped while it builds the engine on a ledger to check its memory plan (before anything
    of the run exists): exit 128 + the signal within seconds, one line, no run directory and no offload files."""
    run = tmp_path / "run"
    at = "tiertune.loading.model:load_into_store:1"  # the admission's layout-only build
    args = [
        "train",
        str(stop_recipe),
        f"training.output_dir={run}",
        f"offload.disk_path={tmp_path / 'nvme'}",
        "-q",
    ]
    _, stderr = _stop(tmp_path, at, signal.SIGTERM, args)
    assert "stopped by SIGTERM" in stderr, stderr
    assert not run.exists()
    assert not (tmp_path / "nvme").exists() or not list((tmp_path / "nvme").iterdir())


def test_export_and_merge_stop_on_a_signal_mid_way(tmp_path, lora_run):
    """`tiertune export` (GGUF; the merged HF model) and `tiertune merge` stopped mid-way: exit 128 + the
    signal within seconds, one line, and neither the output nor its temporary directory beside it is left."""
    cases = [
        (
            "tiertune.formats.gguf:_Tensor.values_from:3",
            signal.SIGTERM,
            ["export", str(lora_run), "--format", "gguf", "--out", str(tmp_path / "gguf")],
        ),
        (
            "tiertune.export.merging:_Merger._merged:2",
            signal.SIGINT,
            ["export", str(lora_run), "--format", "hf", "--out", str(tmp_path / "hf")],
        ),
        (
            "tiertune.export.merging:_Merger._merged:3",
            signal.SIGTERM,
            ["merge", str(lora_run), "--out", str(tmp_path / "merged")],
        ),
    ]
    for at, signum, args in cases:
        _stop(tmp_path, at, signum, args)
        assert (
            sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("stop.", "signal-"))) == []
        ), at


def test_evaluate_and_generate_stop_on_a_signal_mid_pass(tmp_path, lora_run):
    """`tiertune evaluate` and `tiertune generate` of a LoRA run stopped in a pass over the layers: exit 128 + the
    signal within seconds, one line."""
    from tests.conftest import CAT_TEXTS

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS))
    at = "tiertune.engine.trainer:StreamedTrainer.layer_weights:2"
    _stop(tmp_path, at, signal.SIGTERM, ["evaluate", str(lora_run), str(held_out)])
    _stop(tmp_path, at, signal.SIGINT, ["generate", str(lora_run), "--prompt", "the cat"])


def test_env_probe_and_parsing_stop_on_a_signal(tmp_path):
    """`tiertune env --probe` stopped while it writes to the disk (its probe directory removed), and any
    command stopped while its command line is parsed (before its own handling: one line, not Python's
    KeyboardInterrupt traceback nor click's "Aborted!")."""
    disk = tmp_path / "disk"
    disk.mkdir()
    _stop(
        tmp_path,
        "tiertune.offload.disk:DiskTier.write:2",
        signal.SIGINT,
        ["env", "--disk-path", str(disk), "--probe"],
    )
    assert not list(disk.iterdir())
    _stop(tmp_path, "typer.main:get_command:1", signal.SIGINT, ["recipes"])
    _stop(tmp_path, "typer.main:get_command:1", signal.SIGTERM, ["estimate", "--help"])


def test_demo_stops_on_a_signal_mid_step(tmp_path):
    """`tiertune demo` (the README's first command) stopped mid-step: as `train`, exit 130 within seconds and
    one line saying where it stopped and how to resume; its offload files removed."""
    _, stderr = _stop(
        tmp_path, "tiertune.engine.trainer:StreamedTrainer.layer_weights:30", signal.SIGINT, ["demo", "-q"]
    )
    assert "stopped by SIGINT" in stderr
    demo = yaml.safe_load((tmp_path / "runs" / "demo" / "out" / "recipe.yaml").read_text())
    disk = Path(demo["offload"]["disk_path"])
    assert not disk.exists() or not list(disk.glob("tiertune-store-*"))
