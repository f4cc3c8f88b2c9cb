"""The estimate's step as a timeline (``estimates.timeline``): the engine's schedule, recorded by the ledger
replay (``engine.trace``), played against a rate per resource; and the run's log of the same parts."""

from __future__ import annotations

import json

import pytest

from tiertune.config.recipe import load_recipe
from tiertune.engine.trace import Trace
from tiertune.estimates.report import estimate
from tiertune.estimates.timeline import Rates, simulate
from tiertune.finetune.train import train

PER_SECOND = 1e6  # the rates below make one op of 1e6 parameters, tokens or bytes take one second


def rates(**kw) -> Rates:
    """Each layer op of ``PER_SECOND`` tokens takes a second (forward share 1/2: forward and backward alike),
    AdamW and the copies ``PER_SECOND`` a second, every link ``PER_SECOND`` bytes a second."""
    base = dict(
        layer=2 / PER_SECOND,
        forward_share=0.5,
        head=1 / PER_SECOND,
        copy=PER_SECOND,
        adamw=PER_SECOND,
        adamw_tail=PER_SECOND,
        worker_copy=PER_SECOND,
        links={"disk->host": PER_SECOND, "host->disk": PER_SECOND, "host->device": PER_SECOND},
    )
    base.update(kw)
    return Rates(**base)


def backward_with_updates(layers: int, unit_seconds: float) -> Trace:
    """A step of ``layers`` backward ops of a second, each handing a unit of ``unit_seconds`` to the worker,
    then the wait for them all."""
    trace = Trace()
    trace.op("step")
    for _ in range(layers):
        trace.op("layer", PER_SECOND, "backward")
        trace.op("submit")
        with trace.unit():
            trace.op("run", "adamw", int(unit_seconds * PER_SECOND), 0)
    trace.op("tail")
    trace.op("join")
    return trace


def test_updates_shorter_than_backward_are_hidden_but_the_last():
    tl = simulate(backward_with_updates(4, 0.5), rates())
    # each unit runs during the next layer's backward; the last one after the last layer
    assert tl.step == pytest.approx(4.5)
    assert (tl.compute, tl.optimizer_wait, tl.optimizer_busy) == pytest.approx((4.0, 0.5, 2.0))
    assert tl.hidden_share == pytest.approx(0.75) and tl.bound == "compute"


def test_updates_longer_than_backward_hold_it_back_two_units_ahead():
    tl = simulate(backward_with_updates(4, 2.0), rates())
    # u1 runs 1-3, u2 3-5, u3 5-7, u4 7-9: the third submit finds two units pending until u1 ends at 3 (the
    # end of the third layer: no wait), the fourth waits from 4 to 5, and the join from 5 to 9
    assert tl.step == pytest.approx(9.0)
    assert (tl.compute, tl.optimizer_wait, tl.optimizer_busy) == pytest.approx((4.0, 5.0, 8.0))
    assert tl.hidden_share == pytest.approx(1 - 5 / 8) and tl.bound == "the CPU optimizer"


def test_a_drain_to_one_unit_left_waits_for_all_but_the_last():
    trace = backward_with_updates(2, 3.0)
    trace.compute.insert(-2, ("drain", 2))  # before the tail: all but one unit done
    tl = simulate(trace, rates())
    # u1 1-4, u2 4-7: the drain after the second layer (at 2) waits until u1 is done (4), the join until 7
    assert tl.step == pytest.approx(7.0) and tl.optimizer_wait == pytest.approx(5.0)


def test_a_unit_after_backward_runs_at_the_rate_of_every_core():
    tl = simulate(backward_with_updates(1, 2.0), rates(adamw_tail=2 * PER_SECOND))
    assert tl.optimizer_busy == pytest.approx(2.0)  # submitted during backward: the worker's own threads
    trace = Trace()
    trace.op("step")
    trace.op("layer", PER_SECOND, "backward")
    trace.op("tail")
    trace.op("submit")
    with trace.unit():
        trace.op("run", "adamw", 2 * int(PER_SECOND), 0)
    trace.op("join")
    assert simulate(trace, rates(adamw_tail=2 * PER_SECOND)).optimizer_busy == pytest.approx(1.0)


