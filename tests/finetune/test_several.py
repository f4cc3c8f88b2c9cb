"""Several recipes trained over one base in one run (``tiertune train a.yaml b.yaml``, ``sweep:``;
``finetune.several``): each adapter's losses, metrics and weights are its solo run's (a DPO recipe among SFT
ones), any subset of them resumes exactly from its own checkpoints (and a run of one alone from them too), a
damaged checkpoint leaves out that adapter alone, a sweep of six learning rates ends with a table of their
final losses and directories, and recipes that cannot share a base are refused naming the setting."""

import json

import pytest
import torch
import yaml
from parity import assert_adam_trained_close, assert_same_safetensors

from tests.conftest import CAT_PAIRS, CAT_TEXTS
from tiertune.config.recipe import load_recipe
from tiertune.config.sweep import load_recipes
from tiertune.errors import ConfigError

LORA = {"type": "lora", "lora": {"r": 4, "dropout": 0.0}}
QLORA = {"path": None, "dtype": "float32", "quantize": "nf4"}
OFFLOAD = {"params": "disk"}


def _recipe(
    tmp_path, write_recipe, model, name, texts=CAT_TEXTS, lora=None, training=None, data=None, objective=None
):
    where = tmp_path / name
    where.mkdir(exist_ok=True)
    return write_recipe(
        where,
        model,
        texts=texts,
        model={**QLORA, "path": str(model)},
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0, **(lora or {})}},
        data={"shuffle": False, "max_seq_len": 32, **(data or {})},
        objective=objective or {},
        training={
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "save_steps": 0,
            "learning_rate": 1e-2,
            **(training or {}),
        },
        offload={**OFFLOAD, "disk_path": str(tmp_path / "nvme")},
    )


def _dpo(tmp_path, write_recipe, model, name, training=None, data=None):
    """A DPO recipe (preference pairs; its adapter's dropout, which DPO disables, on)."""
    pairs = tmp_path / f"{name}-pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in CAT_PAIRS))
    return _recipe(
        tmp_path,
        write_recipe,
        model,
        name,
        lora={"dropout": 0.1, "seed": 7},
        data={"path": str(pairs), "format": "preference", **(data or {})},
        objective={"type": "dpo", "beta": 0.2},
        training={"learning_rate": 5e-3, **(training or {})},
    )


def _log(directory):
    return [json.loads(line) for line in (directory / "trainer_log.jsonl").read_text().splitlines()]


