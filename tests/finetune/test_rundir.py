"""The run directory: one run at a time, never mixed with another, never a damaged checkpoint resumed, never a
non-finite model saved or exported, a full disk said at once."""

import errno
import json
import os
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.engine import StreamedTrainer
from tiertune.engine.loss import CausalLMLoss
from tiertune.errors import ConfigError, DataError, DiskFullError, IntegrityError, NonFiniteError
from tiertune.finetune import checkpoint as ckpt
from tiertune.finetune.checkpoint import checkpoints
from tiertune.finetune.rundir import RunDirectory
from tiertune.finetune.train import train


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.fixture
def recipe(tmp_path, model_dir, write_recipe):
    return write_recipe(
        tmp_path,
        model_dir,
        data={"shuffle": False},
        training={"max_steps": 6, "save_steps": 2, "learning_rate": "3e-3", "lr_scheduler_type": "cosine"},
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
    )


def _log_steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "trainer_log.jsonl").read_text().splitlines()]


def _snapshot(run_dir):
    """Every file's bytes under the run directory (but its lock), to show that nothing changed."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".tiertune.lock"
    }


def _cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


# ----------------------------------------------------------------------------- whose directory it is


def test_an_output_dir_holding_another_run_is_refused_unless_overwritten(recipe, tmp_path):
    """A second run with other settings neither appends to the first one's log nor prunes its checkpoints:
    it is refused (exit 2, saying what to do) and the directory stays as it was; with
    overwrite_output_dir it starts over, and the directory then holds only the new run."""
    first = train(recipe, progress=False)
    run_dir = first.output_dir
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match="holds a finished run.*overwrite_output_dir=true"):
        train(recipe, ("training.learning_rate=1e-2",), progress=False)
    cli = _cli("train", recipe, "training.learning_rate=1e-2", "-q")
    assert cli.exit_code == 2 and "training.overwrite_output_dir=true" in cli.output
    assert _snapshot(run_dir) == before
    again = train(
        recipe,
        ("training.learning_rate=1e-2", "training.max_steps=3", "training.overwrite_output_dir=true"),
        progress=False,
    )
    assert _log_steps(run_dir) == [1, 2, 3]
    assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-3"]
    assert again.losses[0] == pytest.approx(first.losses[0])


def test_a_directory_of_other_files_is_refused(recipe, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"files that are not a tiertune run \(notes.txt\)"):
        train(recipe, progress=False)
    train(recipe, ("training.overwrite_output_dir=true", "training.max_steps=1"), progress=False)
    assert (run_dir / "notes.txt").read_text() == "mine"  # overwriting removes only what a run wrote


def test_an_output_dir_that_is_a_file_is_refused(recipe, tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        train(recipe, progress=False)


def test_the_model_directory_is_never_the_output_dir(recipe, model_dir):
    before = _snapshot(model_dir)
    for overrides in (
        (f"training.output_dir={model_dir}",),
        (f"training.output_dir={model_dir}", "training.overwrite_output_dir=true"),
    ):
        with pytest.raises(ConfigError, match="training.output_dir is model.path"):
            train(recipe, overrides, progress=False)
    assert _snapshot(model_dir) == before


def test_resume_refuses_another_run_and_names_what_differs(recipe):
    first = train(recipe, ("training.max_steps=4",), progress=False)
    with pytest.raises(ConfigError) as info:
        train(
            recipe,
            (
                "training.max_steps=6",
                "training.resume_from_checkpoint=auto",
                "training.per_device_train_batch_size=2",
                "training.learning_rate=1e-2",
            ),
            progress=False,
        )
    message = str(info.value)
    assert "training.per_device_train_batch_size: 4 -> 2" in message
    assert "training.learning_rate: 0.003 -> 0.01" in message and "allow_recipe_changes" in message
    assert _log_steps(first.output_dir) == [1, 2, 3, 4]
    # what a resumed run may change: how far it goes, where its states live
    resumed = train(
        recipe,
        ("training.max_steps=6", "training.resume_from_checkpoint=auto", "offload.host_budget=2MiB"),
        progress=False,
    )
    assert resumed.first_step == 5 and _log_steps(first.output_dir) == [1, 2, 3, 4, 5, 6]
    # and with allow_recipe_changes, anything the saved state still fits
    forced = train(
        recipe,
        (
            "training.max_steps=7",
            "training.resume_from_checkpoint=auto",
            "training.learning_rate=1e-2",
            "training.allow_recipe_changes=true",
        ),
        progress=False,
    )
    assert forced.first_step == 7


def test_a_checkpoint_of_an_earlier_tiertune_resumes_with_the_settings_it_lacks_at_their_defaults(recipe):
    """A recipe written before some settings existed (here the evaluation's, the best model's and the master
    weights' dtype) ran as they are by default: resumed by this tiertune, it is the same run, not another."""
    import yaml

    first = train(recipe, ("training.max_steps=4",), progress=False)
    later = (
        "eval_strategy",
        "eval_steps",
        "eval_on_start",
        "early_stopping_patience",
        "early_stopping_threshold",
        "load_best_model_at_end",
        "metric_for_best_model",
        "master_weights",
    )
    for path in [first.output_dir / "recipe.yaml", *first.output_dir.glob("checkpoint-*/recipe.yaml")]:
        old = yaml.safe_load(path.read_text())
        for key in later:
            del old["training"][key]
        del old["data"]["eval_path"]
        path.write_text(yaml.safe_dump(old))
        if path.parent.name.startswith("checkpoint-"):
            ckpt.write_checksums(path.parent)  # as that tiertune wrote them
    resumed = train(recipe, ("training.max_steps=6", "training.resume_from_checkpoint=auto"), progress=False)
    assert resumed.first_step == 5 and _log_steps(first.output_dir) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ConfigError, match=r"training.weight_decay: 0.0 -> 0.1\. A resumed run"):  # it alone
        train(
            recipe,
            (
                "training.max_steps=7",
                "training.resume_from_checkpoint=auto",
                "training.weight_decay=0.1",
            ),
            progress=False,
        )


