"""``estimate --longest``: the longest ``data.max_seq_len`` a recipe fits at, searched with the estimate's own
plan, and what ``train`` itself admits at that length and one step longer."""

import json

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.errors import BudgetError
from tiertune.estimates.longest import longest_sequence, why_not
from tiertune.estimates.report import estimate
from tiertune.finetune.train import train


@pytest.fixture
def recipe_path(tmp_path, cat_model, write_recipe):
    """LoRA on a 2-layer Llama (hidden 64), the layer boundaries of 2 micro-batches on a 4 MiB host budget."""
    return write_recipe(
        tmp_path,
        cat_model(2, hidden=64),
        method={"type": "lora", "lora": {"r": 4, "alpha": 8}},
        training={"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1, "max_steps": 1},
        offload={"activations": "host", "host_budget": "4MiB", "device_budget": "16MiB", "disk_path": None},
    )


def test_the_longest_length_fits_and_train_admits_it_but_not_one_step_longer(recipe_path):
    recipe = load_recipe(recipe_path)
    found = longest_sequence(recipe, gpu="cpu", multiple=128, limit=1 << 14)
    assert 1024 < found.tokens < 1 << 14, found.tried
    fits = [t for t in found.tried if t["fits"]]
    assert max(t["tokens"] for t in fits) == found.tokens
    assert any(t["tokens"] == found.tokens + 128 and not t["fits"] for t in found.tried), found.tried

    at = load_recipe(recipe_path, (f"data.max_seq_len={found.tokens}",))
    assert why_not(estimate(at, measure=False, gpu="cpu")) is None
    train(at, progress=False)  # the run's own admission (the plan it checks before loading) and one step
    longer = load_recipe(recipe_path, (f"data.max_seq_len={found.tokens + 128}",))
    reason = why_not(estimate(longer, measure=False, gpu="cpu"))
    assert reason is not None and "host tier" in reason, reason
    with pytest.raises(BudgetError):
        train(longer, progress=False)


def test_the_estimate_command_reports_it(recipe_path):
    out = CliRunner().invoke(
        app, ["estimate", str(recipe_path), "--no-probe", "--gpu", "cpu", "--longest", "--json"]
    )
    assert out.exit_code == 0, out.output
    found = json.loads(out.stdout)["longest_sequence"]
    expected = longest_sequence(load_recipe(recipe_path), gpu="cpu")
    assert (found["tokens"], found["batch"], found["multiple"]) == (expected.tokens, 1, 1024)
    text = CliRunner().invoke(app, ["estimate", str(recipe_path), "--no-probe", "--gpu", "cpu", "--longest"])
    assert f"longest sequence within the budgets: {found['tokens']:,} tokens a row" in text.output