def test_a_use_waits_for_the_chunks_transfers_each_after_the_one_before():
    trace = Trace()
    trace.op("step")
    trace.op("start", 7, "disk->host", 2 * int(PER_SECOND))  # 0-2 on the disk
    trace.op("start", 7, "host->device", int(PER_SECOND))  # then 2-3 on its own link
    trace.op("start", 8, "host->device", int(PER_SECOND))  # another chunk's: 0-1, not behind chunk 7's
    trace.op("layer", PER_SECOND, "forward")  # 0-1
    trace.op("use", 8)  # landed at 1: no wait
    trace.op("use", 7)  # 1-3 waiting
    tl = simulate(trace, rates())
    assert (
        tl.step == pytest.approx(3.0)
        and tl.io_wait == pytest.approx(2.0)
        and tl.compute == pytest.approx(1.0)
    )
    assert tl.links == pytest.approx({"disk->host": 2.0, "host->device": 2.0})
    assert tl.bound in ("the disk", "host->device")  # each busy 2 of the 3 seconds, the compute 1


def test_on_a_cpu_the_compute_and_the_optimizer_share_the_cores():
    alone = simulate(backward_with_updates(1, 1.0), rates())
    assert alone.step == pytest.approx(2.0)  # the unit after the layer
    trace = Trace()
    trace.op("step")
    trace.op("submit")
    with trace.unit():
        trace.op("run", "adamw", int(PER_SECOND), 0)
    trace.op("layer", PER_SECOND, "backward")
    trace.op("join")
    assert simulate(trace, rates()).step == pytest.approx(1.0)  # side by side on a GPU
    shared = simulate(trace, rates(shared=(0.5, 0.5)))
    assert shared.step == pytest.approx(2.0) and shared.optimizer_busy == pytest.approx(2.0)
    assert shared.compute == pytest.approx(2.0) and shared.optimizer_wait == pytest.approx(0.0)


def test_the_parts_are_the_last_steps():
    trace = backward_with_updates(2, 0.5)
    again = backward_with_updates(3, 0.5)
    trace.compute += again.compute
    trace.units += again.units
    tl = simulate(trace, rates())
    assert tl.step == pytest.approx(3.5) and tl.compute == pytest.approx(3.0)
    assert tl.work == pytest.approx({"layers backward": 3.0, "optimizer": 1.5})
    # the second step's units during its backward run at the worker's own rate again, the last after it
    tl = simulate(trace, rates(adamw_tail=2 * PER_SECOND))
    assert tl.optimizer_busy == pytest.approx(0.5 + 0.5 + 0.5)  # each unit starts at once, during backward


def full_fine_tune(tmp_path, cat_model, write_recipe, **training):
    """A recipe (its path) of the 3-layer cat model fully fine-tuned with the optimizer during backward
    (``training`` merged in)."""
    return write_recipe(
        tmp_path,
        cat_model(3),
        method={"type": "full"},
        training=training,
        offload={"overlap_optimizer": True},
    )