def test_a_second_run_on_a_locked_directory_stops_at_once(recipe, tmp_path):
    """The first run holds the lock (here: this process, as a live run would); the second is refused before
    it reads or writes anything, naming the first one's pid."""
    with RunDirectory(tmp_path / "run"):
        with pytest.raises(ConfigError, match=f"in use by another tiertune run \\(pid {os.getpid()}\\)"):
            train(recipe, progress=False)
        cli = _cli("train", recipe, "-q")
        assert cli.exit_code == 2 and "in use by another tiertune run" in cli.output
        assert not (tmp_path / "run" / "trainer_log.jsonl").exists()
    train(recipe, ("training.max_steps=1",), progress=False)  # the lock went with the first run


def test_resuming_past_max_steps_is_an_error_and_overwrites_nothing(recipe):
    """On a finished 6-step run: resuming with max_steps 4 or 6 says it finished; naming checkpoint-4 with
    max_steps 3 says it is past them; nothing in the directory changes. With max_steps 8 it trains steps 7-8
    from checkpoint-6."""
    first = train(recipe, progress=False)
    before = _snapshot(first.output_dir)
    for steps in (4, 6):
        with pytest.raises(ConfigError, match="already finished at step 6"):
            train(
                recipe,
                ("training.resume_from_checkpoint=auto", f"training.max_steps={steps}"),
                progress=False,
            )
    with pytest.raises(ConfigError, match="checkpoint-4 is at step 4, past training.max_steps 3"):
        train(
            recipe,
            (f"training.resume_from_checkpoint={first.output_dir}/checkpoint-4", "training.max_steps=3"),
            progress=False,
        )
    assert _snapshot(first.output_dir) == before
    more = train(recipe, ("training.resume_from_checkpoint=auto", "training.max_steps=8"), progress=False)
    assert more.first_step == 7 and len(more.losses) == 2


def test_a_missing_checkpoint_path_says_it_does_not_exist(recipe, tmp_path):
    with pytest.raises(ConfigError, match="nope does not exist; use auto"):
        train(recipe, (f"training.resume_from_checkpoint={tmp_path}/nope",), progress=False)


