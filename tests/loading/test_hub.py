"""``model.path`` as a Hugging Face model id for ``train`` (the model from the hub's cache, downloaded there
when it is not), and the built-in recipes by name, estimated offline from the configs tiertune ships."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.finetune.train import train


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No network and an empty hub cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_train_takes_a_model_id_from_the_hub_cache(tmp_path, cat_model, write_recipe, monkeypatch):
    import huggingface_hub

    snapshot = cat_model(2)
    asked = []

    def cached(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        asked.append((repo_id, local_files_only))
        return str(snapshot)  # in the cache: nothing is downloaded

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    path = write_recipe(tmp_path, "someone/cat-llama", training={"max_steps": 1})
    result = train(str(path), progress=False)
    assert asked == [("someone/cat-llama", True)]
    assert json.loads(result.log_path.read_text().splitlines()[-1])["step"] == 1


def test_train_with_a_model_id_offline_says_what_to_do_at_once(tmp_path, write_recipe, offline):
    path = write_recipe(tmp_path, "someone/not-downloaded")
    began = time.perf_counter()
    result = CliRunner().invoke(app, ["train", str(path)], env={"COLUMNS": "200"})
    assert time.perf_counter() - began < 30
    assert result.exit_code == 2, result.output
    assert "`hf download someone/not-downloaded`" in result.output and "HF_HUB_OFFLINE" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
    # never read as a path relative to the current directory
    assert str(tmp_path / "someone") not in result.output


def test_built_in_recipes_are_estimated_and_planned_by_name_offline(tmp_path, offline, monkeypatch):
    monkeypatch.chdir(tmp_path)
    est = CliRunner().invoke(
        app, ["estimate", "llama3-70b-qlora-nvme", "--no-probe", "--gpu", "rtx4090", "--json"]
    )
    assert est.exit_code in (0, 1), est.output  # 1: this machine is not the recipe's (its RAM)
    figures = json.loads(est.stdout)
    assert 70e9 < figures["parameters"] < 71e9 and figures["tiers"]["device"]["fits"]
    planned = CliRunner().invoke(app, ["train", "llama3-8b-qlora-24gb", "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert "path: meta-llama/Meta-Llama-3-8B" in planned.output and "plan: device=" in planned.output
    unknown = CliRunner().invoke(app, ["estimate", "llama9-qlora"])
    assert unknown.exit_code == 2 and "`tiertune recipes` lists the built-in ones" in unknown.output