def test_a_replay_records_each_threads_schedule(tmp_path, cat_model, write_recipe):
    from tiertune.config.plan import resolve
    from tiertune.distributed.world import World
    from tiertune.engine.replay import replay

    recipe = load_recipe(
        full_fine_tune(tmp_path, cat_model, write_recipe, gradient_accumulation_steps=2, max_grad_norm=0.0)
    )
    run = resolve(recipe, World(), "cpu")
    t = recipe.training
    got = replay(recipe.model.path, run.store, run.engine, t.per_device_train_batch_size, 32, 2)
    trace = got.trace
    steps = [i for i, op in enumerate(trace.compute) if op == ("step",)]
    assert len(steps) == 5  # CLIPPED's five steps
    last = trace.compute[steps[-1] :]
    tokens = t.per_device_train_batch_size * 32
    layer_ops = [op for op in last if op[0] == "layer"]
    # each of the 3 layers visited once a step for both micro-batches (stacked: one op of their tokens, or one
    # op each), forward and backward
    for way in ("forward", "backward"):
        assert sum(op[1] for op in layer_ops if op[2] == way) == 3 * 2 * tokens
    assert sum(op[1] for op in last if op[0] == "head") == 2 * tokens
    # the last step's units: every trained parameter updated once (no clipping: in place, speculated)
    submits = sum(1 for op in trace.compute if op == ("submit",))
    assert submits == len(trace.units)
    in_last = sum(1 for op in last if op == ("submit",))
    updated = sum(op[2] for unit in trace.units[-in_last:] for op in unit if op[:2] == ("run", "adamw"))
    from tiertune.engine.trainer import StreamedTrainer

    trainer = StreamedTrainer(recipe.model.path, run.store, run.engine)
    try:
        assert updated == trainer.parameter_counts()["trained"]
    finally:
        trainer.close()
    assert ("tail",) in last and ("join",) in last


def test_the_estimate_plays_the_step_and_the_run_logs_the_same_parts(tmp_path, cat_model, write_recipe):
    path = full_fine_tune(tmp_path, cat_model, write_recipe, max_steps=3, max_grad_norm=0.0, save_steps=0)
    recipe = load_recipe(path)
    est = estimate(recipe, gpu="cpu")
    sp = est.speed
    tl = sp.timeline
    assert tl is not None and sp.seconds == tl.step and sp.bound == tl.bound
    assert tl.compute + tl.io_wait + tl.optimizer_wait == pytest.approx(tl.step)
    assert tl.optimizer_busy > 0 and 0.0 <= tl.hidden_share <= 1.0
    assert "the engine's step" in sp.compute_rate_source
    as_json = est.as_json()["step_time"]["timeline"]
    assert set(as_json) >= {"step_s", "compute_s", "io_wait_s", "optimizer_wait_s", "optimizer_busy_s"}
    result = train(recipe, progress=False)
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    for record in records:
        parts = record["parts_s"]
        assert parts["compute"] + parts["io_wait"] + parts["optimizer_wait"] == pytest.approx(
            record["step_seconds"]
        )
        assert parts["optimizer_busy"] > 0 and 0.0 <= parts["optimizer_hidden_share"] <= 1.0
    # the optimizer after backward: the step waits for all of it, none hidden
    serial = load_recipe(
        path, ("offload.overlap_optimizer=false", f"training.output_dir={tmp_path / 'serial'}")
    )
    result = train(serial, progress=False)
    for line in result.log_path.read_text().splitlines():
        parts = json.loads(line)["parts_s"]
        assert (
            parts["optimizer_wait"] >= parts["optimizer_busy"] > 0 and parts["optimizer_hidden_share"] == 0.0
        )


def test_a_layers_time_given_is_the_timelines_and_a_bad_one_is_a_clear_error(
    tmp_path, cat_model, write_recipe
):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    path = full_fine_tune(tmp_path, cat_model, write_recipe)
    est = estimate(load_recipe(path), gpu="cpu", layer_seconds=(0.003, 0.009))
    work = est.speed.timeline.work
    # the step's one micro-batch through 3 layers: 3 forwards of 3 ms and 3 backwards of 9 ms
    assert work["layers forward"] == pytest.approx(3 * 0.003) and work["layers backward"] == pytest.approx(
        3 * 0.009
    )
    assert "as given" in est.speed.compute_rate_source
    for bad in ("3", "3,x", "-1,2"):
        out = CliRunner().invoke(app, ["estimate", str(path), "--layer-ms", bad])
        assert out.exit_code == 2 and "--layer-ms takes" in out.output, out.output
