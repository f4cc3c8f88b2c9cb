"""``tiertune estimate a.yaml b.yaml ...`` (``estimates.adapters``): a step of several adapters over one NF4 base
on disk, replayed on a ledger, reads what one adapter's step reads while what it holds on the device grows with
the adapters; where they do not all fit, the estimate names the most that do (each count replayed) and exits 1."""

import json

import pytest

from tests.conftest import CAT_PAIRS, CAT_TEXTS
from tests.finetune.test_several import _dpo, _log, _recipe
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


def test_each_adapters_evaluation_is_priced_as_the_run_makes_it(tmp_path, write_recipe, cat_model):
    """Of three adapters over an 8-layer NF4 base on disk, a (SFT) and d (DPO: its reference's pass too) evaluate
    after step 3, c does not: the estimate prices each one's evaluation (passes of the base with it alone, replayed
    after the steps of all three) and the run's records of them say the same bytes, disk and host to device,
    within 2% (each evaluation's moved between its record and the one before it: the shared stream's counters)."""
    from tiertune.estimates.adapters import estimate_adapters, format_adapters
    from tiertune.finetune.several import train_several

    model = cat_model(8, hidden=64)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS[::3]))
    pairs = tmp_path / "held_out_pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CAT_PAIRS[:5]))
    evaluating = {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 3}
    paths = [
        _recipe(tmp_path, write_recipe, model, "a", data={"eval_path": str(held_out)}, training=evaluating),
        _recipe(tmp_path, write_recipe, model, "c", lora={"r": 8}, training={"max_steps": 4}),
        _dpo(tmp_path, write_recipe, model, "d", training=evaluating, data={"eval_path": str(pairs)}),
    ]
    recipes = load_recipes(paths, SMALL)
    est = estimate_adapters(recipes, measure=False)
    priced = est.all.adapter_evaluations
    assert sorted(priced) == [0, 2]
    # after step 3 and after the last, 4
    assert [(p.rows, p.passes, p.evaluations) for p in priced.values()] == [(4, 2, 2), (5, 3, 2)]
    assert "adapter 1's evaluation: 4 held-out rows in 2 passes" in format_adapters(est, "t")
    results = train_several(recipes, progress=False)
    a, _, d = ([r for r in _log(res.output_dir) if "step" in r] for res in results)
    a_eval, _ = [r for r in a if "eval_loss" in r]  # (the first: after step 3)
    d_eval, _ = [r for r in d if "eval_loss" in r]
    assert a_eval["step"] == d_eval["step"] == 3
    step3 = next(r for r in a if r.get("step") == 3 and "grad_norm" in r)["bytes_moved"]
    for p, start, end in ((priced[0], step3, a_eval), (priced[2], a_eval["bytes_moved"], d_eval)):
        moved = {k: n - start.get(k, 0) for k, n in end["bytes_moved"].items()}
        predicted = {
            k: p.first_pass.get(k, 0) + (p.passes - 1) * p.later_pass.get(k, 0)
            for k in ("disk->host", "host->device")
        }
        assert predicted["disk->host"] > 0
        for link, n in predicted.items():
            assert abs(n - moved.get(link, 0)) <= 0.02 * moved.get(link, 0), (link, predicted, moved)
