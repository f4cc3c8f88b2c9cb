"""GRPO (``objective.type: grpo``) against TRL 1.16's own ``GRPOTrainer``: the same prompts, the same completions
(tiertune samples them; TRL's generation is replaced by a ``rollout_func`` returning them) and the same reward
function give every step's loss, ``kl``, clip ratios, rewards and advantages equal to TRL's (fp32), for LoRA with
the base on disk and for a full fine-tune with its weights and Adam states on disk."""

import json

import pytest
import torch
from parity import TRL_AS_TIERTUNE, seed_lora, trl_lora

from tests.conftest import CAT_TEXTS
from tiertune.config.recipe import load_recipe
from tiertune.finetune import grpo
from tiertune.finetune.grpo_evaluation import EVAL_GENERATION
from tiertune.finetune.train import train

PROMPTS = [{"prompt": " ".join(t.split()[:2]), "animal": "cat"} for t in CAT_TEXTS[:4]]
REWARDS = '''
def cats(prompts, completions, completion_ids, animal, **kwargs):
    """A verifiable reward: the share of a completion's words that are the row's animal."""
    return [c.split().count(a) / max(1, len(c.split())) for c, a in zip(completions, animal)]


def length(prompts, completions, **kwargs):
    """Shorter is better (None for an empty completion: no reward)."""
    return [None if not c else -len(c) / 40 for c in completions]
'''
LORA = {
    "type": "lora",
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear", "seed": 3},
}
STEPS, ROWS, ACCUM, GENERATIONS, LENGTH = 3, 4, 2, 4, 8
# held-out prompts, 3 completions each: 9 a set, sampled 8 then 1, scored in micro-batches of 4, 4 and 1
EVAL_PROMPTS = [{"prompt": f"the {a} cat sat", "animal": "cat"} for a in ("big", "old", "fat")]
EVAL_GENERATIONS, EVAL_STEPS = 3, 2
BUDGETS = {"device_budget": "2MiB", "host_budget": "1MiB"}
BESIDE_BUDGETS = {"device_budget": "4MiB", "host_budget": "2MiB"}


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2, hidden=64)


