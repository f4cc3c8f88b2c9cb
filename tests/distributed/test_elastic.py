"""Checkpoints of a sharded run: each rank writes its own shards, one index that does not depend on the number
of processes says where each tensor lies, and a run resumes on another number of processes (elastic resume)
continuing the loss sequence of the uninterrupted run; a rank killed mid-step leaves the newest checkpoint
intact and stops every rank."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from launching import TIMEOUT, launch_env, torchrun
from safetensors.torch import load_file

from tiertune.config.recipe import load_recipe
from tiertune.errors import ConfigError
from tiertune.estimates.report import estimate
from tiertune.finetune.checkpoint import checkpoints, latest_checkpoint, verify

pytestmark = pytest.mark.timeout(900)


def _recipe(tmp_path, cat_model, write_recipe, name: str, batch: int, **training):
    # a global micro-batch of 6 rows: 6 x 1 process, 3 x 2 ranks, 2 x 3 ranks; a constant learning rate, so
    # that a resumed run may stop at another max_steps and still continue the same steps
    sections = {
        "training": {
            "output_dir": str(tmp_path / name),
            "per_device_train_batch_size": batch,
            "max_steps": 6,
            "save_steps": 2,
            "learning_rate": 3e-3,
            "lr_scheduler_type": "constant",
            **training,
        },
        "offload": {
            "disk_path": str(tmp_path / f"{name}-nvme"),
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "16MiB",
            "host_budget": "16MiB",
        },
    }
    return write_recipe(tmp_path, cat_model(2), name=name, **sections)


def _close(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


def _weights_close(a_dir, b_dir, eight_bit: bool = False) -> None:
    """Within 1e-5; with 8-bit moments, the well-posed form of it: a last-bit difference of a gradient (the
    sums over ranks run in another order) can move an 8-bit state by one level, so the weights' relative norm
    gap is within 1e-5 and at most 1e-4 of the elements differ by more than 1e-5."""
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    if not eight_bit:
        assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
        return
    gap = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    norm = sum(float((b[k] ** 2).sum()) for k in a) ** 0.5
    off = sum(int(((a[k] - b[k]).abs() > 1e-5).sum()) for k in a)
    assert gap <= 1e-5 * norm and off <= 1e-4 * sum(v.numel() for v in a.values())


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_bnb_8bit"])
def test_a_run_resumes_on_another_number_of_processes(
    tmp_path, cat_model, write_recipe, launch, losses, optim
):
    """One process to 2 ranks, 2 ranks to 3 and to 1: each continues the uninterrupted run's losses and ends
    at its weights; a checkpoint of 2 ranks exports as the one process's checkpoint does. The 8-bit optimizer
    (its states resharded as blocks) goes from 1 to 2 and 2 to 3 ranks only: back to one process and the export
    take the same path as AdamW's."""
    eight_bit = optim == "adamw_bnb_8bit"
    if eight_bit:
        pytest.importorskip("bitsandbytes")

    def recipe(name: str, batch: int, **training):
        return _recipe(tmp_path, cat_model, write_recipe, name, batch, optim=optim, **training)

    launch(recipe("one", 6), "--quiet")  # uninterrupted: steps 1-6, checkpoints 2, 4, 6
    want = losses(tmp_path / "one")
    # 1 -> 2: from the one process's checkpoint-2, steps 3-4 on 2 ranks (3 rows each)
    done = launch(
        recipe("two", 3, max_steps=4, resume_from_checkpoint=str(tmp_path / "one" / "checkpoint-2")), ranks=2
    )
    assert "the global micro-batch stays 6 rows (3 per device x 2)" in done.stdout
    _close(losses(tmp_path / "two"), want, [3, 4])
    # each rank wrote its own shards, never gathered: about half of the one process's state bytes each
    sharded = tmp_path / "two" / "checkpoint-4"
    index = json.loads((sharded / "state" / "index.json").read_text())
    assert index["world_size"] == 2
    whole = sum(f.stat().st_size for f in (tmp_path / "one" / "checkpoint-4" / "state").glob("*.safetensors"))
    for rank in (0, 1):
        part = sum(f.stat().st_size for f in (sharded / "state" / f"rank-{rank}").iterdir())
        assert 0.3 * whole < part < 0.7 * whole
    assert {p[0].split("/")[1] for e in index["tensors"].values() for p in e["pieces"]} == {
        "rank-0",
        "rank-1",
    }
    verify(sharded)
    # 2 -> 3 and 2 -> 1: steps 5-6 from the 2 ranks' checkpoint-4
    launch(recipe("three", 2, resume_from_checkpoint=str(sharded)), ranks=3)
    if eight_bit:
        _close(losses(tmp_path / "three"), want, [5, 6])
        _weights_close(tmp_path / "three", tmp_path / "one", eight_bit)
        return
    launch(recipe("back", 6, resume_from_checkpoint=str(sharded)), "--quiet")
    for run in ("three", "back"):
        _close(losses(tmp_path / run), want, [5, 6])
        _weights_close(tmp_path / run, tmp_path / "one", eight_bit)
    # a sharded checkpoint exports one Hugging Face model, as the one process's does
    for run in ("one", "two"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tiertune.cli",
                "export",
                str(tmp_path / run / "checkpoint-4"),
                "--out",
                str(tmp_path / f"{run}-export"),
            ],
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    _weights_close(tmp_path / "one-export", tmp_path / "two-export", eight_bit)


