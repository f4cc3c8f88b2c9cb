"""``estimate`` against what runs measure: the store's peak bytes per tier, within 15%."""

import json

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.finetune.estimate import estimate
from tiertune.finetune.recipe import load_recipe
from tiertune.finetune.train import train


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(4, hidden=128)


@pytest.fixture
def make_recipe(tmp_path, model_dir, write_recipe):
    path = write_recipe(tmp_path, model_dir, training={"gradient_accumulation_steps": 2},
                        offload={"device_budget": "64MiB", "host_budget": "64MiB"})  # fmt: skip
    return lambda overrides: load_recipe(path, overrides)


CASES = {
    "full, states on disk, host budget short": ("offload.params=disk", "offload.optimizer_states=disk",
                                                "offload.host_budget=3MiB"),
    "full, states on disk, everything cached": ("offload.params=disk", "offload.optimizer_states=disk"),
    "full, on the host, no disk": ("offload.disk_path=null", "offload.params=host", "offload.optimizer_states=host"),
    "full, overlap off, 8-bit": ("offload.params=disk", "offload.optimizer_states=disk",
                                 "offload.overlap_optimizer=false", "training.optim=adamw_bnb_8bit"),
    "full, layerwise (no clipping, one micro-batch)": ("offload.params=disk", "offload.optimizer_states=disk",
                                                        "training.max_grad_norm=0",
                                                        "training.gradient_accumulation_steps=1"),
    "galore, activations on the host": ("method.type=galore", "method.galore.rank=8", "offload.params=disk",
                                        "offload.optimizer_states=disk", "offload.activations=host"),
    "qlora, base on disk": ("model.quantize=nf4", "method.type=lora", "offload.params=disk",
                            "offload.host_budget=1MiB"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peaks_match_the_measured_ones(make_recipe, case):
    recipe = make_recipe(CASES[case])
    predicted = estimate(recipe, measure=False)
    assert predicted.fits
    result = train(recipe, progress=False)
    measured = json.loads(result.log_path.read_text().splitlines()[-1])["peak_bytes"]
    for tier, peak in measured.items():
        expected = predicted.tiers[tier].peak
        assert abs(peak - expected) <= 0.15 * max(peak, expected), (tier, peak, expected, predicted.tiers)


def test_estimate_command_prints_the_table_and_flags_a_budget_that_cannot_hold(tmp_path, make_recipe):
    recipe = make_recipe(())
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    ok = CliRunner().invoke(
        app, ["estimate", str(path), "offload.params=disk", "offload.optimizer_states=disk"]
    )
    assert ok.exit_code == 0, ok.output
    assert "step time lower bound" in ok.output and "disk      (read" in ok.output
    short = CliRunner().invoke(app, ["estimate", str(path), "offload.host_budget=64KiB", "--no-probe"])
    assert short.exit_code == 1 and "NO: needs" in short.output and "DOES NOT FIT" in short.output


def test_estimate_creates_nothing_where_disk_path_does_not_exist_yet(tmp_path, make_recipe):
    recipe = make_recipe(())
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    before = sorted(tmp_path.rglob("*"))
    disk_path = tmp_path / "new" / "nvme"
    result = CliRunner().invoke(
        app, ["estimate", str(path), f"offload.disk_path={disk_path}", "offload.params=disk"],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "disk      (read" in result.output  # the disk was probed...
    assert f"{disk_path} does not exist yet" in result.output and f"probed in {tmp_path}," in result.output
    assert sorted(tmp_path.rglob("*")) == before  # ...and nothing was created or left behind