def test_each_recipe_over_one_base_trains_as_its_solo_run(tmp_path, write_recipe, cat_model):
    from tiertune.finetune.several import train_several
    from tiertune.finetune.train import train

    model = cat_model(2, hidden=64)
    paths = [  # LoRA dropout on in two: each adapter's masks its solo run's (its own random streams)
        _recipe(tmp_path, write_recipe, model, "a", lora={"dropout": 0.1}),
        _recipe(tmp_path, write_recipe, model, "b", texts=CAT_TEXTS[::-1], lora={"r": 8, "alpha": 16}),
        _recipe(
            tmp_path,
            write_recipe,
            model,
            "c",
            lora={"dropout": 0.1},
            training={"learning_rate": 3e-3, "max_steps": 2, "gradient_accumulation_steps": 2, "seed": 5},
        ),
        _dpo(tmp_path, write_recipe, model, "d"),
    ]
    results = train_several(load_recipes(paths), progress=False)
    assert [r.steps for r in results] == [3, 3, 2, 3]
    assert {"rewards/margins", "logps/chosen"} <= _log(results[3].output_dir)[0].keys()
    for path, result in zip(paths, results, strict=True):
        records = [
            json.loads(line) for line in (result.output_dir / "trainer_log.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == list(range(1, result.steps + 1))
        assert (result.output_dir / "adapter_model.safetensors").is_file()
        solo = train(
            load_recipe(path, [f"training.output_dir={tmp_path / 'solo' / result.name}"]), progress=False
        )
        assert result.losses == pytest.approx(solo.losses, rel=1e-5)
        solo_records = _log(solo.output_dir)
        assert [r["grad_norm"] for r in records] == pytest.approx(
            [r["grad_norm"] for r in solo_records], rel=1e-5
        )
        for mine, theirs in zip(records, solo_records, strict=True):
            for key in ("rewards/margins", "rewards/chosen", "logps/rejected"):
                if key in theirs:
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        from safetensors.torch import load_file

        mine, theirs = (
            load_file(result.output_dir / "adapter_model.safetensors"),
            load_file(solo.output_dir / "adapter_model.safetensors"),
        )
        assert mine.keys() == theirs.keys()
        for key in mine:  # Adam's steps on near-zero gradients turn summation order into weight
            assert_adam_trained_close(mine[key], theirs[key], key)


def _stopped_after(monkeypatch, steps):
    """The run's ``step_adapters`` raises SIGTERM's exception at its call ``steps + 1`` (a ledger's: uncounted)."""
    import signal

    from tiertune.engine import StreamedTrainer
    from tiertune.errors import Signalled

    calls = {"n": 0}
    real = StreamedTrainer.step_adapters

    def signalled(self, groups):
        if self.store.ledger:  # the fit's replay before the run (``estimates.adapters``)
            return real(self, groups)
        calls["n"] += 1
        if calls["n"] == steps + 1:
            raise Signalled(signal.SIGTERM)
        return real(self, groups)

    monkeypatch.setattr(StreamedTrainer, "step_adapters", signalled)


def test_any_subset_of_the_adapters_resumes_exactly_from_its_own_checkpoints(
    tmp_path, write_recipe, cat_model, monkeypatch
):
    """Three adapters (SFT, SFT with accumulation, DPO) checkpoint every 2 steps; stopped after step 3, two of
    them resume together from their step-2 checkpoints and the third alone, in a run of one: every step's
    loss and the final weights are the uninterrupted run's."""
    from safetensors.torch import load_file

    from tiertune.errors import Interrupted
    from tiertune.finetune.several import train_several
    from tiertune.finetune.train import train

    model = cat_model(2, hidden=64)
    steps = {"max_steps": 4, "save_steps": 2}

    def recipes(where):
        where.mkdir()
        return [
            _recipe(where, write_recipe, model, "a", training=steps),
            _recipe(
                where,
                write_recipe,
                model,
                "b",
                texts=CAT_TEXTS[::-1],
                training={**steps, "learning_rate": 3e-3, "gradient_accumulation_steps": 2},
            ),
            _dpo(where, write_recipe, model, "d", training=steps),
        ]

    whole = train_several(load_recipes(recipes(tmp_path / "whole")), progress=False)
    paths = recipes(tmp_path / "cut")
    with monkeypatch.context() as patch:
        _stopped_after(patch, 3)
        with pytest.raises(Interrupted) as stopped:
            train_several(load_recipes(paths), progress=False)
    assert stopped.value.step == 3
    for path in paths:
        run = load_recipe(path).training.output_dir
        assert sorted(p.name for p in type(tmp_path)(run).glob("checkpoint-*")) == ["checkpoint-2"]
    auto = ("training.resume_from_checkpoint=auto",)
    resumed = train_several(load_recipes([paths[0], paths[2]], auto), progress=False)
    assert [r.steps for r in resumed] == [4, 4] and all(
        r.resumed_from.name == "checkpoint-2" for r in resumed
    )
    alone = train(load_recipe(paths[1], auto), progress=False)
    for mine, theirs in zip(
        [resumed[0].output_dir, alone.output_dir, resumed[1].output_dir], whole, strict=True
    ):
        records, expected = _log(mine), _log(theirs.output_dir)
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
        got, want = (load_file(d / "adapter_model.safetensors") for d in (mine, theirs.output_dir))
        assert got.keys() == want.keys()
        for key in got:
            assert_adam_trained_close(got[key], want[key], key)


def test_a_damaged_checkpoint_leaves_out_its_adapter_alone(tmp_path, write_recipe, cat_model, monkeypatch):
    """Two adapters stopped after step 1; one's checkpoint damaged and named to resume from: that adapter is left
    out with the message naming the file (its directory as it was), the other resumes and finishes; the command
    exits 1."""
    from typer.testing import CliRunner

    from tiertune.cli.app import app
    from tiertune.errors import Interrupted
    from tiertune.finetune.several import train_several

    model = cat_model(2, hidden=64)
    steps = {"max_steps": 3, "save_steps": 1}
    paths = [_recipe(tmp_path, write_recipe, model, name, training=steps) for name in ("a", "b")]
    with monkeypatch.context() as patch:
        _stopped_after(patch, 1)
        with pytest.raises(Interrupted):
            train_several(load_recipes(paths), progress=False)
    damaged = tmp_path / "b" / "run" / "checkpoint-1"
    weights = damaged / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    for path, resume in zip(paths, ("auto", str(damaged)), strict=True):
        recipe = yaml.safe_load(path.read_text())
        recipe["training"]["resume_from_checkpoint"] = resume
        path.write_text(yaml.safe_dump(recipe))
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "b" / "run").rglob("*") if p.is_file())
    result = CliRunner().invoke(app, ["train", str(paths[0]), str(paths[1])])
    assert result.exit_code == 1, result.output
    assert f"{weights} does not match its checksum" in result.output
    assert "left out" in result.output
    assert [r["step"] for r in _log(tmp_path / "a" / "run")] == [1, 2, 3], result.output
    assert (tmp_path / "a" / "run" / "adapter_model.safetensors").is_file()
    after = sorted((p.name, p.stat().st_size) for p in (tmp_path / "b" / "run").rglob("*") if p.is_file())
    assert after == before