def _ours(tmp_path, write_recipe, model_dir, method, objective, learning_rate, monkeypatch, evaluating=False):
    """tiertune's run; returns its log and each generation's (prompt ids, completion ids, advantages); with
    ``evaluating``, each evaluation's completions too (a dict: prompt ids -> its completions' ids, in order)."""
    beside = method["type"] != "lora" and objective["beta"] != 0
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    held_out = {}
    if evaluating:
        (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL_PROMPTS))
        held_out = {
            "eval_path": str(tmp_path / "held_out.jsonl"),
            "eval": {"eval_strategy": "steps", "eval_steps": EVAL_STEPS, "eval_on_start": True},
        }
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    path = write_recipe(
        tmp_path,
        model_dir,
        data={
            "path": str(data),
            "format": "prompt",
            "shuffle": False,
            "max_seq_len": 32,
            **({"eval_path": held_out["eval_path"]} if evaluating else {}),
        },
        method=method,
        objective={
            "type": "grpo",
            "num_generations": GENERATIONS,
            "max_completion_length": LENGTH,
            "reward_funcs": [f"{rewards}:cats", f"{rewards}:length"],
            "reward_weights": [1.0, 0.5],
            **({"num_generations_eval": EVAL_GENERATIONS} if evaluating else {}),
            **objective,
        },
        training={
            **held_out.get("eval", {}),
            "max_steps": STEPS,
            "per_device_train_batch_size": ROWS,
            "gradient_accumulation_steps": ACCUM,
            "learning_rate": learning_rate,
            "save_steps": 0,
        },
        # a full fine-tune's reference, the initial weights, beside the policy: half the budgets each
        offload={"params": "disk", **(BESIDE_BUDGETS if beside else BUDGETS)},
    )
    made = []
    generate = grpo.Rollouts.generate

    def recorded(self, indices, generation, step, places=None):
        batch = generate(self, indices, generation, step, places)
        made.append((batch.prompt_ids, batch.completion_ids, batch.advantages.clone()))
        return batch

    monkeypatch.setattr(grpo.Rollouts, "generate", recorded)
    evaluations = []
    sample = grpo.Rollouts.sample

    def sampled(self, rows, seeds):  # an evaluation's completions, by the prompts they complete
        out = sample(self, rows, seeds)
        seed = self.recipe.training.seed
        if seeds[0] in {grpo.generation_seed(seed, EVAL_GENERATION, j) for j in range(64)}:
            if seeds[0] == grpo.generation_seed(seed, EVAL_GENERATION, 0):  # an evaluation's first
                evaluations.append({})
            for prompt, completion in zip(out[0], out[1], strict=True):
                evaluations[-1].setdefault(tuple(prompt), []).append(completion)
        return out

    monkeypatch.setattr(grpo.Rollouts, "sample", sampled)
    result = train(load_recipe(path), progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    return (log, made, rewards, evaluations) if evaluating else (log, made, rewards)


def _trl(tmp_path, model_dir, made, rewards, lora, objective, learning_rate, monkeypatch, evaluations=None):
    """TRL's GRPOTrainer on the same prompts in order, fp32, its completions tiertune's; returns its log and
    the advantages of each of its generations. With ``evaluations`` (tiertune's completions of the held-out
    prompts, an evaluation's each), it evaluates them as tiertune does, the whole set one batch."""
    import trl.trainer.grpo_trainer as trl_grpo
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    # TRL shuffles a generation's completions before cutting it into micro-batches; tiertune keeps their order
    monkeypatch.setattr(trl_grpo, "shuffle_sequence_dict", lambda batch: batch)
    objective = dict(
        objective
    )  # its reward functions are the trainer's (a model's: its path, as TRL takes it)
    names = objective.pop("reward_funcs", [f"{rewards}:cats", f"{rewards}:length"])
    weights = objective.pop("reward_weights", [1.0, 0.5])
    funcs = [grpo.reward_function(name) if ":" in name else name for name in names]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calls = iter(made)

    held_out = iter(evaluations or [])

    def rollout(prompts, trainer):
        if not trainer.model.training:  # an evaluation: tiertune's completions of each prompt, in turn
            theirs = {k: list(v) for k, v in next(held_out).items()}
            prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
            completion_ids = [theirs[tuple(ids)].pop(0) for ids in prompt_ids]
            return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
        prompt_ids, completion_ids, _ = next(calls)
        assert [tokenizer(p)["input_ids"] for p in prompts] == prompt_ids  # the prompts tiertune sampled
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    seen = []
    score = GRPOTrainer._generate_and_score_completions

    def scored(self, inputs):
        out = score(self, inputs)
        seen.append(out["advantages"].clone())
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", scored)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=ACCUM,
        num_generations=GENERATIONS,
        max_completion_length=LENGTH,
        learning_rate=learning_rate,
        max_steps=STEPS,
        reward_weights=weights,
        **TRL_AS_TIERTUNE,
        shuffle_dataset=False,
        **objective,
        **(
            {
                "eval_strategy": "steps",
                "eval_steps": EVAL_STEPS,
                "eval_on_start": True,
                "num_generations_eval": EVAL_GENERATIONS,
                "per_device_eval_batch_size": len(EVAL_PROMPTS) * EVAL_GENERATIONS,  # the set, one batch
            }
            if evaluations
            else {}
        ),
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=Dataset.from_list(PROMPTS),
        eval_dataset=Dataset.from_list(EVAL_PROMPTS) if evaluations else None,
        processing_class=tokenizer,
        peft_config=trl_lora() if lora else None,
        rollout_func=rollout,
    )
    if lora:  # the adapters initialized as tiertune initializes its own
        seed_lora(trainer.model, LORA["lora"]["seed"])
    trainer.train()
    if evaluations:
        return [h for h in trainer.state.log_history if "eval_loss" in h]
    return [h for h in trainer.state.log_history if "loss" in h], seen


