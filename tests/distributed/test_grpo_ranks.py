"""GRPO under ZeRO-3 ranks (torchrun, gloo on CPUs): two ranks train as one process with the global batch of
completions. Each rank samples its prompts' completions (each from its own generator: the same completions on any
number of processes), the rewards are gathered for the groups' advantages, and the steps' losses, KL terms and
rewards are one process's; a full fine-tune's reference, the initial weights beside the policy, is sharded on
every rank as the policy is. Each rank evaluates the whole held-out set: its figures are one process's."""

import json

import pytest

from tests.conftest import CAT_TEXTS

REWARDS = '''
def cats(prompts, completions, **kwargs):
    """The share of a completion's words that are "cat"."""
    return [c.split().count("cat") / max(1, len(c.split())) for c in completions]
'''


@pytest.mark.parametrize(
    ("method", "loss_type", "extra"),
    [
        ("lora", "grpo", {}),
        ("full", "dr_grpo", {}),
        # a generation feeding two steps: dapo's normaliser the generation's tokens over the ranks, a step's share
        ("lora", "dapo", {"steps_per_generation": 4}),
    ],
)
def test_two_ranks_train_grpo_as_one_process(
    tmp_path, cat_model, write_recipe, launch, losses, method, loss_type, extra
):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:2])}) + "\n" for t in CAT_TEXTS[:8]))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"the {a} cat"}) + "\n" for a in ("red", "old", "fat")))

    def recipe(name, batch):
        return write_recipe(
            tmp_path,
            cat_model(2),
            name=name,
            data={
                "path": str(data),
                "format": "prompt",
                "shuffle": False,
                "max_seq_len": 32,
                "eval_path": str(held_out),
            },
            method={"type": method, "lora": {"r": 4, "dropout": 0.0}},
            objective={
                "type": "grpo",
                "num_generations": 4,
                "max_completion_length": 8,
                "beta": 0.04,
                "loss_type": loss_type,
                "reward_funcs": [f"{rewards}:cats"],
                "num_generations_eval": 3,
                **extra,
            },
            training={
                "output_dir": str(tmp_path / name),
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": 2,
                "max_steps": 3,
                "save_steps": 0,
                "eval_strategy": "steps",
                "eval_steps": 2,
                "learning_rate": 2e-2 if method == "lora" else 3e-3,
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
    # (``kl`` and the clip ratios are each micro-batch's token mean, as TRL logs them: they follow its rows)
    for field in ("loss", "reward", "reward_std", "completions/mean_length"):
        want, got = losses(tmp_path / "one", field), losses(tmp_path / "two", field)
        # a generation's figures logged by its first step
        assert list(got) == list(want) == ([1, 3] if extra and field != "loss" else [1, 2, 3])
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (field, step)
    for field in ("eval_loss", "eval_reward", "eval_kl", "eval_completions/mean_length"):
        want, got = losses(tmp_path / "one", field), losses(tmp_path / "two", field)
        assert list(got) == list(want) == [2, 3]  # every 2 steps and after the last
        for step, value in got.items():
            assert value == pytest.approx(want[step], rel=1e-5, abs=1e-7), (field, step)
    assert any(v != 0 for v in losses(tmp_path / "two", "loss").values())
    assert losses(tmp_path / "two", "kl")[3] > 0  # the policy moved off its reference
