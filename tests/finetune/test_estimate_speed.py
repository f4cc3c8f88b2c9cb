"""``estimate``'s step time: the FLOPs of a step, its parts, what bounds it, tokens/s and time to finish, and
the budgets checked against the machine (``--gpu``, ``--json``)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tiertune.cli.app import RECIPES, app
from tiertune.config.recipe import load_recipe
from tiertune.estimates.report import estimate
from tiertune.estimates.speed import GPUS, step_flops
from tiertune.loading.hub import SHIPPED
from tiertune.loading.model import build_skeleton, split_model

CONFIGS = SHIPPED  # the real models' config.json, by model id, as tiertune ships them (no weights)


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2, hidden=64)


@pytest.fixture
def recipe_path(tmp_path, model_dir, write_recipe):
    return write_recipe(tmp_path, model_dir, training={"gradient_accumulation_steps": 2, "max_steps": 7})


def test_the_flops_of_a_step_follow_the_formula(model_dir):
    with torch.device("meta"):
        model = build_skeleton(str(model_dir))
    layers = list(split_model(model).layers)
    c = model.config
    kv = c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    per_layer = 2 * c.hidden_size**2 + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    full = step_flops(model, layers, micro_tokens=4 * 32, steps_micro=2, seq_len=32, trained=True)
    assert full.layer_weights == per_layer * len(layers) and full.tokens == 256
    attention = 4 * 16 * c.hidden_size * len(layers)  # causal: 32 / 2 positions, all heads
    assert (
        full.total
        == 4 * (2 * per_layer * len(layers) + attention) * 256 + 3 * 2 * c.vocab_size * c.hidden_size * 256
    )
    lora = step_flops(model, layers, 4 * 32, 2, 32, trained=False)
    assert (lora.layer_factor, lora.head_factor) == (3, 2) and lora.total < full.total


def test_an_moe_counts_top_k_of_its_experts():
    with torch.device("meta"):
        model = build_skeleton(str(CONFIGS / "mistralai/Mixtral-8x22B-v0.1"))
    layers = list(split_model(model).layers)
    flops = step_flops(model, layers, 2048, 1, 2048, trained=False)
    c = model.config
    experts = 3 * c.hidden_size * c.intermediate_size * c.num_experts_per_tok  # w1, w2, w3 of top-k experts
    assert flops.layer_weights > experts * len(layers)  # attention and router besides
    assert flops.layer_weights < 1.1 * experts * len(layers) + 4 * c.hidden_size**2 * len(layers)
    # Mixtral 8x22B: ~39 B active parameters a token, ~1 B of them embeddings
    assert 35e9 < flops.layer_weights < 40e9


def test_a_named_gpu_is_taken_at_its_stated_peak_and_the_step_is_its_longest_part(tmp_path):
    path = RECIPES / "llama3-70b-qlora-nvme.yaml"
    recipe = load_recipe(
        path, (f"model.path={CONFIGS / 'meta-llama/Meta-Llama-3-70B'}", f"offload.disk_path={tmp_path}")
    )
    est = estimate(recipe, gpu="rtx4090")
    sp = est.speed
    assert est.target == GPUS["rtx4090"].name and est.machine["gpu_memory"] == 24 << 30
    assert sp.parts["compute"] == pytest.approx(sp.flops.total / GPUS["rtx4090"].peak_flops)
    assert sp.parts["host->device"] == pytest.approx(est.moved_per_step["host->device"] / 25e9)
    # the step played as a timeline of the replayed schedule: at least its compute and its reads (the NF4
    # base's), bound by the busier of the two (which, depends on the disk probed: 1-3 GB/s here)
    tl = sp.timeline
    assert sp.overlapped and sp.seconds == tl.step >= max(sp.parts["compute"], tl.links["disk->host"])
    assert tl.links["disk->host"] == pytest.approx(sp.parts["disk"])
    assert sp.bound == tl.bound == max(("compute", "the disk"), key=tl.busy.__getitem__)
    assert sp.parts["disk"] == pytest.approx(est.moved_per_step["disk->host"] / est.bandwidth["disk_read"])
    assert sp.tokens_per_second == pytest.approx(16 * 2048 / sp.seconds)
    assert sp.steps is None and "data" in sp.steps_source  # epochs, and no data here
    # the layer boundaries of 16 micro-batches of 2048 tokens (40 GiB) do not fit the 40 GiB host budget with
    # the rest: two waves of 8. The device's 14 GiB do not hold the base, so each wave's forward and backward
    # (which recomputes each layer) bring up what the device could not keep since the pass before: between
    # all of the weights that stream through it and all of them but the budget, per pass; and the boundaries,
    # which backward brings back once a wave
    assert (est.waves.wave, est.waves.count, est.waves.stash_tier) == (8, 2, "host")
    device, passes = est.tiers["device"], 2 * est.waves.count
    weights = device.passes - device.home - est.waves.stash
    up = est.moved_per_step["host->device"]
    assert passes * (weights - device.budget) <= up <= passes * weights + est.waves.count * est.waves.stash


def test_a_budget_the_machine_cannot_give_is_a_no(recipe_path):
    runner = CliRunner()
    too_big = runner.invoke(app, ["estimate", str(recipe_path), "offload.host_budget=64TiB", "--no-probe"])
    assert too_big.exit_code == 1, too_big.output
    assert "of RAM" in too_big.output and "DOES NOT FIT" in too_big.output
    gpu = runner.invoke(
        app, ["estimate", str(recipe_path), "offload.device_budget=40GiB", "--gpu", "rtx4090", "--no-probe"]
    )
    assert gpu.exit_code == 1 and "NO: the GPU has 24.00 GiB" in gpu.output
    unknown = runner.invoke(app, ["estimate", str(recipe_path), "--gpu", "tpu"])
    assert unknown.exit_code == 2 and "rtx4090" in unknown.output


def test_json_has_the_step_time_and_the_time_to_finish(recipe_path):
    out = CliRunner().invoke(app, ["estimate", str(recipe_path), "--json", "--gpu", "cpu"])
    assert out.exit_code == 0, out.output
    est = json.loads(out.stdout)
    st = est["step_time"]
    assert st["steps"] == 7 and st["steps_source"] == "training.max_steps"
    assert st["total_seconds"] == pytest.approx(7 * st["seconds"])
    assert st["tokens_per_second"] == pytest.approx(st["tokens_per_step"] / st["seconds"])
    assert st["tokens_per_step"] == 2 * 4 * 32
    parts = st["parts_s"]
    # on a CPU the trained weights are copied into the device tier by its cores, after each update
    assert set(parts) == {"compute", "disk", "optimizer", "host->device"} and parts["compute"] > 0
    assert est["moved_per_step"]["host->device"] > 0
    tl = st["timeline"]  # the replayed step at the measured rates
    assert st["seconds"] == tl["step_s"] and st["bound"] == tl["bound"]
    assert tl["compute_s"] + tl["io_wait_s"] + tl["optimizer_wait_s"] == pytest.approx(tl["step_s"])
    assert "measured on this CPU" in st["compute_rate_source"]
    assert est["tiers"]["host"]["budget"] == 8 << 20 and est["fits"] is True


@pytest.mark.gpu
def test_on_a_machine_with_a_gpu_auto_measures_it(recipe_path):
    recipe = load_recipe(recipe_path)
    est = estimate(recipe, gpu="auto")
    sp = est.speed
    assert est.target == torch.cuda.get_device_name() and est.machine["gpu_memory"] > 0
    assert (
        sp.overlapped
        and "measured on" in sp.compute_rate_source
        and torch.cuda.get_device_name() in sp.compute_rate_source
    )
    assert est.bandwidth["host_to_device"] > 1e9  # measured, pinned
    assert sp.seconds == sp.timeline.step >= sp.parts["compute"]


@pytest.mark.parametrize(
    "family, method",
    [
        ("llama", "full"),
        ("qwen2", "lora"),
        ("gemma2", "full"),
        ("gemma3_text", "lora"),
        ("phi3", "full"),
        ("cohere", "lora"),
        ("gpt_neox", "full"),
        ("mixtral", "full"),
        ("qwen3_moe", "lora"),
        ("deepseek_v3", "lora"),
        ("llama", "qlora"),
    ],
)
def test_the_step_time_is_measured_for_every_family_the_engine_trains(
    tmp_path, tiny_model_dir, write_recipe, family, method
):
    path, _ = tiny_model_dir(family)
    method_section = {"type": "full" if method == "full" else "lora", "lora": {"dropout": 0.0}}
    model = {"path": str(path), "dtype": "float32", "quantize": "nf4" if method == "qlora" else "none"}
    recipe = load_recipe(write_recipe(tmp_path, path, model=model, method=method_section))
    est = estimate(recipe, gpu="cpu")
    sp = est.speed
    assert sp.parts["compute"] > 0 and "measured on this CPU" in sp.compute_rate_source
    assert sp.flops.layer_weights > 0 and sp.seconds >= sp.timeline.compute > 0
    assert "the engine's step" in sp.compute_rate_source  # the engine's own step on the model's cuts


def test_the_compute_measurement_takes_the_fastest_repeat_and_says_when_the_cpu_was_busy(
    recipe_path, monkeypatch
):
    # a busy CPU slows some repeats several times over (2 threads on 2 cores beside another program: 1.05 s a
    # layer against 0.13 s): the fastest repeat counts, and the estimate says the machine was busy (the model
    # alone is measured where the engine's own step is not: a model the cut cannot build)
    from tiertune.estimates import report, speed

    monkeypatch.setattr(report, "measure_engine", lambda *a, **k: None)

    def slow_sometimes(loss, ids, device):
        calls.append(len(loss.model.model.layers))
        return len(loss.model.model.layers) * (8.0 if len(calls) % 3 == 0 else 1.0) + 0.5

    calls: list[int] = []
    monkeypatch.setattr(speed, "_time_step", slow_sometimes)
    measured = speed.measure_compute(
        str(load_recipe(recipe_path).model.path), _engine_config(recipe_path), 4, 32, torch.device("cpu")
    )
    assert calls.count(1) == calls.count(3) == 6  # a warm-up and 5 repeats of each model
    assert measured.layer == pytest.approx(1.0) and measured.rest == pytest.approx(0.5)  # the fastest repeats
    assert measured.spread > speed.NOISY
    est = estimate(load_recipe(recipe_path), gpu="cpu")
    assert any("the CPU was busy" in note for note in est.notes), est.notes
    assert "the fastest of repeats with" in est.speed.compute_rate_source


def test_updates_on_fewer_threads_during_backward_are_the_engines_own_not_a_probes_ratio(
    tmp_path, model_dir, write_recipe, monkeypatch
):
    # a rank's (or --threads') share of the cores during backward, all of them after it: the units' rate on
    # each side is the engine's own, measured in the same rounds (two probes of AdamW alone, one thread and
    # two, gave 0.63 to 0.89 from one call to the next and put the optimizer's busy time 1.19-1.25x a run's)
    from tiertune.distributed.world import usable_cores
    from tiertune.estimates import report

    if usable_cores() < 2:
        pytest.skip("the tail's threads are the cores: one core leaves none fewer during backward")
    path = write_recipe(
        tmp_path,
        model_dir,
        method={"type": "full"},
        offload={"optimizer_states": "host", "overlap_optimizer": True},
    )

    def no_probe(*args, **kwargs):
        raise AssertionError("the AdamW probe ran where the engine's units were measured")

    engines = []

    def kept(*args, **kwargs):
        engines.append(measure(*args, **kwargs))
        return engines[-1]

    measure = report.measure_engine
    monkeypatch.setattr(report, "measure_adamw", no_probe)
    monkeypatch.setattr(report, "measure_engine", kept)
    est = estimate(load_recipe(path), gpu="cpu", threads=1)
    assert len(engines) == 1 and engines[0].updates > 0 and engines[0].during > 0
    assert est.speed.timeline.optimizer_busy > 0


def _engine_config(path):
    from tiertune.config.plan import plan

    return plan(load_recipe(path), "cpu")[1]


def test_the_console_log_follows_each_command_not_the_one_before(recipe_path):
    """One process that ran ``train --verbose`` (a notebook, the test session) and then ``estimate --json``: the
    estimate's console log is its own (info), so its stdout is the JSON alone and no debug line is printed;
    ``--verbose`` prints them on stderr, never in the JSON."""
    import logging

    from tiertune.cli.app import _console_log

    _console_log(quiet=False, verbose=True)  # what an earlier verbose command left
    assert logging.getLogger("tiertune").getEffectiveLevel() == logging.DEBUG
    out = CliRunner().invoke(app, ["estimate", str(recipe_path), "--json", "--no-probe", "--gpu", "cpu"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["fits"] is True and "DEBUG" not in out.output
    loud = CliRunner().invoke(
        app, ["estimate", str(recipe_path), "--json", "--no-probe", "--gpu", "cpu", "--verbose"]
    )
    assert loud.exit_code == 0, loud.output
    assert "DEBUG tiertune" in loud.stderr and json.loads(loud.stdout)["fits"] is True
    _console_log(quiet=False, verbose=False)