def test_an_adapter_that_diverges_stops_alone(tmp_path, write_recipe, cat_model, monkeypatch):
    """Adapter b's weights turned to NaN after its first step: its second step's loss is not finite, so its run
    stops there (its step-1 checkpoint kept, nothing exported), a's goes on to its end as its solo run; the
    command exits 1 with b's message."""
    from typer.testing import CliRunner

    from tiertune.cli.app import app
    from tiertune.engine import StreamedTrainer
    from tiertune.finetune.train import train
    from tiertune.methods.lora import adapter_name

    model = cat_model(2, hidden=64)
    steps = {"max_steps": 3, "save_steps": 1}
    paths = [_recipe(tmp_path, write_recipe, model, name, training=steps) for name in ("a", "b")]
    real = StreamedTrainer.step_adapters

    def poisoned_after_first(self, groups):
        out = real(self, groups)
        if not self.store.ledger and self.adapter_steps[adapter_name(1)] == 1:
            with torch.no_grad():
                for p in self.adapters.params_of(adapter_name(1)):
                    p.fill_(float("nan"))
        return out

    monkeypatch.setattr(StreamedTrainer, "step_adapters", poisoned_after_first)
    result = CliRunner().invoke(app, ["train", str(paths[0]), str(paths[1])])
    assert result.exit_code == 1, result.output
    assert "stopped at its step 2: the loss is nan" in result.output
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert [r["step"] for r in _log(a)] == [1, 2, 3] and [r["step"] for r in _log(b)] == [1]
    assert (a / "adapter_model.safetensors").is_file() and not (b / "adapter_model.safetensors").exists()
    assert sorted(p.name for p in b.glob("checkpoint-*")) == ["checkpoint-1"]
    monkeypatch.setattr(StreamedTrainer, "step_adapters", real)
    solo = train(load_recipe(paths[0], [f"training.output_dir={tmp_path / 'solo'}"]), progress=False)
    assert [r["loss"] for r in _log(a)] == pytest.approx(solo.losses, rel=1e-5)


