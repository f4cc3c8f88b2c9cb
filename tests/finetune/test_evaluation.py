"""Evaluation during a run (``training.eval_strategy: steps``, ``data.eval_path``) and early stopping
(``early_stopping_patience``): the logged ``eval_loss`` is the held-out set's token-mean cross-entropy as
transformers (and peft) compute it on the checkpoint of that step, dropout off; early stopping is transformers'
``EarlyStoppingCallback``'s rule; an early-stopped run is finished, and resumes only under a larger patience."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.errors import ConfigError
from tiertune.finetune.evaluation import EarlyStopping
from tiertune.finetune.train import train

HELD_OUT = [f"the {a} cat sat on the {b} mat ." for a in ("wet", "blue") for b in ("red", "old", "big")] + [
    "a cat ."
]


def _eval_file(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in HELD_OUT))
    return path


def _reference_loss(model, tokenizer, held_out) -> float:
    """The held-out set's cross-entropy by ``model`` (eval mode): the sum over every scored token of every row
    (its own forward, unpadded), divided by their number."""
    from tiertune.finetune.data import load_data

    data = load_data(str(held_out), tokenizer, "text", 32)
    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for row in data.rows:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor([row["labels"]])
            logits = model(input_ids=ids).logits.float()
            scored = labels[0, 1:] != -100
            losses = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none")
            total += float(losses[scored].double().sum())
            tokens += int(scored.sum())
    return total / tokens


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_logged_eval_loss_is_the_checkpoints_loss_by_transformers(
    tmp_path, write_recipe, cat_model, method
):
    """Every 2 steps of 4, the held-out loss; each equals transformers' (with peft, its dropout on in training
    and off here) on that step's checkpoint (LoRA), or on the model exported after the last step (full)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    lora = {"type": "lora", "lora": {"r": 4, "dropout": 0.2}} if method == "lora" else {"type": "full"}
    path = write_recipe(
        tmp_path,
        model_dir,
        method=lora,
        data={"eval_path": str(held_out)},
        training={
            "max_steps": 4,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_steps": 2,
            "learning_rate": 1e-2,
            "gradient_accumulation_steps": 2,
            "report_to": "tensorboard",
        },
    )
    result = train(load_recipe(path), progress=False)
    evaluated = result.evaluations
    assert [r["step"] for r in evaluated] == [2, 4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(result.output_dir / "runs"))
    events.Reload()  # the Trainer's names: eval/loss beside train/loss
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evaluated
    ]
    assert evaluated[0]["eval_loss"] != evaluated[1]["eval_loss"]  # the weights moved between them
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"} <= set(evaluated[0])
    state = json.loads((result.output_dir / "trainer_state.json").read_text())
    assert [r["eval_loss"] for r in state["log_history"] if "eval_loss" in r] == [
        r["eval_loss"] for r in evaluated
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # a LoRA checkpoint is a PEFT adapter; a full fine-tune's is tiertune's own: its exported model (step 4)
    checked = evaluated if method == "lora" else evaluated[-1:]
    for record in checked:
        if method == "lora":
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = PeftModel.from_pretrained(base, result.output_dir / f"checkpoint-{record['step']}")
        else:
            model = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32)
        expected = _reference_loss(model, tokenizer, held_out)
        assert record["eval_loss"] == pytest.approx(expected, rel=1e-5), record


def test_early_stopping_is_transformers_rule():
    """The stop and the best loss agree with ``EarlyStoppingCallback`` fed the same losses, at each threshold."""
    from transformers import EarlyStoppingCallback, TrainerControl, TrainerState, TrainingArguments

    losses = [3.0, 2.5, 2.49, 2.6, 2.2, 2.21, 2.199, 2.3, 2.4, 2.5]
    for patience, threshold in [(1, 0.0), (2, 0.0), (2, 0.05), (3, 0.02)]:
        args = TrainingArguments(
            output_dir="/tmp/unused", metric_for_best_model="eval_loss", greater_is_better=False, report_to=[]
        )
        callback = EarlyStoppingCallback(patience, threshold)
        state, control = TrainerState(), TrainerControl()
        rule = EarlyStopping(patience, threshold)
        for i, loss in enumerate(losses):
            callback.on_evaluate(args, state, control, metrics={"eval_loss": loss})
            if state.best_metric is None or loss < state.best_metric:  # the Trainer's _determine_best_metric
                state.best_metric = loss
            stops = rule.see(loss)
            assert stops == control.should_training_stop, (patience, threshold, i)
            assert rule.best == state.best_metric
            if stops:
                break
        assert control.should_training_stop, (patience, threshold)


