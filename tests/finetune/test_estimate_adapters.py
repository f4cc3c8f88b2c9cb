"""``tiertune estimate a.yaml b.yaml ...`` (``estimates.adapters``): a step of several adapters over one NF4 base
on disk, replayed on a ledger, reads what one adapter's step reads while what it holds on the device grows with
the adapters; where they do not all fit, the estimate names the most that do (each count replayed) and exits 1."""

import json

import pytest

from tests.finetune.test_several import _dpo, _recipe
from tiertune.config.sweep import load_recipes

# a device tier too small for the whole base: its layers stream from the disk each step
SMALL = ("offload.device_budget=48KiB", "offload.host_budget=48KiB")


@pytest.fixture
def three(tmp_path, write_recipe, cat_model):
    model = cat_model(2, hidden=64)
    return [
        _recipe(tmp_path, write_recipe, model, "a"),
        _recipe(
            tmp_path, write_recipe, model, "b", lora={"r": 16}, training={"gradient_accumulation_steps": 2}
        ),
        _dpo(tmp_path, write_recipe, model, "d"),
    ]


def test_several_adapters_read_one_adapters_bytes_and_hold_more(three):
    """Measured: the step's FLOPs and seconds grow with the adapters' tokens, its bytes read do not."""
    from tiertune.estimates.adapters import estimate_adapters

    est = estimate_adapters(load_recipes(three, SMALL), gpu="cpu")
    assert est.fits and est.largest == 3
    one_read = sum(est.one.moved_per_step.get(k, 0) for k in ("disk->host", "host->device"))
    assert one_read > 0 and 1.0 <= est.read_ratio <= 1.05, (est.one.moved_per_step, est.all.moved_per_step)
    # three adapters' states and micro-batches on the device
    assert sum(est.all.outside_store.values()) > sum(est.one.outside_store.values())
    assert est.all.trained_parameters > est.one.trained_parameters
    assert est.more > 0
    # 1 + 2 micro-batches of 2 rows, and the DPO one's of 2 pairs (4 rows; its reference and a third head pass)
    assert est.all.speed.flops.tokens == 5 * est.one.speed.flops.tokens
    assert est.all.speed.flops.total > 5 * est.one.speed.flops.total
    # both priced at one set of rates, measured once: they differ by their work alone, whatever else runs here
    assert (
        est.all.bandwidth == est.one.bandwidth
        and est.all.speed.compute_rate_source == est.one.speed.compute_rate_source
    )
    assert est.step_seconds(est.all) > est.step_seconds(est.one) > 0


def test_the_estimate_names_the_most_adapters_that_fit(three, monkeypatch):
    import psutil
    from typer.testing import CliRunner

    from tiertune.cli.app import app
    from tiertune.estimates.adapters import estimate_adapters

    est = estimate_adapters(load_recipes(three, SMALL), measure=False, gpu="cpu")
    one, whole = est.alone.held(False), est.fitting.tried[0].held(False)
    # a machine with room for two of them, not three (each adapter adds its states and micro-batches)
    ram = one + int(0.75 * (whole - one))

    class Memory:
        total = ram

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    result = CliRunner().invoke(app, ["estimate", *map(str, three), *SMALL, "--json", "--no-probe"])
    assert result.exit_code == 1, result.output
    out = json.loads(result.output)
    assert out["fits"] is False and out["largest_that_fits"] == 2
    assert [f["adapters"] for f in out["tried"]] == [3, 1, 2]  # all, then the search over the first k
    result = CliRunner().invoke(app, ["estimate", *map(str, three), *SMALL, "--no-probe"])
    assert "the most that do: 2" in result.output


def test_a_run_of_more_adapters_than_fit_is_refused_naming_the_most_that_do(three, monkeypatch):
    import psutil

    from tiertune.errors import ConfigError
    from tiertune.estimates.adapters import estimate_adapters
    from tiertune.finetune.several import train_several

    est = estimate_adapters(load_recipes(three, SMALL), measure=False, gpu="cpu")
    one, whole = est.alone.held(False), est.fitting.tried[0].held(False)

    class Memory:
        total = one + int(0.75 * (whole - one))

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    with pytest.raises(ConfigError, match="the most that do: 2"):
        train_several(load_recipes(three, SMALL), progress=False)
    for path in three:  # refused before any run directory was made
        assert not (path.parent / "run").exists()
