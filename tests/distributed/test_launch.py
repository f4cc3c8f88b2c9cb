"""``tiertune train`` launched as several processes by torchrun and by ``accelerate launch`` (on CPUs, gloo,
loopback rendezvous, a timeout on every collective): the ranks train as one process with their global batch,
rank 0 alone writes the run's files, each rank offloads into its own directory."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

TIMEOUT = 300


def _env() -> dict[str, str]:
    return dict(os.environ, TIERTUNE_COLLECTIVE_TIMEOUT="60", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "trainer_log.jsonl").read_text().splitlines()]


def _recipe(tmp_path, cat_model, write_recipe, name: str, batch: int, **training):
    # two micro-batches of 4 rows per rank (per_device 2 x 2 ranks = one process's 4)
    sections = {
        "training": {"output_dir": str(tmp_path / name), "per_device_train_batch_size": batch, "save_steps": 0,
                     "gradient_accumulation_steps": 2, "max_steps": 4, "learning_rate": 3e-3, **training},
        "offload": {"disk_path": str(tmp_path / f"{name}-nvme"), "params": "disk", "optimizer_states": "disk",
                    "device_budget": "16MiB", "host_budget": "16MiB"},
        "data": {"shuffle": False},
    }  # fmt: skip
    return write_recipe(tmp_path, cat_model(2), name=name, **sections)


def test_torchrun_trains_as_one_process_with_the_global_batch(tmp_path, cat_model, write_recipe):
    one = _recipe(tmp_path, cat_model, write_recipe, "one", batch=4)
    two = _recipe(tmp_path, cat_model, write_recipe, "two", batch=2)
    _run([sys.executable, "-m", "tiertune.cli", "train", str(one), "--quiet"])
    done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "-m", "tiertune.cli", "train", str(two)])  # fmt: skip
    want, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(got) == len(want) == 4
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    # rank 0 writes the run's files and reports once; each rank offloaded into its own directory
    assert done.stdout.count("done: 4 steps") == 1
    assert "x 2 ranks" in done.stdout
    assert sorted(p.name for p in (tmp_path / "two-nvme").iterdir()) == ["rank-0", "rank-1"]


@pytest.mark.skipif(shutil.which("accelerate") is None and not Path(sys.executable).with_name("accelerate").exists(),
                    reason="accelerate's launcher is not installed")  # fmt: skip
def test_accelerate_launch_starts_the_ranks(tmp_path, cat_model, write_recipe):
    two = _recipe(tmp_path, cat_model, write_recipe, "acc", batch=2, max_steps=2)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    done = _run([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "tiertune.cli", "train", str(two)])  # fmt: skip
    assert "x 2 ranks" in done.stdout
    assert len(_losses(tmp_path / "acc")) == 2
    assert (tmp_path / "acc" / "model.safetensors").is_file()
    # --cpu starts one process whatever --num_processes says: the run says so, with the command that works
    one = _recipe(tmp_path, cat_model, write_recipe, "acc-cpu", batch=2, max_steps=1)
    done = _run([accelerate, "launch", "--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
                 "no", "--dynamo_backend", "no", "-m", "tiertune.cli", "train", str(one)])  # fmt: skip
    assert "accelerate launch --multi_gpu --num_processes N" in done.stdout


def test_a_sharded_run_refuses_what_it_cannot_do_yet_before_loading(tmp_path, cat_model, write_recipe, monkeypatch):
    from tiertune.errors import ConfigError
    from tiertune.finetune.recipe import load_recipe
    from tiertune.finetune.train import plan

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    recipe = load_recipe(_recipe(tmp_path, cat_model, write_recipe, "galore", batch=2))
    store, _ = plan(recipe)
    assert store.num_shards == 2 and store.disk_path.endswith("rank-1")
    assert store.host_budget == 8 << 20  # the node's 16 MiB shared by its 2 ranks
    with pytest.raises(ConfigError, match="galore does not run sharded"):
        plan(load_recipe(_recipe(tmp_path, cat_model, write_recipe, "g", batch=2), ("method.type=galore",)))
    with pytest.raises(ConfigError, match="save_steps=0"):
        plan(load_recipe(_recipe(tmp_path, cat_model, write_recipe, "s", batch=2, save_steps=2)))
