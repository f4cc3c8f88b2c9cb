"""Preference objectives under ZeRO-3 ranks (torchrun, gloo on CPUs): two ranks train as one process with the
global batch of pairs (each rank its run of pairs; a full fine-tune's reference pass on every rank)."""

import json

import pytest

from tests.conftest import CAT_PAIRS

PAIRS = CAT_PAIRS


@pytest.mark.parametrize("method", ["lora", "full"])
def test_two_ranks_train_dpo_as_one_process(tmp_path, cat_model, write_recipe, launch, losses, method):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))

    def recipe(name, batch):
        return write_recipe(
            tmp_path,
            cat_model(2),
            name=name,
            data={"path": str(data), "format": "preference", "shuffle": False},
            method={"type": method, "lora": {"r": 4, "dropout": 0.0}},
            objective={"type": "dpo"},
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 3,
                "save_steps": 0,
                "learning_rate": 1e-3 if method == "lora" else 1e-4,
            },
            offload={
                "disk_path": str(tmp_path / f"{name}-nvme"),
                "params": "disk",
                "optimizer_states": "disk",
                "device_budget": "16MiB",
                "host_budget": "16MiB",
            },
        )

    launch(recipe("one", 2), "--quiet")
    launch(recipe("two", 1), ranks=2)
    for field in ("loss", "rewards/margins", "logps/chosen"):
        want, got = losses(tmp_path / "one", field), losses(tmp_path / "two", field)
        assert list(got) == list(want) == [1, 2, 3]
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (field, step)
    assert losses(tmp_path / "two", "rewards/margins")[3] != 0