def test_a_sweep_of_six_learning_rates_ends_with_a_table(tmp_path, write_recipe, cat_model):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    model = cat_model(2, hidden=64)
    path = _recipe(tmp_path, write_recipe, model, "sweep", training={"max_steps": 2})
    raw = yaml.safe_load(path.read_text())
    rates = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
    raw["sweep"] = {"training.learning_rate": rates}
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["train", str(path), "training.max_steps=2"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "sweep" / "run"
    lines = result.output.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("adapter  "))
    table = lines[header : header + 7]
    assert table[0].split() == ["adapter", "steps", "final", "loss", "output_dir"]
    for line, rate in zip(table[1:], rates, strict=True):
        directory = out / f"learning_rate={rate!r}"
        assert line.split()[1] == "2" and line.endswith(str(directory))
        assert (directory / "adapter_model.safetensors").is_file()
        final = json.loads((directory / "trainer_log.jsonl").read_text().splitlines()[-1])["loss"]
        assert line.split()[2] == f"{final:.4f}"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"model": {"quantize": "none"}}, "model.quantize is"),
        ({"offload": {"host_budget": "4MiB"}}, "offload.host_budget is"),
        ({"method": {"type": "full"}}, "method.type is full"),
    ],
)
def test_recipes_that_cannot_share_a_base_are_refused_naming_the_setting(
    tmp_path, write_recipe, cat_model, change, says
):
    from tiertune.config.sweep import shared_base

    model = cat_model(2, hidden=64)
    a = _recipe(tmp_path, write_recipe, model, "a")
    b = _recipe(tmp_path, write_recipe, model, "b")
    raw = yaml.safe_load(b.read_text())
    for section, values in change.items():
        raw[section].update(values)
    if raw["method"]["type"] == "full":
        raw["model"]["quantize"] = "nf4"
    b.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        shared_base(load_recipes([a, b]))


def test_a_sweep_that_is_malformed_or_overridden_is_refused(tmp_path, write_recipe, cat_model):
    model = cat_model(2, hidden=64)
    path = _recipe(tmp_path, write_recipe, model, "a")
    raw = yaml.safe_load(path.read_text())
    for sweep, says in (
        ({"learning_rate": [1]}, "must be a dotted setting"),
        ({"training.learning_rate": []}, "non-empty list"),
    ):
        path.write_text(yaml.safe_dump({**raw, "sweep": sweep}))
        with pytest.raises(ConfigError, match=says):
            load_recipes([path])
    path.write_text(yaml.safe_dump({**raw, "sweep": {"training.learning_rate": [1e-3, 1e-2]}}))
    with pytest.raises(ConfigError, match="swept in recipe"):
        load_recipes([path], ("training.learning_rate=1e-4",))
    with pytest.raises(ConfigError, match="sweep: section"):
        load_recipe(path)


def test_a_signal_stops_several_adapters_as_a_run_and_unlocks_their_directories(
    tmp_path, write_recipe, cat_model, monkeypatch
):
    import signal

    from tiertune.engine import StreamedTrainer
    from tiertune.errors import Interrupted, Signalled
    from tiertune.finetune.rundir import RunDirectory
    from tiertune.finetune.several import train_several

    model = cat_model(2, hidden=64)
    paths = [_recipe(tmp_path, write_recipe, model, name) for name in ("a", "b")]
    calls = {"n": 0}
    real = StreamedTrainer.step_adapters

    def second_step_signalled(self, groups):
        if self.store.ledger:  # the fit's replay before the run (``estimates.adapters``)
            return real(self, groups)
        calls["n"] += 1
        if calls["n"] == 2:
            raise Signalled(signal.SIGTERM)
        return real(self, groups)

    monkeypatch.setattr(StreamedTrainer, "step_adapters", second_step_signalled)
    recipes = load_recipes(paths)
    with pytest.raises(Interrupted) as stopped:
        train_several(recipes, progress=False)
    assert stopped.value.signal == signal.SIGTERM and stopped.value.step == 1
    for recipe in recipes:  # unlocked: another run may take the directory
        with RunDirectory(recipe.training.output_dir):
            pass