# ----------------------------------------------------------------------------- damaged checkpoints


def _flip(path, offset=-64, count=8):
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[offset + i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped state": lambda c: _flip(next((c / "state").glob("*exp_avg_sq*.safetensors"))),
    "flipped weights": lambda c: _flip(next((c / "state").glob("model.layers.1*.safetensors")), offset=-100),
    "truncated state": lambda c: os.truncate(next((c / "state").glob("*.exp_avg.safetensors")), 100),
    "empty state": lambda c: os.truncate(next((c / "state").glob("*.safetensors")), 0),
    "missing state": lambda c: next((c / "state").glob("*.safetensors")).unlink(),
    "truncated trainer state": lambda c: os.truncate(c / "trainer_state.json", 20),
    "truncated rng state": lambda c: os.truncate(c / "rng_state.pth", 50),
    "missing checksums": lambda c: (c / "checksums.json").unlink(),
    "missing trainer state": lambda c: (c / "trainer_state.json").unlink(),  # was skipped by auto in silence
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_never_resumed(recipe, damage, capsys, interrupted_after):
    """Killed after step 5 (checkpoints 2 and 4), checkpoint-4 damaged: ``auto`` falls back to checkpoint-2,
    says so, and repeats the uninterrupted run's losses exactly; naming checkpoint-4 is an error naming
    the file (exit 2 on the command line)."""
    whole = train(recipe, ("training.output_dir=" + str(recipe.parent / "whole"),), progress=False)
    with interrupted_after(5), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    run_dir = recipe.parent / "run"
    DAMAGE[damage](run_dir / "checkpoint-4")
    with pytest.raises((IntegrityError, ConfigError)) as info:
        train(recipe, (f"training.resume_from_checkpoint={run_dir}/checkpoint-4",), progress=False)
    assert "checkpoint-4" in str(info.value) and "damaged" in str(info.value)
    cli = _cli("train", recipe, f"training.resume_from_checkpoint={run_dir}/checkpoint-4", "-q")
    assert cli.exit_code == 2 and "damaged" in cli.output
    resumed = train(recipe, ("training.resume_from_checkpoint=auto",), progress=True)
    assert "checkpoint-4 is damaged" in capsys.readouterr().out
    assert resumed.first_step == 3
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[2:]), rtol=1e-6, atol=0
    )
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_checksums_cover_every_file_of_a_checkpoint(recipe):
    train(recipe, ("training.max_steps=2",), progress=False)
    path = recipe.parent / "run" / "checkpoint-2"
    table = json.loads((path / "checksums.json").read_text())
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "checksums.json"}
    assert set(table) == files and "trainer_state.json" in files and "rng_state.pth" in files
    ckpt.verify(path)


def test_every_checkpoint_damaged_is_an_error_that_says_how_to_start_over(recipe):
    train(recipe, ("training.max_steps=4", "training.save_total_limit=1"), progress=False)
    run_dir = recipe.parent / "run"
    _flip(next((run_dir / "checkpoint-4" / "state").glob("*.safetensors")))
    with pytest.raises(IntegrityError, match="every checkpoint .* is damaged.*overwrite_output_dir"):
        train(recipe, ("training.resume_from_checkpoint=auto", "training.max_steps=6"), progress=False)


# ----------------------------------------------------------------------------- non-finite values


def test_non_finite_settings_are_refused():
    from tiertune.config.recipe import Recipe, TrainingSection

    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="training.learning_rate must be a finite number"):
            Recipe(training=TrainingSection(learning_rate=value))
    with pytest.raises(ConfigError, match="training.max_grad_norm must be a finite number"):
        Recipe(training=TrainingSection(max_grad_norm=float("inf")))