def test_a_run_stops_early_is_finished_and_resumes_under_a_larger_patience(tmp_path, write_recipe, cat_model):
    """No evaluation beats the best by the threshold (100): with patience 2 the run ends after its third
    evaluation (step 3 of 10), checkpointed and exported; resumed as it is, it is refused; with patience 4 it
    trains two more steps (the log's evaluations count)."""
    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    training = {
        "max_steps": 10,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_steps": 5,
        "early_stopping_patience": 2,
        "early_stopping_threshold": 100.0,
    }
    path = write_recipe(
        tmp_path,
        model_dir,
        method={"type": "lora", "lora": {"r": 4}},
        data={"eval_path": str(held_out)},
        training=training,
    )
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "stopped early after step 3" in said and "eval_loss" in said
    run = tmp_path / "run"
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["stopped_early"] is True and state["max_steps"] == 10
    assert (run / "checkpoint-3").is_dir() and (run / "adapter_model.safetensors").is_file()
    records = [json.loads(line) for line in (run / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2, 3]
    assert max(r["step"] for r in records) == 3

    again = load_recipe(path, ["training.resume_from_checkpoint=auto"])
    with pytest.raises(ConfigError, match="stopped early at step 3"):
        train(again, progress=False)
    further = load_recipe(
        path, ["training.resume_from_checkpoint=auto", "training.early_stopping_patience=4"]
    )
    resumed = train(further, progress=False)
    assert resumed.first_step == 4 and resumed.stopped_early == 5
    assert [r["step"] for r in resumed.evaluations] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("training", "data", "objective", "message"),
    [
        ({"eval_strategy": "steps"}, {}, {}, "set data.eval_path"),
        (
            {"early_stopping_patience": 3},
            {},
            {},
            "training.early_stopping_patience needs the evaluation loss",
        ),
        (
            {"eval_strategy": "steps", "eval_steps": 0},
            {"eval_path": "x.jsonl"},
            {},
            "training.eval_steps must be",
        ),
        ({"eval_strategy": "best"}, {}, {}, "training.eval_strategy"),
        (
            {"eval_strategy": "epoch"},
            {},
            {},
            "training.eval_strategy epoch evaluates the loss on a held-out set",
        ),
        ({"eval_on_start": True}, {}, {}, "training.eval_on_start needs the evaluation loss"),
        (
            {"eval_strategy": "steps", "eval_steps": 4, "save_steps": 6, "load_best_model_at_end": True},
            {"eval_path": "x.jsonl"},
            {},
            "save_steps a multiple of the steps between evaluations (4)",
        ),
        ({"load_best_model_at_end": True}, {}, {}, "training.load_best_model_at_end exports the checkpoint"),
        (
            {"eval_strategy": "steps", "metric_for_best_model": "reward"},
            {"eval_path": "x.jsonl"},
            {},
            "training.metric_for_best_model reward is GRPO's",
        ),
    ],
)
def test_evaluation_settings_that_cannot_run_are_refused(
    tmp_path, write_recipe, cat_model, training, data, objective, message
):
    path = write_recipe(tmp_path, cat_model(2, hidden=64), training=training, data=data, objective=objective)
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in " ".join(result.output.split()), result.output


def test_a_missing_eval_file_is_named(tmp_path, write_recipe, cat_model):
    path = write_recipe(
        tmp_path,
        cat_model(2, hidden=64),
        data={"eval_path": str(tmp_path / "nowhere.jsonl")},
        training={"eval_strategy": "steps", "eval_steps": 1},
    )
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "nowhere.jsonl" in " ".join(result.output.split())


def test_estimate_says_what_an_evaluation_adds(tmp_path, write_recipe, cat_model):
    from tiertune.estimates.report import estimate

    path = write_recipe(
        tmp_path,
        cat_model(2, hidden=64),
        data={"eval_path": str(_eval_file(tmp_path))},
        training={"eval_strategy": "steps", "eval_steps": 50, "early_stopping_patience": 3},
    )
    est = estimate(load_recipe(path), measure=False)
    (note,) = [n for n in est.notes if n.startswith("evaluation")]
    assert "every 50 steps" in note and "priced below" in note and "after 3 evaluations" in note
    # the training recipe's 3 steps hold no 50th: the set's 7 rows are 2 passes of 4 rows, made once, after the last
    assert (est.evaluation.rows, est.evaluation.passes, est.evaluation.evaluations) == (7, 2, 1)
    assert "every 50 steps and after the last" in note


