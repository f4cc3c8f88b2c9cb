"""Distillation under ZeRO-3 ranks (torchrun, gloo on CPUs): every rank runs the teacher pass with the teacher
sharded as a student is (rank 0 writes the cache), then two ranks train as one process with the global batch,
each rank's batches carrying their rows' teacher figures; with ``top_k: 0`` every rank's step runs the teacher
beside the student, sharded too, over the rank's micro-batches. Each rank evaluates the whole held-out set (its
teacher figures cached beside the data's, or made by the teacher beside): the same eval_loss as one process."""

import json

import pytest

from tests.conftest import CAT_TEXTS


@pytest.mark.parametrize(("method", "top_k"), [("lora", 8), ("full", 8), ("lora", 0)])
def test_two_ranks_distill_as_one_process(tmp_path, cat_model, write_recipe, launch, losses, method, top_k):
    teacher, student = cat_model(3, hidden=64), cat_model(2, hidden=32)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS[1::2]))

    def recipe(name, batch):
        return write_recipe(
            tmp_path,
            student,
            name=name,
            data={"shuffle": False, "eval_path": str(held_out)},
            method={"type": method, "lora": {"r": 4, "dropout": 0.0}},
            objective={
                "type": "distill",
                "teacher": {"path": str(teacher), "dtype": "float32", "wave_size": 4},
                "top_k": top_k,
                "temperature": 2.0,
                "alpha": 0.25,
            },
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 3,
                "save_steps": 0,
                "learning_rate": 1e-3,
                "eval_strategy": "steps",
                "eval_steps": 3,
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
    for field in ("loss", "kd_loss", "ce_loss", "eval_loss", "eval_kd_loss", "eval_ce_loss"):
        want, got = losses(tmp_path / "one", field), losses(tmp_path / "two", field)
        assert list(got) == list(want) == ([3] if field.startswith("eval_") else [1, 2, 3])
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (field, step)
    cached = tmp_path / "two-nvme" / "teacher-topk"
    assert list(cached.iterdir()) if top_k else not cached.exists()  # rank 0 wrote the cache