@pytest.mark.parametrize(
    "variant",
    [
        {},  # speculative optimizer under clipping: the bad step is never applied
        {"training.max_grad_norm": "0"},  # in place during backward, no clipping
        {"method.type": "lora", "model.quantize": "nf4"},
    ],
)
def test_a_non_finite_step_stops_the_run_and_saves_nothing_after_the_last_good_step(
    recipe, monkeypatch, variant
):
    """Step 5's loss is NaN: the run stops (exit 3 on the command line) with the step and the newest
    checkpoint named, exports nothing, and checkpoint-4 (written in the background while step 5 ran) holds
    finite state and resumes."""
    loss_sum = CausalLMLoss.__call__
    calls = []

    def poisoned(self, ids, extra, target):
        calls.append(1)
        out = loss_sum(self, ids, extra, target)
        return out * float("nan") if len(calls) == 5 else out  # step 5 (one micro-batch per step)

    monkeypatch.setattr(CausalLMLoss, "__call__", poisoned)
    overrides = tuple(f"{k}={v}" for k, v in variant.items())
    with pytest.raises(
        NonFiniteError, match=r"step 5 of 6: the loss is nan.*checkpoint-4.*holds the last good"
    ):
        train(recipe, overrides, progress=False)
    run_dir = recipe.parent / "run"
    assert (
        not (run_dir / "model.safetensors").exists() and not (run_dir / "adapter_model.safetensors").exists()
    )
    assert not (run_dir / "trainer_state.json").exists()
    assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4"]
    assert _log_steps(run_dir) == [1, 2, 3, 4]
    from safetensors.torch import load_file

    for file in [
        *(run_dir / "checkpoint-4").glob("*.safetensors"),
        *(run_dir / "checkpoint-4").glob("state/*.safetensors"),
    ]:
        assert all(torch.isfinite(t).all() for t in load_file(file).values()), file
    calls.clear()
    monkeypatch.setattr(CausalLMLoss, "__call__", poisoned)  # NaN again at the 5th call: CLI exit 3
    cli = _cli("train", recipe, *overrides, "training.overwrite_output_dir=true", "-q")
    assert cli.exit_code == 3 and "the loss is nan" in cli.output
    monkeypatch.setattr(CausalLMLoss, "__call__", loss_sum)
    resumed = train(recipe, (*overrides, "training.resume_from_checkpoint=auto"), progress=False)
    assert resumed.first_step == 5 and all(map(torch.isfinite, torch.tensor(resumed.losses)))


# ----------------------------------------------------------------------------- the log


def test_a_restart_without_a_checkpoint_logs_each_step_once(recipe, interrupted_after):
    """Killed before its first checkpoint, the same run started again with ``auto`` starts over from step 1:
    its log is not appended to."""
    with interrupted_after(1), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    run_dir = recipe.parent / "run"
    assert _log_steps(run_dir) == [1] and not checkpoints(run_dir)
    train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_run_stopped_before_its_first_checkpoint_restarts_on_another_number_of_processes(recipe):
    """What 2 ranks of 3 rows each leave when stopped before their first checkpoint (their recipe, with
    per_device_train_batch_size 3, and the launch they ran as) is the same run for one process of 6 rows: it
    starts over there, with or without ``auto``; one process of another batch is refused, naming the setting that
    keeps it (before: "holds another run's outputs", whatever the batch)."""
    from tiertune.config.recipe import load_recipe
    from tiertune.finetune.rundir import LAUNCH_FILE

    run_dir = recipe.parent / "run"

    def stopped_on_two_ranks() -> None:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        written = load_recipe(recipe, ("training.per_device_train_batch_size=3",)).with_absolute_paths()
        (run_dir / "recipe.yaml").write_text(written.to_yaml())
        (run_dir / LAUNCH_FILE).write_text(json.dumps({"world_size": 2, "rows_per_micro_batch": 6}))
        (run_dir / "trainer_log.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")

    stopped_on_two_ranks()
    before = _snapshot(run_dir)
    with pytest.raises(
        ConfigError, match=r"processes\): '3 x 2' -> '4 x 1'.*per_device_train_batch_size=6\)"
    ):
        train(
            recipe,
            ("training.per_device_train_batch_size=4", "training.resume_from_checkpoint=auto"),
            progress=False,
        )
    assert _snapshot(run_dir) == before
    for setting in ("training.resume_from_checkpoint=auto", "training.resume_from_checkpoint=null"):
        stopped_on_two_ranks()
        done = train(
            recipe,
            ("training.per_device_train_batch_size=6", "training.max_steps=2", setting),
            progress=False,
        )
        assert done.first_step == 1 and _log_steps(run_dir) == [1, 2]
        assert json.loads((run_dir / LAUNCH_FILE).read_text()) == {"world_size": 1, "rows_per_micro_batch": 6}


