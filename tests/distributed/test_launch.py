"""``tiertune train`` launched as several processes by torchrun and by ``accelerate launch`` (on CPUs, gloo,
loopback rendezvous, a timeout on every collective): the ranks train as one process with their global batch,
rank 0 alone writes the run's files, each rank offloads into its own directory."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launching import launch_env, torchrun
from safetensors.torch import load_file


def _recipe(tmp_path, cat_model, write_recipe, name: str, batch: int, **training):
    # two micro-batches of 4 rows per rank (per_device 2 x 2 ranks = one process's 4)
    sections = {
        "training": {
            "output_dir": str(tmp_path / name),
            "per_device_train_batch_size": batch,
            "save_steps": 0,
            "gradient_accumulation_steps": 2,
            "max_steps": 4,
            "learning_rate": 3e-3,
            **training,
        },
        "offload": {
            "disk_path": str(tmp_path / f"{name}-nvme"),
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "16MiB",
            "host_budget": "16MiB",
        },
        "data": {"shuffle": False},
    }
    return write_recipe(tmp_path, cat_model(2), name=name, **sections)


def test_torchrun_trains_as_one_process_with_the_global_batch(
    tmp_path, cat_model, write_recipe, launch, losses
):
    one = _recipe(tmp_path, cat_model, write_recipe, "one", batch=4)
    two = _recipe(tmp_path, cat_model, write_recipe, "two", batch=2)
    launch(one, "--quiet")
    done = launch(two, ranks=2)
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(got) == list(want) == [1, 2, 3, 4]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-5 * abs(want[step])
    a, b = (
        load_file(tmp_path / "one" / "model.safetensors"),
        load_file(tmp_path / "two" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    # the estimate for 2 processes predicts the bytes each rank sends per step, as the run logged them, to the
    # byte: the engine's step on a ledger, its collectives counting (weights gathered, gradients reduced and
    # scattered, the step's token count, loss and gradient norm all-reduced)
    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate

    predicted = estimate(load_recipe(two), measure=False, processes=2).scale_out.wire
    assert set(predicted) == {"all_gather", "reduce_scatter", "all_reduce"}
    records = [json.loads(line) for line in (tmp_path / "two" / "trainer_log.jsonl").read_text().splitlines()]
    for sent in (r["wire_bytes"] for r in records):
        assert sent == predicted
    # rank 0 writes the run's files and reports once; each rank offloaded into its own directory
    assert done.stdout.count("done: 4 steps") == 1
    assert "x 2 ranks" in done.stdout
    assert sorted(p.name for p in (tmp_path / "two-nvme").iterdir()) == ["rank-0", "rank-1"]


@pytest.mark.skipif(
    shutil.which("accelerate") is None and not Path(sys.executable).with_name("accelerate").exists(),
    reason="accelerate's launcher is not installed",
)
def test_accelerate_launch_starts_the_ranks(tmp_path, cat_model, write_recipe, launch, losses):
    two = _recipe(tmp_path, cat_model, write_recipe, "acc", batch=2, max_steps=2)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    done = launch(
        two,
        command=[
            accelerate,
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ],
    )
    assert "x 2 ranks" in done.stdout
    assert len(losses(tmp_path / "acc")) == 2
    assert (tmp_path / "acc" / "model.safetensors").is_file()
    # --cpu starts one process whatever --num_processes says: the run says so, with the command that works
    one = _recipe(tmp_path, cat_model, write_recipe, "acc-cpu", batch=2, max_steps=1)
    done = launch(
        one,
        command=[
            accelerate,
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ],
    )
    assert "accelerate launch --multi_gpu --num_processes N" in done.stdout


def test_a_sharded_run_plans_its_share_and_refuses_what_it_cannot_do_before_loading(
    tmp_path, cat_model, write_recipe, monkeypatch
):
    from tiertune.config.plan import plan
    from tiertune.config.recipe import load_recipe
    from tiertune.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    recipe = load_recipe(_recipe(tmp_path, cat_model, write_recipe, "galore", batch=2))
    store, _ = plan(recipe)
    assert store.num_shards == 2 and store.disk_path.endswith("rank-1")
    assert store.host_budget == 8 << 20  # the node's 16 MiB shared by its 2 ranks
    with pytest.raises(ConfigError, match="galore does not run sharded"):
        plan(load_recipe(_recipe(tmp_path, cat_model, write_recipe, "g", batch=2), ("method.type=galore",)))


def _training(tmp_path, recipe, command):
    """Start ``command`` (a launch of ``recipe`` with a long run) and wait until its ranks are training (rank 0
    logged a step); returns the process and its ranks' pids."""
    log = open(tmp_path / "launch.log", "w")  # noqa: SIM115 (closed by the caller's process end)
    proc = subprocess.Popen(
        command, env=launch_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True
    )
    deadline = time.monotonic() + 240
    run_log = tmp_path / "long" / "trainer_log.jsonl"
    while not (run_log.is_file() and run_log.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()[
            -3000:
        ]
        time.sleep(0.2)
    ranks = [
        p.pid
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "tiertune.cli" in " ".join(p.cmdline())
    ]
    assert len(ranks) == 2, ranks
    return proc, ranks


def _long_recipe(tmp_path, cat_model, write_recipe):
    return _recipe(
        tmp_path, cat_model, write_recipe, "long", batch=2, max_steps=2000, save_steps=20, logging_steps=1
    )


def test_the_ranks_stop_when_their_launcher_is_killed(tmp_path, cat_model, write_recipe):
    """kill -9 of torchrun left its ranks training unsupervised (issue 26): each rank asked the kernel for
    SIGTERM when its launcher dies, and stops through its clean-up (its offload files removed)."""
    recipe = _long_recipe(tmp_path, cat_model, write_recipe)
    proc, ranks = _training(
        tmp_path, recipe, [*torchrun(2), "-m", "tiertune.cli", "train", str(recipe), "-q"]
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(r) and psutil.Process(r).status() != psutil.STATUS_ZOMBIE for r in ranks):
        assert time.monotonic() < deadline, "the ranks went on training after their launcher was killed"
        time.sleep(0.2)
    log = (tmp_path / "launch.log").read_text()
    assert "stopped by SIGTERM" in log
    # how to resume names a launcher and the processes (as printed, `tiertune train` alone would be refused)
    assert "resume with: tiertune launch --standalone --nproc_per_node 2 train" in log, log[-2000:]
    assert not list((tmp_path / "long-nvme").rglob("*.slots"))  # each rank removed its offload files


def test_tiertune_launch_says_how_a_stop_ended(tmp_path, cat_model, write_recipe):
    """SIGTERM to the launch: the ranks stop cleanly (rank 0 says where and how to resume), and the launch
    itself ends with exit 143 and one line saying so, not torchrun's SignalException traceback; a setting to fix
    is the ranks' exit 2, the launch's last line naming it."""
    tool = str(Path(sys.executable).with_name("tiertune"))
    recipe = _long_recipe(tmp_path, cat_model, write_recipe)
    command = [tool, "launch", "--standalone", "--nproc_per_node", "2", "train", str(recipe), "-q"]
    proc, ranks = _training(tmp_path, recipe, command)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    # every rank stopped through its clean-up, and the launch with them, within seconds; none is left
    took = time.monotonic() - sent
    print(f"stop: TERM to tiertune launch (2 ranks training): {took:.2f} s to the exit")  # shown by pytest -s
    assert took <= 5, f"{took:.1f} s from SIGTERM to the launch's exit"
    assert not any(psutil.pid_exists(r) and psutil.Process(r).status() != psutil.STATUS_ZOMBIE for r in ranks)
    gone = time.monotonic() + 5
    while True:  # its session (every process it started) is empty
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < gone, [
            p.cmdline() for p in psutil.process_iter() if os.getpgid(p.pid) == proc.pid
        ]
        time.sleep(0.05)
    log = (tmp_path / "launch.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "tiertune: stopped by SIGTERM after step" in log
    assert "resume with: tiertune launch --standalone --nproc_per_node 2 train" in log
    assert log.strip().splitlines()[-1].startswith("tiertune launch: stopped by SIGTERM; every rank stopped")
    bad = subprocess.run(
        [*command, "training.learning_rate=-1"],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    # every rank fails alike: rank 0 says it
    assert bad.stderr.count("training.learning_rate must be >= 0") == 1
    assert re.match(r"tiertune launch: rank [01] exited with code 2", bad.stderr.strip().splitlines()[-1])


def test_a_launch_reports_the_rank_whose_error_it_was(monkeypatch):
    """Rank 1 failed with exit 2; torchrun then stopped rank 0, still exiting with the same error, by SIGTERM:
    the launch says rank 1's code, not rank 0's signal (as it once did, exiting 143 for a setting to fix)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from tiertune.finetune.ranks import launch

    def failed(args):
        first = ProcessFailure(local_rank=1, pid=11, exitcode=2, error_file="<N/A>")
        then = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file="<N/A>")
        then.timestamp = first.timestamp + 1
        raise ChildFailedError("tiertune.cli", {0: then, 1: first})

    monkeypatch.setattr(torchrun, "run", failed)
    code, said = launch(["--standalone", "--nproc_per_node", "2"], ["train", "recipe.yaml"])
    assert code == 2 and said.startswith("tiertune launch: rank 1 exited with code 2"), said
