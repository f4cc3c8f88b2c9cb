"""A GRPO run on this CPU (``objective.type: grpo``): a toy task with a verifiable reward (say "cat") is learned,
the reward's mean rising over training, the log carrying TRL's names and a sample of completions beside it; a
recipe or reward function that cannot work is refused with what to change."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import CAT_TEXTS
from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.finetune.train import train

REWARDS = '''
def cats(prompts, completions, **kwargs):
    """The share of a completion's words that are "cat"."""
    return [c.split().count("cat") / max(1, len(c.split())) for c in completions]
'''


def _recipe(tmp_path, write_recipe, model_dir, objective=None, training=None, method=None, data=None):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:2])}) + "\n" for t in CAT_TEXTS[:8]))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(prompts), "format": "prompt", "shuffle": False, "max_seq_len": 32, **(data or {})},
        method=method or {"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        objective={
            "type": "grpo",
            "num_generations": 8,
            "max_completion_length": 8,
            "reward_funcs": [f"{tmp_path / 'rewards.py'}:cats"],
            **(objective or {}),
        },
        training={
            "max_steps": 60,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": 5e-2,
            "save_steps": 0,
            **(training or {}),
        },
    )


def test_a_verifiable_reward_is_learned_on_this_cpu(cat_model, tmp_path, write_recipe):
    result = train(load_recipe(_recipe(tmp_path, write_recipe, cat_model(2, hidden=64))), progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert len(log) == 60
    names = {"loss", "reward", "reward_std", "rewards/cats/mean", "rewards/cats/std", "frac_reward_zero_std"}
    names |= {"completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "num_tokens"}
    assert names <= set(log[0])
    rewards = [r["reward"] for r in log]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-15:]) / 15
    assert last > first + 0.05, (first, last, rewards)
    samples = [
        json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()
    ]
    assert samples and {"step", "prompt", "completion", "advantage", "rewards"} <= set(samples[0])
    assert {s["step"] for s in samples} == set(range(1, 61))


@pytest.mark.parametrize(
    ("objective", "training", "method", "message"),
    [
        ({"reward_funcs": None}, {}, None, "objective.reward_funcs must name one or more"),
        ({"num_generations": 3}, {}, None, "must be a multiple of objective.num_generations"),
        (
            {"loss_type": "sigmoid"},
            {},
            None,
            "objective.loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo",
        ),
        ({"max_completion_length": 32}, {}, None, "objective.max_completion_length must be >= 1 and below"),
        ({"reward_weights": [1.0, 2.0]}, {}, None, "objective.reward_weights must give one weight per"),
        ({"reward_funcs": ["nosuchmodule_xyz:f"]}, {}, None, "importing nosuchmodule_xyz failed"),
        ({"loss_type": "cispo"}, {}, None, "objective.epsilon_high bounds cispo's importance weights"),
        ({"importance_sampling_level": "seq"}, {}, None, "objective.importance_sampling_level"),
        ({"sapo_temperature_neg": 0.0}, {}, None, "and sapo_temperature_neg must be > 0"),
    ],
)
def test_a_grpo_recipe_that_cannot_run_says_what_to_change(
    cat_model, tmp_path, write_recipe, objective, training, method, message
):
    path = _recipe(tmp_path, write_recipe, cat_model(2, hidden=64), objective, training, method)
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_a_reward_function_that_fails_is_named(cat_model, tmp_path, write_recipe):
    path = _recipe(tmp_path, write_recipe, cat_model(2, hidden=64), training={"max_steps": 1})
    (tmp_path / "rewards.py").write_text("def cats(prompts, completions, **kw):\n    return [1.0]\n")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    assert "the reward function cats returned 1 rewards for 8 completions" in " ".join(result.output.split())


def test_estimate_prices_a_grpo_update_and_says_what_it_leaves_out(cat_model, tmp_path, write_recipe):
    path = _recipe(tmp_path, write_recipe, cat_model(2, hidden=64))
    result = CliRunner().invoke(app, ["estimate", str(path), "--no-probe"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "will it fit" in out and "grpo generation: 8 completions together" in out
    assert "a decoded token moves" in out and "the KV cache" in out  # (no rates with --no-probe: no time)


def test_estimate_prices_a_full_fine_tunes_reference_beside_it(
    cat_model, tmp_path, write_recipe, monkeypatch
):
    """A full fine-tune's KL term: the estimate plans the policy within half the budgets (the smallest budgets
    it names are the recipe's settings, both halves) and prices the reference's pass a generation on its own
    ledger store (its passes replayed: the first from cold, the next with what its budgets keep): the bytes the
    run's reference passes read from the disk, to the byte. Its half of the host budget holds the tiny model:
    after the first generation it reads nothing."""
    from tiertune.estimates.report import estimate, format_estimate
    from tiertune.finetune.reference import ReferenceBeside

    offload = [f"offload.{k}={v}" for k, v in (("params", "disk"), ("disk_path", tmp_path / "disk"))]
    offload.append("offload.host_budget=2MiB")
    path = _recipe(tmp_path, write_recipe, cat_model(2, hidden=64), {"beta": 0.04}, None, {"type": "full"})
    est = estimate(load_recipe(path, offload), measure=False)
    g = est.generation
    assert est.tiers["host"].budget == 1 << 20 and est.beside == 2
    assert g is not None and g.reference_flops > 0 and g.reference_peak > 0
    text = " ".join(format_estimate(est, "t").split())
    assert "the reference (the initial weights beside the policy" in text
    assert "grpo's reference is the initial weights: a frozen copy streams beside the policy" in text

    reads = []
    score = ReferenceBeside.score

    def counted(self, micro_batches):
        before = self.disk_bytes
        score(self, micro_batches)
        reads.append(self.disk_bytes - before)

    monkeypatch.setattr(ReferenceBeside, "score", counted)
    train(load_recipe(path, [*offload, "training.max_steps=3"]), progress=False)
    assert len(reads) == 3 and reads[0] > 0  # a generation a step; the first reads the weights
    assert reads[1:] == [g.reference_pass.get("disk->host", 0)] * 2


def test_a_70b_qlora_grpo_step_on_a_24_gb_gpu_is_priced_with_its_generation(monkeypatch):
    """The built-in recipe on the shipped Llama 3 70B config: a decoded token reads the NF4 layers at most once
    for all 16 completions (the ledger's steady pass), and less from the disk: the host budget the update's
    activations leave keeps most of them between passes (a repeating pass's eviction: what the next pass needs
    soonest stays); the KV cache is 80 layers x 8 KV heads x 128 x 2 (keys and values) x 2 bytes a token, and the
    generation fits the 24 GB GPU beside the store and the adapters."""
    from tiertune.cli.app import RECIPES
    from tiertune.estimates.report import estimate
    from tiertune.loading.hub import SHIPPED

    recipe = load_recipe(
        RECIPES / "llama3-70b-qlora-grpo-24gb.yaml",
        (f"model.path={SHIPPED / 'meta-llama/Meta-Llama-3-70B'}",),
    )
    est = estimate(recipe, measure=False, gpu="rtx4090")
    g = est.generation
    assert g is not None and g.sequences == 16 and g.passes == 256 and g.prompt_tokens == 256
    nf4_layers = est.kinds["weights, quantized cache"][1]
    read, copied = g.steady_pass["disk->host"], g.steady_pass["host->device"]
    assert copied <= nf4_layers and read < nf4_layers / 4  # (40 GiB of host: 6.17 of the 32.89 GiB read)
    assert g.bytes_per_token == read + copied
    assert g.kv_bytes == 80 * 8 * 128 * 2 * 2 * 512 * 16
    assert g.fits and g.held < 24 * 2**30 and g.largest_sequences >= 16
    assert g.read_bytes["disk->host"] == g.first_pass["disk->host"] + 255 * read
    # a host budget that holds the update's activations and little more: a decoded token reads the layers again
    small = load_recipe(
        RECIPES / "llama3-70b-qlora-grpo-24gb.yaml",
        (f"model.path={SHIPPED / 'meta-llama/Meta-Llama-3-70B'}", "offload.host_budget=14GiB"),
    )
    assert (
        estimate(small, measure=False, gpu="rtx4090").generation.steady_pass["disk->host"] > 0.8 * nf4_layers
    )


def test_a_generation_whose_kv_cache_does_not_fit_the_gpu_holds_it_in_host_memory():
    """128 completions of the 70B recipe's lengths: their KV cache (20 GiB) does not fit the 24 GB GPU beside the
    store, so the run holds it in host memory (``engine.generate.kv_on_host``) and the estimate says so: the GPU
    then holds two layers' of it, and a decoded token copies the cache at its average context to the GPU and
    back (in the bytes a token moves, and the generation's time)."""
    from tiertune.cli.app import RECIPES
    from tiertune.estimates.generation import format_generation
    from tiertune.estimates.report import estimate
    from tiertune.loading.hub import SHIPPED

    overrides = (
        f"model.path={SHIPPED / 'meta-llama/Meta-Llama-3-70B'}",
        "training.per_device_train_batch_size=16",
        "training.gradient_accumulation_steps=8",
    )
    recipe = load_recipe(RECIPES / "llama3-70b-qlora-grpo-24gb.yaml", overrides)
    g = estimate(recipe, measure=False, gpu="rtx4090").generation
    assert g is not None and g.sequences == 128 and g.kv_bytes == 80 * 8 * 128 * 2 * 2 * 512 * 128
    assert g.kv_on_host and g.fits and g.kv_held == 2 * g.kv_bytes // 80
    average = g.kv_bytes * (256 + 256 / 2) / 512
    assert g.kv_pass == {"host->device": int(average), "device->host": int(average)}
    assert g.bytes_per_token == g.steady_pass["disk->host"] + g.steady_pass["host->device"] + int(average)
    assert "does not fit beside the store: held in host memory" in " ".join(format_generation(g))
    one = estimate(
        load_recipe(RECIPES / "llama3-70b-qlora-grpo-24gb.yaml", overrides[:1]), False, gpu="rtx4090"
    )
    assert not one.generation.kv_on_host and one.generation.kv_pass == {}  # 16 completions: on the GPU


@pytest.mark.parametrize(
    ("method", "spread"),
    [("lora", {"num_iterations": 2}), ("full", {"num_iterations": 2}), ("lora", {"steps_per_generation": 4})],
)
def test_a_resumed_run_repeats_the_uninterrupted_one_inside_a_generation_too(
    cat_model, tmp_path, write_recipe, interrupted_after, method, spread
):
    """Two steps a generation (``num_iterations: 2``, or a generation of two steps' completions:
    ``steps_per_generation`` 4), checkpoints at steps 2 (a generation's boundary) and 3 (inside one): stopped
    after step 4 and resumed from 3, or after 3 and resumed from 2, the steps left have the losses, rewards,
    clip ratios and completions of the uninterrupted run (the checkpoint inside a generation keeps its
    completions and the old policy's log-probabilities; a boundary's samples anew, from the run's seed)."""
    model = cat_model(2, hidden=64)
    settings = dict(
        # full: the reference (the initial weights) beside the policy, its figures kept with the generation
        objective={**spread, "beta": 0.04},
        training={"max_steps": 6, "learning_rate": 2e-2, "save_steps": 1, "lr_scheduler_type": "constant"},
        method={"type": "full"} if method == "full" else None,
    )
    whole_dir = tmp_path / "whole"
    whole_dir.mkdir()
    whole = train(load_recipe(_recipe(whole_dir, write_recipe, model, **settings)), progress=False)
    names = ("loss", "grad_norm", "kl", "reward", "clip_ratio/region_mean", "completions/mean_length")
    names += ("num_tokens",)
    for stop_after, resume_from in ((4, 3), (3, 2)):
        cut_dir = tmp_path / f"cut-{stop_after}"
        cut_dir.mkdir()
        recipe = _recipe(cut_dir, write_recipe, model, **settings)
        with interrupted_after(stop_after), pytest.raises(KeyboardInterrupt):
            train(load_recipe(recipe), progress=False)
        checkpoint = cut_dir / "run" / f"checkpoint-{resume_from}"
        assert (checkpoint / "rollouts.pt").is_file()
        resumed = train(
            load_recipe(recipe, [f"training.resume_from_checkpoint={checkpoint}"]), progress=False
        )
        assert resumed.first_step == resume_from + 1
        ours = [json.loads(line) for line in resumed.log_path.read_text().splitlines()]
        theirs = [json.loads(line) for line in whole.log_path.read_text().splitlines()]
        assert len(ours) == len(theirs) == 6
        for mine, ref in zip(ours[resume_from:], theirs[resume_from:], strict=True):
            timed = {"tokens_per_second", "generation_seconds", "reference_seconds", "old_logps_seconds"}
            assert set(mine) >= set(ref) - timed
            for key in names:
                if key in ref:
                    assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, mine["step"])
        samples = [
            json.loads(line) for line in (resumed.output_dir / "completions.jsonl").read_text().splitlines()
        ]
        expected = [
            json.loads(line) for line in (whole.output_dir / "completions.jsonl").read_text().splitlines()
        ]
        later = [s["completion"] for s in samples if s["step"] > resume_from]
        assert later == [s["completion"] for s in expected if s["step"] > resume_from]


def test_a_full_fine_tunes_reference_streams_beside_it_once_a_generation(
    cat_model, tmp_path, write_recipe, monkeypatch
):
    """GRPO's KL term on a full fine-tune (``beta`` 0.04): the reference, the initial weights as they ship,
    streams beside the policy within half the budgets and scores a generation's completions in one pass (its
    weights read from the disk at most once a generation, not once a step: the first pass reads them all, the
    next what its budgets did not keep); its log-probabilities are the initial model's at the sampling
    temperature (the first step's ``kl`` is 0: the policy is the reference then), and the budgets the recipe
    gives are split between the two stores (each planned within half)."""
    from tiertune.finetune.reference import ReferenceBeside

    passes = []
    score = ReferenceBeside.score

    def counted(self, micro_batches):
        before = self.disk_bytes
        score(self, micro_batches)
        layers = sum(self.trainer.chunk_sizes()["layer_weights"])
        weights = sum(self.trainer.chunk_sizes()["weights"])
        passes.append((self.disk_bytes - before, layers, weights, self.trainer.store.config.host_budget))
        assert all(mb["ref_logps"].shape == (4, mb["input_ids"].shape[1] - 1) for mb in micro_batches)

    monkeypatch.setattr(ReferenceBeside, "score", counted)
    offload = {"params": "disk", "disk_path": str(tmp_path / "disk"), "host_budget": "2MiB"}
    path = _recipe(
        tmp_path,
        write_recipe,
        cat_model(2, hidden=64),
        {"beta": 0.04, "num_iterations": 2, "temperature": 0.8},
        {"max_steps": 4, "learning_rate": 2e-2},
        {"type": "full"},
    )
    recipe = load_recipe(path, [f"offload.{k}={v}" for k, v in offload.items()])
    result = train(recipe, progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert len(passes) == 2  # 4 steps, 2 a generation
    (first, layers, weights, host), (second, *_) = passes
    assert layers <= first <= weights * 1.05, passes  # its weights once
    assert second <= first and host == 1 << 20  # half the recipe's host budget
    assert log[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(r["kl"] > 1e-6 for r in log[1:])
    assert "reference_seconds" in log[0] and "reference_seconds" in log[2]


def _held_out(tmp_path, training, objective=None):
    """``_recipe``'s arguments for a run that evaluates 3 held-out prompts, 2 completions each."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"the {a} cat"}) + "\n" for a in ("red", "old", "fat")))
    return {
        "objective": {"num_generations_eval": 2, **(objective or {})},
        "training": {"eval_strategy": "steps", "learning_rate": 1e-2, **training},
        "data": {"eval_path": str(held_out)} if training.get("eval_strategy", "steps") != "no" else {},
    }


def test_a_grpo_run_evaluates_its_held_out_prompts_as_the_estimate_says(cat_model, tmp_path, write_recipe):
    """Before the first step, every 2 steps and after the last: the held-out prompts sampled and rewarded (TRL's
    names with eval_), a sample of the completions beside the steps'; the estimate counts what it samples."""
    from tiertune.estimates.report import estimate

    settings = _held_out(tmp_path, {"max_steps": 3, "eval_steps": 2, "eval_on_start": True})
    path = _recipe(tmp_path, write_recipe, cat_model(2, hidden=64), **settings)
    recipe = load_recipe(path)
    est = estimate(recipe, measure=False).evaluation
    # 6 completions: one generation of up to 8; scored in a pass of 2 micro-batches of 4; 3 evaluations
    assert (est.rows, est.generations, est.passes, est.evaluations) == (6, 1, 1, 3)
    assert est.generation_bytes == estimate(recipe, measure=False).generation.read_bytes
    run = CliRunner().invoke(app, ["train", str(path)])
    assert run.exit_code == 0, run.output
    out = recipe.training.output_dir
    log = [json.loads(line) for line in (Path(out) / "trainer_log.jsonl").read_text().splitlines()]
    evaluated = [r for r in log if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [0, 2, 3]
    rewards = f"eval_reward {evaluated[0]['eval_reward']:.4f} -> {evaluated[-1]['eval_reward']:.4f}"
    assert rewards in " ".join(run.output.split())  # the final line: what the held-out prompts earned
    names = {
        "eval_loss",
        "eval_reward",
        "eval_reward_std",
        "eval_rewards/cats/mean",
        "eval_frac_reward_zero_std",
    }
    names |= {
        "eval_completions/mean_length",
        "eval_runtime",
        "eval_samples_per_second",
        "bytes_moved",
        "epoch",
    }
    assert names <= set(evaluated[0])
    assert "eval_num_tokens" not in evaluated[0]  # the steps' count, not an evaluation's
    samples = [json.loads(line) for line in (Path(out) / "completions.jsonl").read_text().splitlines()]
    held = [s for s in samples if s.get("eval")]
    assert {s["step"] for s in held} == {0, 2, 3} and len(held) == 3 * 6
    assert {s["prompt"] for s in held} == {"the red cat", "the old cat", "the fat cat"}
    assert {s["step"] for s in samples if not s.get("eval")} == {1, 2, 3}
    # `tiertune evaluate` of the run: its last evaluation's figures (the same seeds, weights and step)
    held_out = str(tmp_path / "held_out.jsonl")
    again = CliRunner().invoke(app, ["evaluate", out, held_out, "--json"])
    assert again.exit_code == 0, again.output
    record = json.loads(again.output.strip().splitlines()[-1])
    for key in ("eval_loss", "eval_reward", "eval_reward_std", "eval_completions/mean_length"):
        assert record[key] == pytest.approx(evaluated[-1][key], rel=1e-5, abs=1e-7), key
    said = CliRunner().invoke(app, ["evaluate", out, held_out])
    assert said.exit_code == 0 and f"eval_reward {record['eval_reward']:.4f}" in said.output, said.output


def test_a_grpo_run_stops_early_on_its_held_out_reward_and_exports_the_best(
    cat_model, tmp_path, write_recipe, monkeypatch
):
    """metric_for_best_model: eval_reward (greater is better): scripted rewards 1, 3, 2, 2.5 stop the run after
    step 4 (patience 2), and checkpoint 2's adapter, kept beside save_total_limit 1, is the one exported: a run
    of 2 steps' to the bit."""
    from parity import assert_same_safetensors

    from tiertune.finetune import train as train_module

    rewards = iter([1.0, 3.0, 2.0, 2.5, 9.0])
    real = train_module.evaluate_rollouts

    def scripted(*args):
        return real(*args) | {"eval_reward": next(rewards)}

    monkeypatch.setattr(train_module, "evaluate_rollouts", scripted)
    model_dir = cat_model(2, hidden=64)

    def run(name, **training):
        where = tmp_path / name
        where.mkdir()
        settings = _held_out(where, {"save_steps": 1, "lr_scheduler_type": "constant", **training})
        return train(load_recipe(_recipe(where, write_recipe, model_dir, **settings)), progress=False)

    best = run(
        "best",
        max_steps=6,
        eval_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_reward",
        early_stopping_patience=2,
    )
    assert best.stopped_early == 4
    assert best.best_checkpoint == best.output_dir / "checkpoint-2"
    state = json.loads((best.output_dir / "trainer_state.json").read_text())
    assert state["best_metric"] == 3.0 and state["stopped_early"]
    two = run("two", max_steps=2, eval_strategy="no")
    assert_same_safetensors(
        best.output_dir / "adapter_model.safetensors", two.output_dir / "adapter_model.safetensors"
    )


def test_a_reward_model_is_named_by_the_estimate_and_a_wrong_one_refused(cat_model, tmp_path, write_recipe):
    """A reward model's directory among reward_funcs: the estimate says it is held beside the budgets and its
    size; a directory that holds no sequence-classification model stops the run saying so, and a name that is
    neither a function nor a model is refused before anything loads."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from tiertune.estimates.report import estimate

    model_dir = cat_model(2, hidden=64)
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm)
    path = _recipe(tmp_path, write_recipe, model_dir, {"reward_funcs": [str(rm)]}, {"max_steps": 1})
    (note,) = [n for n in estimate(load_recipe(path), measure=False).notes if "reward model" in n]
    size = sum(f.stat().st_size for f in rm.glob("*.safetensors"))
    assert str(rm) in note and "outside the budgets" in note and f"{size / 1024:.2f} KiB" in note
    result = CliRunner().invoke(app, ["train", str(path)])  # no tokenizer beside it
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "is neither module:function nor a reward model" in " ".join(result.output.split()), result.output
    for name in ("no_such_thing", str(tmp_path)):  # (a directory without a model's config.json)
        bad = _recipe(tmp_path, write_recipe, model_dir, {"reward_funcs": [name]}, {"max_steps": 1})
        result = CliRunner().invoke(app, ["train", str(bad)])
        assert result.exit_code == 2 and "or a reward model" in " ".join(result.output.split()), result.output


def test_a_generation_that_feeds_two_steps_is_priced_for_its_sequences_and_passes(
    cat_model, tmp_path, write_recipe
):
    """steps_per_generation twice the accumulation: the estimate's generation decodes two steps' completions
    together (16, one prefill and decoding for both), its later step's old policy a pass more; a setting that
    is no whole number of steps is refused."""
    from tiertune.estimates.report import estimate

    model_dir = cat_model(2, hidden=64)
    one = estimate(load_recipe(_recipe(tmp_path, write_recipe, model_dir)), measure=False).generation
    path = _recipe(tmp_path, write_recipe, model_dir, {"steps_per_generation": 4})
    two = estimate(load_recipe(path), measure=False).generation
    assert (one.sequences, one.spans, one.old_passes) == (8, 1, 0)
    assert (two.sequences, two.spans, two.old_passes) == (16, 2, 2)
    assert two.kv_bytes == 2 * one.kv_bytes and two.prefill_flops == pytest.approx(2 * one.prefill_flops)
    assert two.bytes_per_token == one.bytes_per_token  # the weights read once a decoded token for all of them
    bad = _recipe(tmp_path, write_recipe, model_dir, {"steps_per_generation": 3})
    result = CliRunner().invoke(app, ["train", str(bad)])
    assert result.exit_code == 2 and "must be a multiple of gradient_accumulation_steps" in " ".join(
        result.output.split()
    ), result.output
