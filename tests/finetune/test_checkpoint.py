"""Checkpoints: atomic, pruned, and exact resume, also after SIGKILL mid-training and mid-write."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import yaml

from tiertune.engine import StreamedTrainer
from tiertune.errors import ConfigError
from tiertune.finetune.checkpoint import checkpoints
from tiertune.finetune.train import train

STEPS = 8
TEXTS = [
    f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old", "fat") for b in ("blue", "flat", "wet")
]


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(3)


def _recipe(tmp_path, model_dir, name, **overrides):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    recipe = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"path": str(data), "max_seq_len": 32, "shuffle": True},
        "training": {
            "output_dir": str(tmp_path / name),
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": "3e-3",
            "logging_steps": 1,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 2,
            "save_steps": 2,
            "weight_decay": 0.01,
        },
        "offload": {
            "disk_path": str(tmp_path / f"{name}-nvme"),
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
        "method": {"lora": {"r": 4, "dropout": 0.1}, "galore": {"rank": 4, "update_proj_gap": 3}},
    }
    for key, value in overrides.items():
        section, field = key.split("__")
        recipe[section][field] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _logged_losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "trainer_log.jsonl").read_text().splitlines()]


VARIANTS = {
    "full": {},
    "full-8bit": {"training__optim": "adamw_bnb_8bit"},
    # a checkpoint holds the update of its step, and weights one update behind, as the next step needs them
    "full-delayed": {"offload__delay_update": True},
    "galore": {"method__type": "galore"},
    "qlora": {"method__type": "lora", "model__quantize": "nf4"},  # adapter dropout: the RNG state matters
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_after_an_interruption_repeats_the_uninterrupted_run(
    tmp_path, model_dir, interrupted_after, variant
):
    """Interrupted after step 5 (checkpoints at 2 and 4), resumed with ``auto``: steps 5-8 give the same
    losses as the uninterrupted run, and the final weights are the same."""
    overrides = VARIANTS[variant]
    whole = train(_recipe(tmp_path, model_dir, "whole", **overrides), progress=False)
    recipe = _recipe(tmp_path, model_dir, "cut", **overrides)
    with interrupted_after(5), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    run_dir = tmp_path / "cut"
    assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4"]
    resumed = train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    assert resumed.first_step == 5
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[4:]), rtol=1e-6, atol=0
    )
    assert _logged_losses(run_dir) == pytest.approx(whole.losses, rel=1e-6)  # the log holds each step once
    out = "adapter_model.safetensors" if variant == "qlora" else "model.safetensors"
    from safetensors.torch import load_file

    mine, theirs = load_file(run_dir / out), load_file(tmp_path / "whole" / out)
    for name, value in theirs.items():
        torch.testing.assert_close(mine[name], value, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_written_before_the_state_index_resumes(tmp_path, model_dir, interrupted_after):
    """A one-process checkpoint of the form tiertune wrote before ``state/index.json`` (whole tensors in
    ``state/<chunk>.safetensors``, the chunks named in ``trainer_state.json``) is read through an index built
    from its files, and the resumed run repeats the uninterrupted one."""
    from tiertune.finetune.checkpoint import STATE_FILE, write_checksums

    whole = train(_recipe(tmp_path, model_dir, "whole", training__optim="adamw_bnb_8bit"), progress=False)
    recipe = _recipe(tmp_path, model_dir, "cut", training__optim="adamw_bnb_8bit")
    with interrupted_after(5), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    old = tmp_path / "cut" / "checkpoint-4"
    (old / "state" / "index.json").unlink()
    state = json.loads((old / STATE_FILE).read_text())
    state["tiertune"]["state_chunks"] = sorted(p.stem for p in (old / "state").glob("*.safetensors"))
    (old / STATE_FILE).write_text(json.dumps(state))
    (old / "checksums.json").unlink()
    write_checksums(old)
    resumed = train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    assert resumed.first_step == 5
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[4:]), rtol=1e-6, atol=0
    )


def test_galore_resumes_across_a_refresh_that_follows_the_checkpoint(tmp_path, model_dir, interrupted_after):
    """GaLore refreshes its projections in backward, on the device, while the checkpoint of the step before
    may still be written in the background: checkpoint-3 is saved just before step 4 refreshes them
    (update_proj_gap 3: steps 1, 4, 7). Resumed from it, the run repeats the uninterrupted one."""
    more = {"method__type": "galore", "training__save_steps": 3}
    whole = train(_recipe(tmp_path, model_dir, "whole", **more), progress=False)
    recipe = _recipe(tmp_path, model_dir, "cut", **more)
    with interrupted_after(5), pytest.raises(KeyboardInterrupt):
        train(recipe, progress=False)
    assert [p.name for p in checkpoints(tmp_path / "cut")] == ["checkpoint-3"]
    resumed = train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    assert resumed.first_step == 4
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[3:]), rtol=1e-6, atol=0
    )


def test_save_total_limit_keeps_the_newest(tmp_path, model_dir):
    """The last step is saved too (as the Hugging Face Trainer does), so a finished run can go further."""
    recipe = _recipe(tmp_path, model_dir, "run", training__save_total_limit=2, training__save_steps=3)
    train(recipe, progress=False)
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["checkpoint-6", "checkpoint-8"]


def test_a_checkpoint_of_another_recipe_is_refused(tmp_path, model_dir):
    recipe = _recipe(tmp_path, model_dir, "run")
    train(recipe, progress=False)
    more = ("training.max_steps=10", "training.resume_from_checkpoint=auto")
    with pytest.raises(ConfigError, match="written by another run: method.type: 'full' -> 'galore'"):
        train(recipe, ("method.type=galore", *more), progress=False)
    # allowed to differ, the recipe still cannot put its states into another method's chunks
    with pytest.raises(ConfigError, match="written by a run with other training state"):
        train(recipe, ("method.type=galore", "training.allow_recipe_changes=true", *more), progress=False)
    (tmp_path / "nope").mkdir()
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        train(recipe, (f"training.resume_from_checkpoint={tmp_path}/nope",), progress=False)


# ----------------------------------------------------------------------------- SIGKILL, in a subprocess

SLOW_RUN = """
import time, sys
from tiertune.engine import StreamedTrainer
from tiertune.finetune.train import train
step = StreamedTrainer.step
def slow(self, micro):  # slow enough for the parent to kill it between two checkpoints
    time.sleep(0.3)
    return step(self, micro)