def test_each_adapter_evaluates_and_stops_early_alone_as_its_solo_run(tmp_path, write_recipe, cat_model):
    """Adapter a evaluates every step and stops early after its second (no evaluation beats the best by the
    threshold 100: patience 1); b evaluates on start and every 2 steps and runs its 4; c does not evaluate. Each
    one's evaluations are its solo run's (rel 1e-5: the pass with its adapter alone), a's and b's steps end as
    their solo runs', and the table gives each one's eval_loss."""
    from tiertune.finetune.several import format_table, train_several
    from tiertune.finetune.train import train

    model = cat_model(2, hidden=64)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS[::3]))
    evaluating = {"eval_path": str(held_out)}
    paths = [
        _recipe(
            tmp_path,
            write_recipe,
            model,
            "a",
            data=evaluating,
            training={
                "max_steps": 4,
                "eval_strategy": "steps",
                "eval_steps": 1,
                "early_stopping_patience": 1,
                "early_stopping_threshold": 100.0,
            },
        ),
        _recipe(
            tmp_path,
            write_recipe,
            model,
            "b",
            lora={"dropout": 0.1},
            data=evaluating,
            training={
                "max_steps": 4,
                "eval_strategy": "steps",
                "eval_steps": 2,
                "learning_rate": 3e-3,
                "eval_on_start": True,
            },
        ),
        _recipe(tmp_path, write_recipe, model, "c", training={"max_steps": 4}),
    ]
    results = train_several(load_recipes(paths), progress=False)
    assert [r.steps for r in results] == [2, 4, 4]
    assert [r.stopped_early for r in results] == [2, None, None]
    state = json.loads((results[0].output_dir / "trainer_state.json").read_text())
    assert state["stopped_early"] is True and state["global_step"] == 2
    for path, result, steps in zip(paths[:2], results[:2], ([1, 2], [0, 2, 4]), strict=True):
        mine = [r for r in _log(result.output_dir) if "eval_loss" in r]
        assert [r["step"] for r in mine] == steps
        solo = train(
            load_recipe(path, [f"training.output_dir={tmp_path / 'solo' / result.name}"]), progress=False
        )
        assert solo.steps == result.steps and solo.stopped_early == result.stopped_early
        theirs = solo.evaluations
        assert [r["eval_loss"] for r in mine] == pytest.approx([r["eval_loss"] for r in theirs], rel=1e-5)
        assert result.eval_loss == pytest.approx(theirs[-1]["eval_loss"], rel=1e-5)
    table = format_table(results).splitlines()
    assert table[0].split() == ["adapter", "steps", "final", "loss", "eval_loss", "output_dir"]
    assert "(stopped early)" in table[1] and f"{results[0].eval_loss:.4f}" in table[1]
    assert table[3].split()[3] == "-"  # c does not evaluate


def test_an_adapter_exports_its_best_checkpoint_alone(tmp_path, write_recipe, cat_model, monkeypatch):
    """Adapter a (load_best_model_at_end, save_total_limit 1) is told 3.0, 1.0, 2.0, 2.5 by its evaluations
    (scripted): its checkpoint-2 outlives the limit and is what it exports, to the bit; b, beside it, exports its
    last step."""

    from tiertune.finetune import several
    from tiertune.finetune.several import train_several

    losses = iter([3.0, 1.0, 2.0, 2.5])
    real = several.evaluate
    monkeypatch.setattr(
        several,
        "evaluate",
        lambda trainer, passes, *args, **kw: real(trainer, passes, *args, **kw) | {"eval_loss": next(losses)},
    )
    model = cat_model(2, hidden=64)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": t}) + "\n" for t in CAT_TEXTS[::3]))
    paths = [
        _recipe(
            tmp_path,
            write_recipe,
            model,
            "a",
            data={"eval_path": str(held_out)},
            training={
                "max_steps": 4,
                "eval_strategy": "steps",
                "eval_steps": 1,
                "save_steps": 1,
                "save_total_limit": 1,
                "load_best_model_at_end": True,
            },
        ),
        _recipe(
            tmp_path,
            write_recipe,
            model,
            "b",
            training={"max_steps": 4, "save_steps": 1, "save_total_limit": 1},
        ),
    ]
    a, b = train_several(load_recipes(paths), progress=False)
    assert sorted(p.name for p in a.output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in b.output_dir.glob("checkpoint-*")) == ["checkpoint-4"]
    assert a.best_checkpoint == a.output_dir / "checkpoint-2" and b.best_checkpoint is None
    state = json.loads((a.output_dir / "trainer_state.json").read_text())
    assert state["best_metric"] == 1.0 and state["best_model_checkpoint"] == str(
        a.output_dir / "checkpoint-2"
    )
    for result, step in ((a, 2), (b, 4)):
        name = "adapter_model.safetensors"
        assert_same_safetensors(result.output_dir / name, result.output_dir / f"checkpoint-{step}" / name)