CASES = [
    # (method, loss_type, beta, num_iterations, learning rate, temperature: the log-probabilities' as well, and
    # other settings)
    ("lora", "dapo", 0.0, 1, 2e-2, 1.0, {}),
    ("lora", "grpo", 0.04, 2, 2e-2, 0.7, {}),
    ("lora", "dr_grpo", 0.04, 1, 2e-2, 1.0, {}),
    ("full", "dapo", 0.0, 2, 3e-3, 1.0, {}),
    ("full", "grpo", 0.04, 2, 3e-3, 1.5, {}),  # the reference: the initial weights beside the policy
    ("full", "dr_grpo", 0.04, 1, 3e-3, 1.0, {}),
    ("lora", "cispo", 0.0, 2, 2e-2, 1.0, {"epsilon_high": 1.02}),  # MiniMax-M1's, a bound the weights cross
    ("full", "sapo", 0.04, 2, 3e-3, 1.0, {}),
    ("lora", "grpo", 0.0, 2, 2e-2, 1.0, {"importance_sampling_level": "sequence"}),  # GSPO
    ("full", "luspo", 0.0, 2, 3e-3, 1.0, {"importance_sampling_level": "sequence"}),
    ("lora", "dapo", 0.04, 2, 2e-2, 1.0, {"delta": 1.25}),  # INTELLECT-2's two-sided clip
    ("lora", "dapo", 0.0, 1, 2e-2, 1.0, {"multi_objective_aggregation": "normalize_then_sum"}),  # GDPO
    ("full", "grpo", 0.04, 2, 3e-3, 1.0, {"top_entropy_quantile": 0.3}),  # the highest-entropy tokens
    # a generation of 16 completions feeding two steps (the second's old policy: a pass at generation time)
    ("lora", "dapo", 0.0, 1, 2e-2, 1.0, {"steps_per_generation": 4}),
    ("full", "grpo", 0.04, 2, 3e-3, 1.0, {"steps_per_generation": 4}),
]


@pytest.mark.parametrize(
    ("method", "loss_type", "beta", "iterations", "lr", "temperature", "extra"),
    CASES,
    ids=[
        "-".join([str(c[0]), str(c[1]), f"beta{c[2]}", f"it{c[3]}", f"t{c[5]}", *map(str, c[6].values())])
        for c in CASES
    ],
)
def test_grpo_steps_equal_trls(
    model_dir,
    tmp_path,
    write_recipe,
    monkeypatch,
    method,
    loss_type,
    beta,
    iterations,
    lr,
    temperature,
    extra,
):
    objective = {
        "loss_type": loss_type,
        "beta": beta,
        "num_iterations": iterations,
        "temperature": temperature,
        **extra,
    }
    lora = method == "lora"
    ours, made, rewards = _ours(
        tmp_path, write_recipe, model_dir, LORA if lora else {"type": "full"}, objective, lr, monkeypatch
    )
    theirs, advantages = _trl(tmp_path, model_dir, made, rewards, lora, objective, lr, monkeypatch)
    spans = extra.get("steps_per_generation", ACCUM) // ACCUM  # the steps a generation feeds
    assert len(made) == len(advantages) == -(-STEPS // (iterations * spans))
    for (_, _, mine), ref in zip(made, advantages, strict=True):
        torch.testing.assert_close(mine, ref.float(), rtol=1e-5, atol=1e-6)
    assert len(ours) == len(theirs) == STEPS
    clip = ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"]
    keys = ["loss", "entropy", *{"cispo": ["cispo_clip_ratio"], "sapo": []}.get(loss_type, clip)]
    keys += ["kl"] if beta else []
    for mine, ref in zip(ours, theirs, strict=True):
        for key in keys:
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, mine["step"], mine, ref)
        if "reward" in ref:  # logged by the steps that sampled
            for key in (
                "reward",
                "reward_std",
                "rewards/cats/mean",
                "rewards/length/mean",
                "frac_reward_zero_std",
            ):
                assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, mine["step"])
            for key in ("completions/mean_length", "completions/clipped_ratio"):
                assert mine[key] == pytest.approx(ref[key]), key
    assert any(m["loss"] != 0 for m in ours)
    if iterations > 1:  # a generation's second step moved its policy off the one that sampled it
        clipped = {"cispo": "cispo_clip_ratio", "sapo": "loss"}.get(loss_type, "clip_ratio/region_mean")
        assert any(m[clipped] > 0 for m in ours) or ours[1]["loss"] != ours[0]["loss"]


EVAL_CASES = [
    # (method, loss_type, beta, other settings): the reference, with beta, the base without its adapters or the
    # initial weights
    ("lora", "dapo", 0.0, {}),
    ("lora", "grpo", 0.04, {}),
    ("full", "dr_grpo", 0.04, {}),
    ("lora", "bnpo", 0.0, {"top_entropy_quantile": 0.4}),  # the set's highest-entropy tokens, as TRL's batch
]