StreamedTrainer.step = slow
train(sys.argv[1], progress=False)
"""

KILLED_WHILE_SAVING = """
import os, signal, sys
import tiertune.finetune.checkpoint as checkpoint
from tiertune.finetune.train import train
fsync = checkpoint.fsync_file
def dying(path):  # killed half-way through writing checkpoint-6's files
    fsync(path)
    if ".checkpoint-6.partial" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.fsync_file = dying
train(sys.argv[1], progress=False)
"""


def _run(code, recipe):
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(recipe)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["training", "saving"])
def test_sigkill_then_resume_is_exact(tmp_path, model_dir, when):
    whole = train(_recipe(tmp_path, model_dir, "whole"), progress=False)
    recipe = _recipe(tmp_path, model_dir, "cut")
    run_dir = tmp_path / "cut"
    if when == "training":
        proc = _run(SLOW_RUN, recipe)
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoint-4" / "trainer_state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    else:
        proc = _run(KILLED_WHILE_SAVING, recipe)
    proc.wait(timeout=240)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "model.safetensors").exists()  # it did not finish
    if when == "saving":
        assert (run_dir / ".checkpoint-6.partial").is_dir() and not (run_dir / "checkpoint-6").exists()
    done = checkpoints(run_dir)[-1]
    resumed = train(recipe, ("training.resume_from_checkpoint=auto",), progress=False)
    first = int(done.name.split("-")[1])
    assert resumed.first_step == first + 1
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(whole.losses[first:]), rtol=1e-6, atol=0
    )
    assert not list(run_dir.glob(".checkpoint-*"))  # the interrupted write was cleaned up


def test_training_goes_on_while_a_checkpoint_is_written_and_it_holds_the_step_boundary(
    tmp_path, model_dir, disk_dir, monkeypatch
):
    """The writer thread is held back; the next step changes every chunk, each written first by the
    optimizer thread that changes it: the checkpoint holds the state of the step boundary, byte for byte."""
    import threading

    from safetensors.torch import load_file

    from tiertune.engine import EngineConfig
    from tiertune.finetune import checkpoint
    from tiertune.finetune.data import batches, load_data
    from tiertune.offload.store import StoreConfig

    store = StoreConfig.resolve(device_budget="4MiB", host_budget="2MiB", disk_path=str(disk_dir))
    config = EngineConfig(params="disk", optimizer_states="disk", max_steps=4, learning_rate=1e-3)
    trainer = StreamedTrainer(str(model_dir), store, config)
    from transformers import AutoTokenizer

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    stream = batches(load_data(data, AutoTokenizer.from_pretrained(model_dir), "text", 32), 4, 0, False, 0)
    gate = threading.Event()
    run = checkpoint.CheckpointWriter._run

    def held_back(self, *args):
        gate.wait()
        return run(self, *args)

    monkeypatch.setattr(checkpoint.CheckpointWriter, "_run", held_back)
    writer = checkpoint.CheckpointWriter(trainer, tmp_path / "run", None)
    (tmp_path / "run").mkdir()
    try:
        trainer.step([next(stream)])
        boundary = {c.name: trainer.store.read(c) for c in trainer.state_chunks()}
        path = writer.save({"global_step": 1, "log_history": [], "tiertune": {"micro_batches": 1}})
        trainer.step([next(stream)])  # the next step runs while nothing has been written by the writer
        assert not path.exists() and writer.blocked_s > 0
        gate.set()
        assert writer.wait() == path
        after = {c.name: trainer.store.read(c) for c in trainer.state_chunks()}
    finally:
        gate.set()
        trainer.close()
    changed = [n for n in boundary if not all(torch.equal(after[n][k], v) for k, v in boundary[n].items())]
    assert len(changed) == len(boundary)  # the step changed every chunk after the save began
    for name, tensors in boundary.items():
        saved = load_file(path / "state" / f"{name}.safetensors")
        assert all(torch.equal(saved[k], v) for k, v in tensors.items()), name


def test_a_cancelled_checkpoint_stops_at_its_next_file_and_leaves_the_one_before(
    tmp_path, model_dir, disk_dir
):
    """A run stopping for a signal drops the checkpoint being written (``cancel``): the writer writes no chunk
    after it, removes the partial directory, the checkpoint before it stays the newest, intact, and a later save
    writes its checkpoint as usual."""
    from tiertune.engine import EngineConfig
    from tiertune.finetune import checkpoint
    from tiertune.offload.store import StoreConfig

    store = StoreConfig.resolve(device_budget="4MiB", host_budget="2MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(model_dir), store, EngineConfig(params="disk", optimizer_states="disk"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = checkpoint.CheckpointWriter(trainer, run_dir, None)
    written: list[str] = []
    write = writer._write

    def counted(chunk) -> None:
        written.append(chunk.name)
        if len(written) == len(chunks) + 1:  # the second checkpoint's first chunk
            writer.cancel()
        write(chunk)

    writer._write = counted
    try:
        chunks = trainer.state_chunks()
        assert len(chunks) >= 3
        first = writer.save({"global_step": 1, "log_history": [], "tiertune": {"micro_batches": 1}})
        assert writer.wait() == first and len(written) == len(chunks)
        second = writer.save({"global_step": 2, "log_history": [], "tiertune": {"micro_batches": 2}})
        assert writer.wait() == first  # the newest written is still the first
        assert len(written) == len(chunks) + 1  # nothing after the cancel
        assert not second.exists() and not list(run_dir.glob(".checkpoint-*"))
        assert checkpoints(run_dir) == [first]
        checkpoint.verify(first)
        third = writer.save({"global_step": 3, "log_history": [], "tiertune": {"micro_batches": 3}})
        assert writer.wait() == third  # the cancel dropped one checkpoint, not the ones after it
    finally:
        trainer.close()
    assert len(written) == 2 * len(chunks) + 1
    assert checkpoints(run_dir) == [first, third]
    checkpoint.verify(third)