def test_distillation_adapters_train_as_their_solo_runs_and_share_the_teachers_figures(
    tmp_path, write_recipe, cat_model
):
    """Two distillations (another temperature and learning rate; one evaluating a held-out set) beside an SFT
    adapter over one NF4 base: each adapter's losses, divergence and cross-entropy, held-out figures and weights
    are its solo run's; the teacher's figures are made once per teacher setting and data (a third distillation of
    the first's settings reads its cache)."""
    from safetensors.torch import load_file

    from tests.finetune.test_evaluation import _eval_file
    from tiertune.finetune.several import train_several
    from tiertune.finetune.train import train

    model, teacher = cat_model(2, hidden=64), cat_model(3, hidden=64)
    held_out = _eval_file(tmp_path)

    def distill(name, temperature, lr, **data):
        objective = {"type": "distill", "teacher": {"path": str(teacher), "dtype": "float32"}, "top_k": 8}
        objective |= {"beta": 0.5, "temperature": temperature, "alpha": 0.25}
        return _recipe(
            tmp_path,
            write_recipe,
            model,
            name,
            objective=objective,
            training={"learning_rate": lr},
            data=data,
        )

    evaluating = {"eval_path": str(held_out)}
    paths = [
        distill("a", 2.0, 1e-2, **evaluating),
        distill("b", 1.0, 3e-3),
        _recipe(tmp_path, write_recipe, model, "c"),
        distill("d", 2.0, 5e-3),  # the teacher settings and data of "a": its figures from a's cache
    ]
    recipes = load_recipes(paths)
    recipes[0].training.eval_strategy, recipes[0].training.eval_steps = "steps", 3
    from tiertune.estimates.adapters import estimate_adapters, format_adapters

    priced = estimate_adapters(recipes, measure=False, gpu="cpu")  # a teacher pass per setting and data
    assert set(priced.teachers) == {0, 1, 3} and priced.teachers[3] == 0
    assert (priced.teachers[0].rows, priced.teachers[0].held_out_rows) == (len(CAT_TEXTS), 7)
    assert priced.teachers[1].held_out_rows == 0
    assert "adapter 4's teacher figures: adapter 1's" in format_adapters(priced, "three")
    results = train_several(recipes, progress=False)
    assert [r.steps for r in results] == [3, 3, 3, 3]
    passes = [r.teacher_pass for r in results]
    assert (
        passes[2] is None and passes[0]["rows"] == len(CAT_TEXTS) + 7 and passes[1]["rows"] == len(CAT_TEXTS)
    )
    assert passes[3]["rows"] == 0  # read from a's cache
    for k, result in enumerate(results):
        override = [f"training.output_dir={tmp_path / 'solo' / result.name}"]
        if k == 0:
            override += ["training.eval_strategy=steps", "training.eval_steps=3"]
        solo = train(load_recipe(paths[k], override), progress=False)
        assert result.losses == pytest.approx(solo.losses, rel=1e-5), result.name
        records, solo_records = _log(result.output_dir), _log(solo.output_dir)
        assert len(records) == len(solo_records)
        for mine, theirs in zip(records, solo_records, strict=True):
            for key in ("grad_norm", "kd_loss", "ce_loss", "eval_loss", "eval_kd_loss", "eval_ce_loss"):
                assert (key in mine) == (key in theirs), key
                if key in theirs:
                    assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (result.name, key)
        if k == 0:
            assert [r["step"] for r in records if "eval_loss" in r] == [3]
        mine, theirs = (
            load_file(result.output_dir / "adapter_model.safetensors"),
            load_file(solo.output_dir / "adapter_model.safetensors"),
        )
        for key in mine:
            assert_adam_trained_close(mine[key], theirs[key], key)
