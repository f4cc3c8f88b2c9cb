"""Several adapters over one base under ZeRO-3 ranks (torchrun, gloo on CPUs): two ranks train an SFT and a DPO
adapter as one process does with the global batches (each rank its rows of each adapter's batch; rank 0 writes
each adapter's log, checkpoints and adapter)."""

import json

import pytest

from tests.conftest import CAT_PAIRS


def test_two_ranks_train_several_adapters_as_one_process(tmp_path, cat_model, write_recipe, launch, losses):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CAT_PAIRS))
    model = cat_model(2)

    def recipe(name, batch, dpo=False):
        return write_recipe(
            tmp_path,
            model,
            name=name,
            data={"shuffle": False, **({"path": str(pairs), "format": "preference"} if dpo else {})},
            method={"type": "lora", "lora": {"r": 4, "dropout": 0.0, "seed": 3 if dpo else 1}},
            objective={"type": "dpo" if dpo else "sft"},
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 3,
                "save_steps": 2,
                "learning_rate": 1e-3,
            },
            offload={
                "disk_path": str(tmp_path / "nvme"),
                "params": "disk",
                "device_budget": "16MiB",
                "host_budget": "16MiB",
            },
        )

    launch(recipe("one-sft", 4), str(recipe("one-dpo", 2, dpo=True)), "--quiet")
    launch(recipe("two-sft", 2), str(recipe("two-dpo", 1, dpo=True)), ranks=2)
    for kind, fields in (("sft", ("loss", "grad_norm")), ("dpo", ("loss", "grad_norm", "rewards/margins"))):
        for field in fields:
            want, got = losses(tmp_path / f"one-{kind}", field), losses(tmp_path / f"two-{kind}", field)
            assert list(got) == list(want) == [1, 2, 3]
            for step, value in got.items():
                assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (kind, field, step)
        run = tmp_path / f"two-{kind}"
        assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
        assert (run / "adapter_model.safetensors").is_file()


def test_two_ranks_train_a_distillation_beside_an_sft_adapter_as_one_process(
    tmp_path, cat_model, write_recipe, launch, losses
):
    """A distillation's adapter among several: every rank runs its teacher pass (rank 0 writes the cache) and
    trains its rows of the global batch with their teacher figures, as one process does."""
    model, teacher = cat_model(2), cat_model(3)

    def recipe(name, batch, distill=False):
        objective = {"type": "sft"}
        if distill:
            objective = {"type": "distill", "teacher": {"path": str(teacher), "dtype": "float32"}, "top_k": 8}
        return write_recipe(
            tmp_path,
            model,
            name=name,
            data={"shuffle": False},
            method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
            objective=objective,
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 3,
                "save_steps": 0,
                "learning_rate": 1e-3,
            },
            offload={
                "disk_path": str(tmp_path / f"{name[:3]}nvme"),
                "params": "disk",
                "device_budget": "16MiB",
                "host_budget": "16MiB",
            },
        )

    launch(recipe("one-sft", 4), str(recipe("one-kd", 4, distill=True)), "--quiet")
    launch(recipe("two-sft", 2), str(recipe("two-kd", 2, distill=True)), ranks=2)
    for kind, fields in (("sft", ("loss", "grad_norm")), ("kd", ("loss", "grad_norm", "kd_loss", "ce_loss"))):
        for field in fields:
            want, got = losses(tmp_path / f"one-{kind}", field), losses(tmp_path / f"two-{kind}", field)
            assert list(got) == list(want) == [1, 2, 3]
            for step, value in got.items():
                assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (kind, field, step)
    assert list((tmp_path / "twonvme" / "teacher-topk").iterdir())  # rank 0 wrote the cache