def test_a_run_that_failed_before_its_first_step_does_not_block_its_directory(recipe, monkeypatch):
    """A run that loaded its model and then failed before any step (its recipe written, no step logged) leaves
    nothing anyone could lose: the next run there starts, whatever its recipe (before: "holds another run's
    outputs" until the user found overwrite_output_dir). A run that made a step still keeps its directory."""
    step = StreamedTrainer.step

    def fail(self, micro_batches):
        if self.compute.ledger:  # the plan's step on a ledger, before the run (``engine.registered``)
            return step(self, micro_batches)
        raise ConfigError("a setting to fix, found at the first step")

    with monkeypatch.context() as patched:
        patched.setattr(StreamedTrainer, "step", fail)
        with pytest.raises(ConfigError, match="found at the first step"):
            train(recipe, progress=False)
    run_dir = recipe.parent / "run"
    assert (run_dir / "recipe.yaml").is_file() and not _log_steps(run_dir)
    done = train(recipe, ("training.learning_rate=1e-3", "training.max_steps=2"), progress=False)
    assert done.first_step == 1 and _log_steps(run_dir) == [1, 2]
    (run_dir / "trainer_state.json").unlink()  # as if stopped after step 2, before its checkpoint
    shutil.rmtree(run_dir / "checkpoint-2")
    for name in os.listdir(run_dir):
        if name.endswith(".safetensors") or (name.endswith(".json") and name != "launch.json"):
            (run_dir / name).unlink()
    with pytest.raises(ConfigError, match="holds the start of another run"):
        train(recipe, ("training.learning_rate=2e-3",), progress=False)