def test_resuming_with_another_global_batch_says_how_to_keep_it(
    tmp_path, cat_model, write_recipe, launch, monkeypatch
):
    from tiertune.finetune.train import train

    launch(_recipe(tmp_path, cat_model, write_recipe, "two", 3, max_steps=2), ranks=2)
    # one process with the 2 ranks' per-device batch would take half the rows per step: refused, with the fix
    again = _recipe(tmp_path, cat_model, write_recipe, "two", 3, resume_from_checkpoint="auto")
    with pytest.raises(
        ConfigError, match=r"global micro-batch .*'3 x 2' -> '3 x 1'.*per_device_train_batch_size=6"
    ):
        train(again, progress=False)


def test_killing_a_rank_mid_step_leaves_the_last_checkpoint_intact_and_stops_every_rank(
    tmp_path, cat_model, write_recipe, launch, losses
):
    recipe = _recipe(tmp_path, cat_model, write_recipe, "run", 3, max_steps=500, save_steps=1)
    run = tmp_path / "run"
    env = dict(launch_env(), TIERTUNE_COLLECTIVE_TIMEOUT="20")
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(
            [*torchrun(2), "-m", "tiertune.cli", "train", str(recipe)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + TIMEOUT
        while len(checkpoints(run)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(checkpoints(run)) >= 3, (tmp_path / "out.txt").read_text()[-3000:]
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "tiertune.cli" in " ".join(p.cmdline())
        ]
        victim = next(p for p in workers if p.environ().get("RANK") == "1")
        os.kill(victim.pid, signal.SIGKILL)  # rank 1, in the middle of a step (one runs every ~0.1 s)
        assert proc.wait(timeout=180) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"ranks still running: {alive}"
    # rank 0 says why it stopped (the lost rank, or torchrun's SIGTERM when that came first), never a traceback
    said = (tmp_path / "out.txt").read_text()
    assert "another rank stopped" in said or "SIGTERM" in said
    assert "[rank0]: Traceback" not in said
    newest = latest_checkpoint(run)
    verify(newest)  # every file of the newest complete checkpoint, against its checksums
    step = int(newest.name.split("-")[1])
    # it resumes (here on one process, with the same global micro-batch) and trains on
    launch(
        recipe,
        "training.resume_from_checkpoint=auto",
        f"training.max_steps={step + 1}",
        "training.per_device_train_batch_size=6",
        "--quiet",
    )
    assert list(losses(run))[-1] == step + 1
    assert torch.isfinite(torch.tensor(list(losses(run).values()))).all()


def test_a_qlora_run_checkpointed_by_2_ranks_resumes_on_one(
    tmp_path, cat_model, write_recipe, launch, losses
):
    """The adapters are replicated: rank 0 writes them (PEFT format, with their optimizer) and every rank its
    random states; the NF4 base is the input model's. One process continues the 2 ranks' run."""
    pytest.importorskip("bitsandbytes")

    def recipe(name: str, batch: int, **training):
        path = _recipe(tmp_path, cat_model, write_recipe, name, batch, **{"max_steps": 4, **training})
        lora = ("model.quantize=nf4", "method.type=lora", "method.lora.r=4", "method.lora.dropout=0")
        return path, lora

    one, lora = recipe("one", 6)
    launch(one, *lora, "--quiet")
    two, _ = recipe("two", 3, max_steps=2)
    launch(two, *lora, ranks=2)
    # the estimate for 2 processes, counted by the engine's step on a ledger: the NF4 base gathered as its
    # packed bytes, the adapters' gradients, the loss, token count and norm all-reduced; to the byte
    predicted = estimate(load_recipe(two, lora), measure=False, processes=2).scale_out.wire
    assert "reduce_scatter" not in predicted
    for step in losses(tmp_path / "two", "wire_bytes").values():
        assert step == predicted
    sharded = tmp_path / "two" / "checkpoint-2"
    assert (sharded / "adapter_model.safetensors").is_file() and (sharded / "adapter_optimizer.pt").is_file()
    assert {p.name for p in sharded.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    verify(sharded)
    back, _ = recipe("back", 6, resume_from_checkpoint=str(sharded))
    launch(back, *lora, "--quiet")
    _close(losses(tmp_path / "back"), losses(tmp_path / "one"), [3, 4])
    a = load_file(tmp_path / "back" / "adapter_model.safetensors")
    b = load_file(tmp_path / "one" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
