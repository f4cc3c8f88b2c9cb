"""Evaluation under ZeRO-3 ranks (torchrun, gloo on CPUs): every rank evaluates the whole held-out set with its
sharded weights gathered as in a step, so two ranks log the eval_loss one process does, and early stopping ends
both where it ends one."""

import json

import pytest

from tests.conftest import CAT_TEXTS


@pytest.mark.parametrize("method", ["full", "lora"])
def test_two_ranks_evaluate_and_stop_early_as_one_process(
    tmp_path, cat_model, write_recipe, launch, losses, method
):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS[1::2]))

    def recipe(name, batch):
        return write_recipe(
            tmp_path,
            cat_model(2),
            name=name,
            data={"shuffle": False, "eval_path": str(held_out)},
            method={"type": method, "lora": {"r": 4, "dropout": 0.0}},  # (dropout draws differ by rank)
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 6,
                "save_steps": 0,
                "learning_rate": 1e-3,
                "eval_strategy": "steps",
                "eval_steps": 2,
                # no evaluation beats the best by 100: the second one stops the run (after step 4 of 6)
                "early_stopping_patience": 1,
                "early_stopping_threshold": 100.0,
            },
            offload={
                "disk_path": str(tmp_path / f"{name}-nvme"),
                "params": "disk",
                "optimizer_states": "disk",
                "device_budget": "16MiB",
                "host_budget": "16MiB",
            },
        )

    launch(recipe("one", 4), "--quiet")
    launch(recipe("two", 2), ranks=2)
    for run in ("one", "two"):
        state = json.loads((tmp_path / run / "trainer_state.json").read_text())
        assert state["global_step"] == 4 and state["stopped_early"] is True
    want = losses(tmp_path / "one", "eval_loss")
    got = losses(tmp_path / "two", "eval_loss")
    assert list(got) == list(want) == [2, 4]
    for step, value in got.items():
        assert value == pytest.approx(want[step], rel=1e-5), step