def test_a_resumed_log_never_repeats_a_step(recipe, interrupted_after):
    """A checkpoint whose log_history holds steps after it (as the background writer once serialised the live
    list) resumes with its own steps only: the log has each step once."""
    with interrupted_after(5), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    run_dir = recipe.parent / "run"
    checkpoint = run_dir / "checkpoint-4"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert [r["step"] for r in state["log_history"]] == [1, 2, 3, 4]
    state["log_history"].append(dict(state["log_history"][-1], step=5))
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    (checkpoint / "checksums.json").unlink()
    ckpt.write_checksums(checkpoint)
    train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_holds_the_log_of_its_own_step(recipe, monkeypatch):
    """The background writer serialises a checkpoint's trainer state after the next steps were logged: its
    log_history is the one of its step (before: the live list, holding later steps)."""
    import threading

    from tiertune.finetune import reporting

    later = threading.Event()
    log = reporting.Reporters.log

    def logged(self, record):  # step 3 logged: the writer of checkpoint-2 may go on
        log(self, record)
        if record["step"] >= 3:
            later.set()

    merge = ckpt.merge

    def merge_late(*args, **kwargs):  # the writer of checkpoint-2 serialises its state after step 3
        later.wait(timeout=60)
        return merge(*args, **kwargs)

    monkeypatch.setattr(reporting.Reporters, "log", logged)
    monkeypatch.setattr(ckpt, "merge", merge_late)
    train(recipe, ("training.max_steps=4",), progress=False)
    for step in (2, 4):
        state = json.loads((recipe.parent / "run" / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert [r["step"] for r in state["log_history"]] == list(range(1, step + 1))
    assert later.is_set()


# ----------------------------------------------------------------------------- a full disk


def test_a_full_disk_is_said_before_training(recipe, monkeypatch):
    usage = shutil.disk_usage

    def full(path):  # the run directory's filesystem is full (the disk tier's directory is not)
        return usage(path)._replace(free=4096) if str(path).endswith("/run") else usage(path)

    monkeypatch.setattr(shutil, "disk_usage", full)
    with pytest.raises(
        DiskFullError, match=r"has 4.00 KiB free, and the run will write .* save no checkpoints"
    ):
        train(recipe, progress=False)
    assert not (recipe.parent / "run" / "trainer_log.jsonl").read_text()


def test_no_space_while_writing_a_checkpoint_stops_the_run_at_that_step(recipe, monkeypatch):
    """ENOSPC in the checkpoint's writer thread: the run stops at the next step boundary with a DiskFullError
    saying how much it needs, and the partial directory is gone."""
    from safetensors.torch import save_file

    def no_space(tensors, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr("safetensors.torch.save_file", no_space)
    seen = []
    step = StreamedTrainer.step

    def counting(self, micro):
        seen.append(0 if self.compute.ledger else 1)  # (the plan's step on a ledger is no step of the run)
        return step(self, micro)

    monkeypatch.setattr(StreamedTrainer, "step", counting)
    with pytest.raises(DiskFullError, match=r"no room for checkpoint-4 .* it needs .* free"):
        train(recipe, progress=False)
    run_dir = recipe.parent / "run"
    assert sum(seen) == 5  # stopped at the step after the failed save began, not at the next save
    assert not list(run_dir.glob(".checkpoint-*")) and [p.name for p in checkpoints(run_dir)] == [
        "checkpoint-2"
    ]


# ----------------------------------------------------------------------------- inputs checked up front


def test_token_ids_beyond_the_vocabulary_are_a_data_error(recipe, tmp_path, model_dir):
    """The model's directory holds another model's tokenizer (a larger vocabulary): said before loading,
    instead of an IndexError in the embedding during the first step."""
    from tiertune.cli.demo import make_tokenizer

    mixed = tmp_path / "mixed"
    shutil.copytree(model_dir, mixed)
    words = [f"word{i} another{i} token{i}" for i in range(200)]
    make_tokenizer(
        words + [json.loads(line)["text"] for line in (tmp_path / "data.jsonl").read_text().splitlines()],
        mixed,
    )
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
    with pytest.raises(DataError, match=r"token ids up to \d+, but the model's vocabulary has \d+ entries"):
        train(recipe, (f"model.path={mixed}", f"data.path={data}"), progress=False)


def test_a_damaged_file_that_passes_its_checksum_is_still_a_typed_error(recipe, model_dir):
    """Loading names the file too (a checkpoint whose checksums were rewritten after the damage, or one
    written before checksums existed)."""
    from tiertune.config.plan import plan
    from tiertune.config.recipe import load_recipe
    from tiertune.finetune.checkpoint import load_checkpoint, write_checksums

    train(recipe, ("training.max_steps=2",), progress=False)
    path = recipe.parent / "run" / "checkpoint-2"
    victim = next((path / "state").glob("*.exp_avg.safetensors"))
    os.truncate(victim, 100)
    (path / "checksums.json").unlink()
    write_checksums(path)
    store, engine = plan(load_recipe(recipe).with_absolute_paths())
    trainer = StreamedTrainer(str(model_dir), store, engine)
    try:
        with pytest.raises(IntegrityError, match=f"{victim.name} cannot be read"):
            load_checkpoint(trainer, path)
    finally:
        trainer.close()


def test_relative_paths_are_relative_to_the_working_directory_and_stored_absolute(
    recipe, tmp_path, monkeypatch, model_dir
):
    import yaml

    monkeypatch.chdir(tmp_path)
    result = train(
        recipe,
        ("training.output_dir=rel/run", "training.max_steps=1", "data.path=data.jsonl"),
        progress=False,
    )
    assert result.output_dir == tmp_path / "rel" / "run"
    saved = yaml.safe_load((result.output_dir / "recipe.yaml").read_text())
    assert saved["data"]["path"] == str(tmp_path / "data.jsonl")
    assert saved["training"]["output_dir"] == str(tmp_path / "rel" / "run")