@pytest.mark.parametrize(("method", "loss_type", "beta", "extra"), EVAL_CASES)
def test_grpo_evaluations_equal_trls(
    model_dir, tmp_path, write_recipe, monkeypatch, method, loss_type, beta, extra
):
    """Before the first step, after the second and the last, the held-out prompts' completions (3 of each) score
    as TRL's ``evaluate`` scores them on the same weights: the loss at the ratio 1, the rewards, the KL to the
    reference."""
    objective = {"loss_type": loss_type, "beta": beta, "num_iterations": 1, "temperature": 0.8, **extra}
    lora = method == "lora"
    lr = 2e-2 if lora else 3e-3
    ours, made, rewards, evaluations = _ours(
        tmp_path,
        write_recipe,
        model_dir,
        LORA if lora else {"type": "full"},
        objective,
        lr,
        monkeypatch,
        True,
    )
    mine = [r for r in ours if "eval_loss" in r]
    assert [r["step"] for r in mine] == [0, EVAL_STEPS, STEPS]  # on start, every 2 steps, after the last
    assert len(evaluations) == 3
    for held in evaluations:  # every held-out prompt, EVAL_GENERATIONS times
        assert sorted(len(v) for v in held.values()) == [EVAL_GENERATIONS] * len(EVAL_PROMPTS)
    theirs = _trl(tmp_path, model_dir, made, rewards, lora, objective, lr, monkeypatch, evaluations)
    assert [r["step"] for r in theirs] == [0, EVAL_STEPS, STEPS]
    keys = [
        "eval_loss",
        "eval_reward",
        "eval_reward_std",
        "eval_frac_reward_zero_std",
        "eval_rewards/cats/mean",
        "eval_rewards/cats/std",
        "eval_rewards/length/mean",
        "eval_completions/mean_length",
        "eval_completions/clipped_ratio",
        "eval_clip_ratio/region_mean",
        "eval_entropy",
    ]
    keys += ["eval_kl"] if beta else []
    for a, b in zip(mine, theirs, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (key, a["step"], a, b)
    if beta:  # the weights moved from the reference between the evaluations
        assert mine[0]["eval_kl"] == pytest.approx(0.0, abs=1e-7) and mine[-1]["eval_kl"] > 1e-6
    # the same seeds each evaluation: what differs is the weights (the first completions alike or not)
    assert mine[0]["eval_reward"] != mine[-1]["eval_reward"] or mine[0]["eval_loss"] != mine[-1]["eval_loss"]


@pytest.fixture(scope="module")
def reward_model(model_dir, tmp_path_factory):
    """A random sequence-classification model of the cat model's shape, its tokenizer beside it."""
    import shutil

    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    torch.manual_seed(7)
    model = AutoModelForSequenceClassification.from_config(config).float()
    out = tmp_path_factory.mktemp("reward") / "cat-rm"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_reward_model_scores_as_trls(model_dir, reward_model, tmp_path, write_recipe, monkeypatch, method):
    """A reward model among the reward functions (TRL's reward_funcs entry that names a model): its rewards,
    named by its directory, and the steps over them are TRL's."""
    rewards = tmp_path / "rewards.py"
    objective = {
        "loss_type": "dapo",
        "beta": 0.0,
        "num_iterations": 1,
        "temperature": 1.0,
        "reward_funcs": [f"{rewards}:cats", str(reward_model)],
        "reward_weights": [1.0, 0.7],
    }
    lora = method == "lora"
    lr = 2e-2 if lora else 3e-3
    ours, made, _ = _ours(
        tmp_path, write_recipe, model_dir, LORA if lora else {"type": "full"}, objective, lr, monkeypatch
    )
    theirs, advantages = _trl(tmp_path, model_dir, made, rewards, lora, objective, lr, monkeypatch)
    for (_, _, mine), ref in zip(made, advantages, strict=True):
        torch.testing.assert_close(mine, ref.float(), rtol=1e-5, atol=1e-6)
    for mine, ref in zip(ours, theirs, strict=True):
        for key in ("loss", "reward", "reward_std", "rewards/cat-rm/mean", "rewards/cat-rm/std"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, mine["step"])
    assert ours[0]["rewards/cat-rm/std"] > 0  # the model scores the completions apart