# 8 layers over budgets that hold a part of them: every pass and step reads from the disk. The optimizer serial:
# overlapped, the order of its accesses among the compute thread's follows the two threads' timing, and so do
# the copies the host keeps (8-layer full fine-tune: 3.2-3.4 MB read a step, the ledger's order 4.4 MB)
_ON_DISK = {
    "params": "disk",
    "optimizer_states": "disk",
    "host_budget": "1MiB",
    "device_budget": "2MiB",
    "overlap_optimizer": False,
}


@pytest.mark.parametrize(
    "setup",
    [
        {
            "method": {"type": "full"},
            "offload": _ON_DISK,
        },
        {
            "method": {"type": "lora", "lora": {"r": 4}},
            "model": {"quantize": "nf4"},
            "offload": {"params": "disk", "host_budget": "64KiB", "device_budget": "128KiB"},
        },
        {
            "method": {"type": "lora", "lora": {"r": 4}},
            "offload": {"params": "disk", "host_budget": "1MiB", "device_budget": "1MiB"},
            "objective": {"type": "dpo"},
            "data": {"format": "preference"},
        },
        {
            "method": {"type": "full"},
            "offload": _ON_DISK,
            "objective": {"type": "kto"},
            "data": {"format": "unpaired_preference"},
        },
    ],
    ids=["full-disk", "qlora", "lora-dpo", "full-kto"],
)
def test_the_bytes_an_evaluation_reads_are_a_runs(tmp_path, write_recipe, cat_model, setup):
    """The estimate's evaluation (its passes replayed on a ledger after the steps, then the step after them):
    its passes and the step after them move what the run's evaluation and next step move, link by link (the
    run logs ``bytes_moved`` on its evaluation's record too); a LoRA DPO's pass is two, its reference the base
    with the adapters off. An evaluation leaves what the budgets cache: the step after it reads from the disk
    at most what a step without one reads and two chunks more (on the ledger, the run's to its noise; seen in
    runs: 4.60 MB against a step's 5.36 MB, full; 0.29 against 0.25 MB, QLoRA; 0.15 against 0.61 MB, LoRA DPO),
    where it read again what the budgets had cached when an evaluation evicted every copy (5.82, 0.34 and
    1.54 MB: each over that bound)."""
    from tests.conftest import CAT_PAIRS
    from tiertune.estimates.report import estimate

    fmt = setup.get("data", {}).get("format", "text")
    rows = CAT_PAIRS
    if fmt == "unpaired_preference":  # KTO's labelled rows: each pair's chosen and rejected completions
        rows = [
            {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
            for p in CAT_PAIRS
            for k in ("chosen", "rejected")
        ]
    held_out = tmp_path / "held_out.jsonl"
    if fmt == "text":
        held_out = _eval_file(tmp_path)
    else:
        held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[:7]))
    sections = {k: dict(v) for k, v in setup.items()}
    sections.setdefault("data", {})["eval_path"] = str(held_out)
    sections["training"] = {"eval_strategy": "steps", "eval_steps": 3, "max_steps": 4, "max_grad_norm": 0.0}
    if fmt != "text":
        data = tmp_path / "pairs.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sections["data"]["path"] = str(data)
    path = write_recipe(tmp_path, cat_model(8, hidden=64), **sections)  # see _ON_DISK
    recipe = load_recipe(path)
    estimated = estimate(recipe, measure=False)
    est = estimated.evaluation
    # 7 rows (pairs) in passes of 4, after step 3 and after the last, 4
    assert (est.rows, est.passes, est.evaluations) == (7, 2, 2)
    result = train(recipe, progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    evaluated, _ = [r for r in log if "eval_loss" in r]  # after step 3 (and after step 4, the last)
    assert evaluated["step"] == 3
    before, after = (
        next(r for r in log if r.get("step") == n and "grad_norm" in r)["bytes_moved"] for n in (3, 4)
    )
    moved = {k: evaluated["bytes_moved"].get(k, 0) - before.get(k, 0) for k in evaluated["bytes_moved"]}
    predicted = {
        k: est.first_pass.get(k, 0) + est.later_pass.get(k, 0)
        for k in set(est.first_pass) | set(est.later_pass)
    }
    # where another program writes to the disk the run's own bytes move from step to step (a prefetch that lands
    # late is read again: a full step read 5.21 to 5.67 MB in eight runs beside `dd`, 5.36 MB alone, where every
    # figure here is the ledger's to the byte): the passes seen within a chunk of the ledger, the passes and the
    # step after them within four (fourteen runs beside `dd`); the run against the ledger within twice those
    chunk = max(t.largest_staged for t in estimated.tiers.values())
    noise = 2 * chunk
    for link in ("disk->host", "host->device"):
        assert abs(predicted.get(link, 0) - moved.get(link, 0)) <= max(0.02 * moved.get(link, 0), noise), (
            link,
            predicted,
            moved,
        )
    assert moved.get("disk->host", 0) > 0  # the budgets hold a part of the weights
    # on the ledger, whose order is the run's without the noise: a pass keeps what its own order keeps, a chunk a
    # tier off a step's at most
    chunks = 2 * estimated.tiers["host"].largest_staged
    reads = est.step_after.get("disk->host", 0)
    assert reads <= estimated.moved_per_step["disk->host"] + chunks, (
        est.step_after,
        estimated.moved_per_step,
    )
    # with the step after them: the reads to the byte again; a write-back (a dirty chunk evicted) counts when it
    # lands, which may be before step 3's record or after step 4's (seen: 946,176 and 794,624 bytes in two runs
    # of the full fine-tune, one 148 KiB chunk apart): within two of the largest chunk the host stages
    run = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = {k: predicted.get(k, 0) + est.step_after.get(k, 0) for k in set(predicted) | set(est.step_after)}
    for link in set(run) | set(total):
        slack = (
            2 * estimated.tiers["host"].largest_staged
            if link == "host->disk"
            else max(0.02 * run.get(link, 0), 8 * chunk)
        )
        assert abs(total.get(link, 0) - run.get(link, 0)) <= slack, (link, total, run)


@pytest.mark.parametrize(
    "setup",
    [
        {"method": {"type": "full"}, "offload": {"params": "host", "delay_update": True}},
        {"method": {"type": "full"}, "offload": {"params": "disk", "optimizer_states": "disk"}},
        {"method": {"type": "lora", "lora": {"r": 4, "dropout": 0.1}}, "model": {"quantize": "nf4"}},
    ],
    ids=["full-delayed", "full-disk", "qlora"],
)
def test_evaluating_every_step_leaves_the_training_as_it_was(tmp_path, write_recipe, cat_model, setup):
    """The same run with and without an evaluation after every step (and a checkpoint every step, written in
    the background while the next steps run): the same losses and gradient norms, exactly."""
    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    runs = []
    for name, evaluating in (("plain", {}), ("evaluated", {"eval_strategy": "steps", "eval_steps": 1})):
        where = tmp_path / name
        where.mkdir()
        path = write_recipe(
            where,
            model_dir,
            method=setup["method"],
            model={"path": str(model_dir), "dtype": "float32", **setup.get("model", {})},
            data={"eval_path": str(held_out)},
            training={"max_steps": 4, "save_steps": 1, "learning_rate": 1e-3, **evaluating},
            offload={"disk_path": str(where / "nvme"), **setup.get("offload", {})},
        )
        runs.append(train(load_recipe(path), progress=False))
    plain, evaluated = runs
    assert len(evaluated.evaluations) == 4 and not plain.evaluations
    assert evaluated.losses == plain.losses
    norms = [
        [json.loads(line)["grad_norm"] for line in r.log_path.read_text().splitlines() if "grad_norm" in line]
        for r in runs
    ]
    assert norms[0] == norms[1] and len(norms[0]) == 4


@pytest.mark.parametrize("method", ["lora", "full"])
def test_the_best_checkpoint_is_kept_and_exported_at_the_end(
    tmp_path, write_recipe, cat_model, monkeypatch, method
):
    """load_best_model_at_end with save_total_limit 1: the evaluations say 3.0, 1.0, 2.0, 2.5 (scripted), so
    checkpoint-2 outlives the limit beside checkpoint-4 and is what the run exports: the model a run of 2 steps
    exports, to the bit; trainer_state.json names it with the Trainer's best_metric and best_model_checkpoint."""
    from parity import assert_same_safetensors

    from tiertune.finetune import train as train_module

    losses = iter([3.0, 1.0, 2.0, 2.5])
    real = train_module.evaluate

    def scripted(trainer, passes, *args):
        return real(trainer, passes, *args) | {"eval_loss": next(losses)}

    monkeypatch.setattr(train_module, "evaluate", scripted)
    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    lora = {"type": "lora", "lora": {"r": 4, "dropout": 0.0}} if method == "lora" else {"type": "full"}

    def run(name, **training):
        where = tmp_path / name
        where.mkdir()
        path = write_recipe(
            where,
            model_dir,
            method=lora,
            data={"eval_path": str(held_out), "shuffle": False},
            training={"save_steps": 1, "learning_rate": 1e-2, "lr_scheduler_type": "constant", **training},
            offload={"disk_path": str(where / "nvme")},
        )
        return train(load_recipe(path), progress=False)

    best = run(
        "best",
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
    )
    assert sorted(p.name for p in best.output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert best.best_checkpoint == best.output_dir / "checkpoint-2"
    state = json.loads((best.output_dir / "trainer_state.json").read_text())
    assert state["best_metric"] == 1.0 and state["best_model_checkpoint"] == str(
        best.output_dir / "checkpoint-2"
    )
    assert state["global_step"] == 4
    two = run("two", max_steps=2)
    name = "adapter_model.safetensors" if method == "lora" else "model.safetensors"
    assert_same_safetensors(best.output_dir / name, two.output_dir / name)


def test_tiertune_evaluate_gives_a_runs_own_figure_and_transformers_for_a_model(
    tmp_path, write_recipe, cat_model
):
    """`tiertune evaluate` of a LoRA run, of its checkpoint and of the model: the eval_loss the run logged after
    its last step and after step 2, and transformers' loss of the model (rel 1e-6); a DPO run's pairs as it
    logged them; what cannot be evaluated exits 2 saying why."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    path = write_recipe(
        tmp_path,
        model_dir,
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.1}},
        data={"eval_path": str(held_out)},
        training={
            "max_steps": 4,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_steps": 2,
            "learning_rate": 1e-2,
        },
    )
    result = train(load_recipe(path), progress=False)
    logged = {r["step"]: r["eval_loss"] for r in result.evaluations}

    def evaluated(*args):
        out = CliRunner().invoke(app, ["evaluate", *map(str, args), "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.output.strip().splitlines()[-1])

    run = evaluated(result.output_dir, held_out)
    assert run["eval_loss"] == pytest.approx(logged[4], rel=1e-6)
    assert run["eval_rows"] == len(HELD_OUT) and run["eval_tokens"] > 0
    assert evaluated(result.output_dir / "checkpoint-2", held_out)["eval_loss"] == pytest.approx(
        logged[2], rel=1e-6
    )
    model = evaluated(model_dir, held_out)["eval_loss"]
    expected = _reference_loss(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
        held_out,
    )
    assert model == pytest.approx(expected, rel=1e-6)
    said = CliRunner().invoke(app, ["evaluate", str(result.output_dir), str(held_out)])
    assert said.exit_code == 0 and f"eval_loss {logged[4]:.4f} (perplexity" in said.output, said.output
    refused = CliRunner().invoke(app, ["evaluate", str(model_dir), str(held_out), "--format", "preference"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "a LoRA run's adapter" in " ".join(refused.output.split())
    kto = CliRunner().invoke(
        app, ["evaluate", str(model_dir), str(held_out), "--format", "unpaired_preference"]
    )
    assert kto.exit_code == 2 and "KTO scores labelled rows against a reference" in " ".join(
        kto.output.split()
    )
    missing = CliRunner().invoke(app, ["evaluate", str(model_dir), str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2 and "none.jsonl" in missing.output


def test_evaluation_at_each_epochs_end_and_on_start(tmp_path, write_recipe, cat_model):
    """eval_strategy: epoch evaluates after the step that took each epoch's last micro-batch (12 rows, 4 a
    micro-batch, 2 a step: after steps 2, 3, 5 and 6), and eval_on_start before the first step: step 0, the
    initial model's loss by transformers (LoRA's B starts at zero)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = cat_model(2, hidden=64)
    held_out = _eval_file(tmp_path)
    path = write_recipe(
        tmp_path,
        model_dir,
        method={"type": "lora", "lora": {"r": 4}},
        data={"eval_path": str(held_out), "shuffle": False},
        training={
            "max_steps": 6,
            "gradient_accumulation_steps": 2,
            "eval_strategy": "epoch",
            "eval_on_start": True,
        },
    )
    result = train(load_recipe(path), progress=False)
    evaluated = result.evaluations
    assert [r["step"] for r in evaluated] == [0, 2, 3, 5, 6]
    assert [r["epoch"] for r in evaluated][:2] == [0.0, pytest.approx(4 / 3, rel=1e-3)]
    initial = _reference_loss(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
        held_out,
    )
    assert evaluated[0]["eval_loss"] == pytest.approx(initial, rel=1e-5)
    assert evaluated[-1]["eval_loss"] < evaluated[0]["eval_loss"]  # trained on the same sentences' words
