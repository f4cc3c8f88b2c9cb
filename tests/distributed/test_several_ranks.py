"""Several adapters over one base under ZeRO-3 ranks (torchrun, gloo on CPUs): two ranks train an SFT and a DPO
adapter as one process does with the global batches (each rank its rows of each adapter's batch; rank 0 writes
each adapter's log, checkpoints and adapter)."""

import json

import pytest

from tests.conftest import CAT_PAIRS


def _recipe(tmp_path, write_recipe, model, name, batch, disk, save_steps=0, **sections):
    """A LoRA recipe of one adapter of several over ``model`` (``sections``: its data, lora and objective), in
    ``tmp_path / name``, its offload files in ``disk`` (shared by the recipes of one launch)."""
    lora = {"r": 4, "dropout": 0.0, **sections.pop("lora", {})}
    return write_recipe(
        tmp_path,
        model,
        name=name,
        data={"shuffle": False, **sections.pop("data", {})},
        method={"type": "lora", "lora": lora},
        training={
            "output_dir": str(tmp_path / name),
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": 2,
            "max_steps": 3,
            "save_steps": save_steps,
            "learning_rate": 1e-3,
        },
        offload={"disk_path": str(disk), "params": "disk", "device_budget": "16MiB", "host_budget": "16MiB"},
        **sections,
    )


def _as_one_process(tmp_path, losses, kinds):
    """Each ``kinds`` run's ``fields`` (kind -> fields) of two ranks (``two-<kind>``) are one process's
    (``one-<kind>``), step by step."""
    for kind, fields in kinds.items():
        for field in fields:
            want, got = losses(tmp_path / f"one-{kind}", field), losses(tmp_path / f"two-{kind}", field)
            assert list(got) == list(want) == [1, 2, 3]
            for step, value in got.items():
                assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (kind, field, step)


def test_two_ranks_train_several_adapters_as_one_process(tmp_path, cat_model, write_recipe, launch, losses):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CAT_PAIRS))
    model = cat_model(2)

    def recipe(name, batch, dpo=False):
        return _recipe(
            tmp_path,
            write_recipe,
            model,
            name,
            batch,
            tmp_path / "nvme",
            save_steps=2,
            data={"path": str(pairs), "format": "preference"} if dpo else {},
            lora={"seed": 3 if dpo else 1},
            objective={"type": "dpo" if dpo else "sft"},
        )

    launch(recipe("one-sft", 4), str(recipe("one-dpo", 2, dpo=True)), "--quiet")
    launch(recipe("two-sft", 2), str(recipe("two-dpo", 1, dpo=True)), ranks=2)
    _as_one_process(
        tmp_path, losses, {"sft": ("loss", "grad_norm"), "dpo": ("loss", "grad_norm", "rewards/margins")}
    )
    for kind in ("sft", "dpo"):
        run = tmp_path / f"two-{kind}"
        assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
        assert (run / "adapter_model.safetensors").is_file()


def test_two_ranks_train_a_distillation_beside_an_sft_adapter_as_one_process(
    tmp_path, cat_model, write_recipe, launch, losses
):
    """A distillation's adapter among several: every rank runs its teacher pass (rank 0 writes the cache) and
    trains its rows of the global batch with their teacher figures, as one process does."""
    model, teacher = cat_model(2), cat_model(3)
    distill = {"type": "distill", "teacher": {"path": str(teacher), "dtype": "float32"}, "top_k": 8}

    def recipe(name, batch, objective):
        return _recipe(
            tmp_path, write_recipe, model, name, batch, tmp_path / f"{name[:3]}nvme", objective=objective
        )

    launch(recipe("one-sft", 4, {"type": "sft"}), str(recipe("one-kd", 4, distill)), "--quiet")
    launch(recipe("two-sft", 2, {"type": "sft"}), str(recipe("two-kd", 2, distill)), ranks=2)
    _as_one_process(
        tmp_path, losses, {"sft": ("loss", "grad_norm"), "kd": ("loss", "grad_norm", "kd_loss", "ce_loss")}
    )
    assert list((tmp_path / "twonvme" / "teacher-topk").iterdir())  # rank 0 wrote the cache
