"""What a run says on the console: the banner tells what will really happen (data left out, the optimizer
and when it runs), the final line how it went; --quiet leaves only that line, --verbose adds the debug log."""

import json

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.fixture
def recipe(tmp_path, model_dir, write_recipe):
    path = write_recipe(tmp_path, model_dir, training={"max_steps": 3, "save_steps": 0},
                        data={"skip_bad_rows": True})  # fmt: skip
    data = tmp_path / "data.jsonl"
    data.write_text(data.read_text() + json.dumps({"txt": "no text field"}) + "\n" + json.dumps({"text": 3}) + "\n")
    return path


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_banner_counts_skipped_rows_and_says_how_the_optimizer_runs(recipe):
    out = _run("train", recipe)
    assert "2 bad rows skipped" in out
    assert "optimizer: AdamW (torch, fused) on the CPU during backward, speculatively" in out
    done = out.strip().splitlines()[-1]  # after the progress bar's last refresh
    assert "done: 3 steps" in done and "optimizer during backward in" in done and "redone)" in done
    assert out.count("tiertune: full, ") == 1  # the banner once


def test_galore_is_named_in_the_banner(recipe):
    out = _run("train", recipe, "method.type=galore", "method.galore.rank=4", "training.max_grad_norm=0")
    assert "optimizer: GaLore AdamW (rank 4, projections refreshed every 200 steps" in out
    assert "during backward, layer by layer, in place (no clipping)" in out


def test_quiet_prints_only_the_last_line_and_verbose_the_debug_log(recipe):
    quiet = _run("train", recipe, "-q")
    assert quiet.strip().splitlines() == [quiet.strip().splitlines()[-1]]
    assert quiet.startswith("done: 3 steps")
    verbose = _run("train", recipe, "--verbose", "training.overwrite_output_dir=true")
    assert "DEBUG tiertune.kernels: kernels (torch)" in verbose and "bad rows skipped" in verbose
