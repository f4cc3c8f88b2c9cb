"""Preference tuning (``objective``, ``data.format: preference``) against TRL 1.16's DPOTrainer with peft: the
tokenization, and every step's loss and reward margin of a LoRA DPO run with the base on disk."""

import json
import math

import pytest
import torch
from parity import TRL_AS_TIERTUNE, seed_lora, trl_lora

from tests.conftest import CAT_PAIRS
from tiertune.config.recipe import load_recipe
from tiertune.engine import replay as replaying
from tiertune.errors import ConfigError, DataError
from tiertune.finetune.data import batches, load_data
from tiertune.finetune.train import train

PAIRS = CAT_PAIRS
LORA = {
    "type": "lora",
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear", "seed": 3},
}


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2, hidden=64)


def _rows(tmp_path, rows=PAIRS):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _trl(model_dir, tmp_path, loss_type, steps, lora_seed=None, learning_rate=1e-3):
    """TRL's DPOTrainer on the same data, in file order, fp32: with peft LoRA, its adapters initialized as
    tiertune initializes its own (peft's init, seeded by method.lora.seed), or (``lora_seed`` None) a full
    fine-tune against a frozen copy of the initial model."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=learning_rate,
        max_steps=steps,
        beta=0.1,
        loss_type=[loss_type],
        max_length=32,
        **TRL_AS_TIERTUNE,
    )
    trainer = InOrder(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=_tokenizer(model_dir),
        peft_config=None if lora_seed is None else trl_lora(),
    )
    if lora_seed is not None:
        seed_lora(trainer.model, lora_seed)
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h and "rewards/margins" in h]


def test_preference_rows_are_tokenized_as_trls_dpo_trainer(model_dir, tmp_path):
    """Prompt and completion split, EOS appended, cut from the start: the ids TRL's DPOTrainer trains on."""
    trainer, _ = _trl(model_dir, tmp_path, "sigmoid", 1)
    ours = load_data(_rows(tmp_path), _tokenizer(model_dir), "preference", 32).rows
    assert len(ours) == len(PAIRS)
    for row, theirs in zip(ours, trainer.train_dataset):
        prompt = theirs["prompt_ids"]
        assert row["input_ids"] == prompt + theirs["chosen_ids"]
        assert row["rejected_ids"] == prompt + theirs["rejected_ids"]
        assert row["labels"] == [-100] * len(prompt) + theirs["chosen_ids"]
        assert row["rejected_labels"] == [-100] * len(prompt) + theirs["rejected_ids"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_lora_dpo_follows_trl_and_peft_with_the_base_on_disk(model_dir, tmp_path, write_recipe, loss_type):
    """Each step's loss and reward margin equal TRL + peft's (relative 1e-4); the reference is the base with
    the adapters off, run in the same layer visits as the policy: step 1's policy is the reference (LoRA's B
    starts at zero), so its sigmoid loss is ln 2 and its margins 0."""
    steps = 4
    path = write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(_rows(tmp_path)), "format": "preference", "shuffle": False},
        method=LORA,
        objective={"type": "dpo", "beta": 0.1, "loss_type": loss_type},
        training={
            "max_steps": steps,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-3,
        },
        offload={"params": "disk", "device_budget": "2MiB", "host_budget": "1MiB"},
    )
    result = train(load_recipe(path), progress=False)
    ours = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    _, theirs = _trl(model_dir, tmp_path, loss_type, steps, LORA["lora"]["seed"])
    assert len(ours) == len(theirs) == steps
    if loss_type == "sigmoid":
        assert ours[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert ours[0]["rewards/margins"] == 0.0
    for mine, ref in zip(ours, theirs):
        for key in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, mine["step"], mine, ref)
    assert ours[-1]["rewards/margins"] != 0.0  # the adapters moved the policy away from the reference


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_full_dpo_follows_trl_with_params_and_states_on_disk(model_dir, tmp_path, write_recipe, loss_type):
    """A full fine-tune's reference is its initial weights: their log-probabilities come from one streamed pass
    before the first step (TRL keeps a frozen copy of the model and runs it each step). Each step's loss and
    reward margin equal TRL's (relative 1e-4) with the weights and Adam states on disk under small budgets; a
    second run reads the cached figures instead of computing them again."""
    steps = 4
    path = write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(_rows(tmp_path)), "format": "preference", "shuffle": False},
        objective={"type": "dpo", "beta": 0.1, "loss_type": loss_type},
        training={
            "max_steps": steps,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-4,
        },
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "1MiB",
            "host_budget": "1MiB",
        },
    )
    recipe = load_recipe(path)
    result = train(recipe, progress=False)
    ours = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    _, theirs = _trl(model_dir, tmp_path, loss_type, steps, learning_rate=1e-4)
    assert len(ours) == len(theirs) == steps
    for mine, ref in zip(ours, theirs):
        for key in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, mine["step"], mine, ref)
    assert ours[-1]["rewards/margins"] > 0

    from tiertune.engine.trainer import StreamedTrainer

    def refuse(*_):
        raise AssertionError("the cached reference was computed again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StreamedTrainer, "sequence_logps", refuse)
        again = train(load_recipe(path, ["training.output_dir=" + str(tmp_path / "again")]), progress=False)
    assert [json.loads(line)["loss"] for line in again.log_path.read_text().splitlines()] == [
        r["loss"] for r in ours
    ]


def _trl_reference_free(model_dir, tmp_path, objective, steps):
    """TRL's CPOTrainer (``loss_type: simpo``) or ORPOTrainer, a full fine-tune on the same data in file order."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    config, trainer = (CPOConfig, CPOTrainer) if objective == "simpo" else (ORPOConfig, ORPOTrainer)
    extra = {"loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 1.0} if objective == "simpo" else {}

    class InOrder(trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = config(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-4,
        max_steps=steps,
        beta=0.1,
        max_length=32,
        **TRL_AS_TIERTUNE,
        **extra,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    run = InOrder(
        model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=_tokenizer(model_dir)
    )
    run.train()
    return [h for h in run.state.log_history if "loss" in h and "rewards/margins" in h]


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_simpo_and_orpo_follow_trl_with_params_and_states_on_disk(
    model_dir, tmp_path, write_recipe, objective
):
    """SimPO (TRL's CPOTrainer, loss_type simpo, its cross-entropy term on) and ORPO (its cross-entropy on the
    whole chosen sequence, prompt included): no reference. Each step's loss, reward margin and cross-entropy
    term equal TRL's (relative 1e-4) with the weights and Adam states on disk under small budgets."""
    steps = 4
    path = write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(_rows(tmp_path)), "format": "preference", "shuffle": False},
        objective={"type": objective, "beta": 0.1},
        training={
            "max_steps": steps,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-4,
        },
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "1MiB",
            "host_budget": "1MiB",
        },
    )
    ours = [
        json.loads(line)
        for line in train(load_recipe(path), progress=False).log_path.read_text().splitlines()
    ]
    theirs = _trl_reference_free(model_dir, tmp_path, objective, steps)
    assert len(ours) == len(theirs) == steps
    keys = ["loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logps/rejected", "nll_loss"]
    keys += ["log_odds_ratio", "log_odds_chosen"] if objective == "orpo" else []
    for mine, ref in zip(ours, theirs):
        for key in keys:
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, mine["step"], mine, ref)


def test_a_batch_of_pairs_is_its_chosen_rows_then_its_rejected(model_dir, tmp_path):
    data = load_data(_rows(tmp_path), _tokenizer(model_dir), "preference", 32)
    batch = next(batches(data, 3, 0, shuffle=False, seed=0))
    assert int(batch["pairs"]) == 3 and batch["input_ids"].shape[0] == 6
    rows = data.rows
    for r in range(3):
        n, m = len(rows[r]["input_ids"]), len(rows[r]["rejected_ids"])
        assert batch["input_ids"][r, :n].tolist() == rows[r]["input_ids"]
        assert batch["input_ids"][3 + r, :m].tolist() == rows[r]["rejected_ids"]
        assert batch["attention_mask"][3 + r].sum() == m


def test_bad_preference_rows_are_named_skipped_or_dropped(model_dir, tmp_path):
    tok = _tokenizer(model_dir)
    missing = [*PAIRS[:2], {"prompt": "the red cat", "chosen": " sat"}]
    with pytest.raises(DataError, match=r"row 3: expected a string field 'rejected'"):
        load_data(_rows(tmp_path, missing), tok, "preference", 32)
    assert load_data(_rows(tmp_path, missing), tok, "preference", 32, skip_bad_rows=True).skipped == 1
    empty = [*PAIRS[:2], {"prompt": "the red cat", "chosen": " sat", "rejected": "  "}]
    with pytest.raises(DataError, match="row 3: expected non-empty strings 'chosen' and 'rejected'"):
        load_data(_rows(tmp_path, empty), tok, "preference", 32)
    same = [{**p, "rejected": p["chosen"]} for p in PAIRS]
    with pytest.raises(DataError, match="a chosen completion equal to the rejected one"):
        load_data(_rows(tmp_path, same), tok, "preference", 32)
    long_prompt = [
        {"prompt": "the red cat", "chosen": " sat", "rejected": " mat"},
        {"prompt": "the old cat", "chosen": " mat", "rejected": " sat"},
        {"prompt": "the red cat sat on the mat", "chosen": " sat", "rejected": " mat"},
    ]
    data = load_data(_rows(tmp_path, long_prompt), tok, "preference", 5)  # the last prompt fills max_seq_len
    assert (len(data), data.dropped) == (2, 1)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"objective": {"type": "dpo"}}, "dpo trains on pairs: set data.format: preference"),
        ({"data": {"format": "preference"}}, "data.format: preference needs objective.type: dpo"),
        (
            {"objective": {"type": "dpo", "beta": 0}, "data": {"format": "preference"}, "method": LORA},
            "objective.beta must be > 0",
        ),
        (
            {
                "objective": {"type": "dpo", "loss_type": "sigmod"},
                "data": {"format": "preference"},
                "method": LORA,
            },
            "objective.loss_type must be one of sigmoid, ipo, hinge",
        ),
        (
            {"objective": {"type": "dpo"}, "data": {"format": "preference", "packing": True}, "method": LORA},
            "data.packing must be false for a preference objective",
        ),
        (
            {"objective": {"type": "kto"}, "data": {"format": "preference"}},
            "set data.format: unpaired_preference",
        ),
        (
            {"data": {"format": "unpaired_preference"}},
            "data.format: unpaired_preference needs objective.type: kto",
        ),
        (
            {
                "objective": {"type": "kto"},
                "data": {"format": "unpaired_preference"},
                "training": {"per_device_train_batch_size": 1},
            },
            "must be >= 2 for kto",
        ),
    ],
)
def test_a_preference_recipe_that_cannot_run_says_what_to_change(
    model_dir, tmp_path, write_recipe, sections, message
):
    with pytest.raises(ConfigError, match=message):
        load_recipe(write_recipe(tmp_path, model_dir, **sections))


def test_conversational_pairs_are_tokenized_with_trls_own_functions(tmp_path):
    """Conversations (a prompt given, or shared leading turns) through the chat template: the ids TRL's
    DPOTrainer computes with its own helpers (``extract_prompt``, ``_tokenize``, ``common_prefix_length``)."""
    from trl.data_utils import _tokenize, common_prefix_length, extract_prompt

    from tests.finetune.test_data import CHAT_TEMPLATE, WORDS
    from tiertune.cli.demo import make_tokenizer

    tok = make_tokenizer(WORDS, tmp_path)
    tok.chat_template = CHAT_TEMPLATE
    user = [{"role": "user", "content": "name a color"}]
    rows = [
        {
            "prompt": user,
            "chosen": [{"role": "assistant", "content": "blue is a color"}],
            "rejected": [{"role": "assistant", "content": "hi there"}],
        },
        {
            "chosen": [*user, {"role": "assistant", "content": "blue"}],
            "rejected": [*user, {"role": "assistant", "content": "a dog ran far away"}],
        },
    ]
    ours = load_data(_rows(tmp_path, rows), tok, "preference", 64).rows
    for row, given in zip(ours, rows):
        given = given if "prompt" in given else extract_prompt(given)
        prompt = _tokenize(tok, given["prompt"], add_generation_prompt=True)["input_ids"]
        pair = [_tokenize(tok, given["prompt"] + given[k])["input_ids"] for k in ("chosen", "rejected")]
        start = min(common_prefix_length(prompt, ids) for ids in pair)
        assert row["input_ids"] == pair[0] and row["rejected_ids"] == pair[1]
        assert row["labels"] == [-100] * start + pair[0][start:]
        assert row["rejected_labels"] == [-100] * start + pair[1][start:]
        assert start > 0 and start < len(pair[0])


@pytest.mark.parametrize(
    ("method", "activations"), [("lora", "device"), ("lora", "host"), ("full", "device")]
)
def test_a_dpo_steps_peaks_and_bytes_are_the_estimates_and_its_weights_cross_once(
    cat_model, tmp_path, write_recipe, monkeypatch, method, activations
):
    """A DPO run whose weights stream every step (a 1 MiB device budget; LoRA's base from disk under a 1 MiB host
    budget, a full fine-tune's from the host, its states on disk, under 64 MiB): every tier's peak is the replay of
    the run's own steps (clipped or not) to the byte, and not above the estimate's, but for a full fine-tune whose
    steps all clip (its first step's, within two staged chunks), and its last step moves the bytes that replay
    moves. The reference shares the
    policy's layer visits: with the boundaries on the device a step moves exactly what an SFT step of as many
    micro-batches moves (the base read once); on the host a pair's boundaries are two rows', and where the host
    budget holds fewer micro-batches' boundaries the step runs in more waves (each reading the base once)."""
    from tiertune.estimates.report import estimate

    model = cat_model(4, hidden=128)
    moved = {}
    for objective in ("dpo", "sft"):
        run = tmp_path / objective
        run.mkdir()
        data = {"path": str(_rows(run)), "format": "preference"} if objective == "dpo" else {}
        placement = {"params": "disk"} if method == "lora" else {"params": "disk", "optimizer_states": "disk"}
        path = write_recipe(
            run,
            model,
            data=data,
            method=LORA if method == "lora" else {"type": "full"},
            objective={"type": objective},
            training={"max_steps": 3, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4},
            offload={
                **placement,
                "activations": activations,
                "device_budget": "1MiB",
                "host_budget": "1MiB" if method == "lora" else "64MiB",
            },
        )
        recipe = load_recipe(path)
        default = estimate(recipe, measure=False)
        log = [json.loads(line) for line in train(recipe, progress=False).log_path.read_text().splitlines()]
        # a step after a clipped one updates in place (no twins): the run's peaks are its own steps'
        clipped = tuple(r["grad_norm"] > recipe.training.max_grad_norm for r in log if "grad_norm" in r)
        monkeypatch.setattr(replaying, "CLIPPED", clipped)
        predicted = estimate(recipe, measure=False)
        for tier, peak in log[-1]["peak_bytes"].items():
            expected = predicted.tiers[tier]
            if tier == "host" and method == "full" and all(clipped):
                # every step clipped, each after the first in place: the peak is the first step's, speculated and
                # redone, whose units run as the worker's thread keeps up (seen: 13.17 and 14.32 MB in two runs,
                # the replay 14.31 MB): within two staged chunks of it
                assert abs(peak - expected.peak) <= 2 * expected.largest_staged, (tier, peak, expected)
            else:
                assert peak == expected.peak <= default.tiers[tier].peak, (tier, peak, predicted.tiers)
        before, after = log[-2]["bytes_moved"], log[-1]["bytes_moved"]
        moved[objective] = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
        replayed = {k: v for k, v in predicted.moved_per_step.items() if v}
        assert moved[objective].keys() == replayed.keys()
        for link, measured in moved[objective].items():  # a full fine-tune's optimizer thread times some (2%)
            assert abs(replayed[link] - measured) <= (0 if method == "lora" else 0.02 * measured), (
                link,
                moved,
            )
    # the weights, read once a step by both (a full fine-tune's reference came first)
    if activations == "device":
        assert moved["dpo"].keys() == moved["sft"].keys() and moved["dpo"]["host->device"] > 0
        for link, sft in moved["sft"].items():  # a full fine-tune's: within the optimizer thread's few KiB
            assert abs(moved["dpo"][link] - sft) <= (0 if method == "lora" else 0.01 * sft), (link, moved)
    else:  # a pair's boundaries are two rows': twice the traffic, and under this host budget twice the waves
        assert moved["dpo"]["device->host"] == 2 * moved["sft"]["device->host"] > 0


@pytest.mark.parametrize("method", ["lora", "full"])
def test_an_interrupted_dpo_run_resumes_exactly(model_dir, tmp_path, write_recipe, interrupted_after, method):
    """Interrupted after step 3 (checkpoints every 2 steps, shuffled pairs), resumed: the later steps' losses and
    margins are the uninterrupted run's. A full fine-tune's reference is computed again when its cache is gone:
    from the model's own files, before the checkpoint is restored, so the figures are the initial weights'."""
    from tiertune.finetune.reference import CACHE_DIR

    def recipe(name):
        return load_recipe(
            write_recipe(
                tmp_path / name,
                model_dir,
                data={"path": str(_rows(tmp_path)), "format": "preference", "shuffle": True},
                method=LORA if method == "lora" else {"type": "full"},
                objective={"type": "dpo"},
                training={
                    "max_steps": 6,
                    "per_device_train_batch_size": 2,
                    "gradient_accumulation_steps": 2,
                    "learning_rate": 1e-3 if method == "lora" else 1e-4,
                    "save_steps": 2,
                },
                offload={
                    "params": "disk",
                    "optimizer_states": "disk",
                    "device_budget": "2MiB",
                    "host_budget": "2MiB",
                },
            )
        )

    for name in ("whole", "cut"):
        (tmp_path / name).mkdir()
    whole = [
        json.loads(line) for line in train(recipe("whole"), progress=False).log_path.read_text().splitlines()
    ]
    cut = recipe("cut")
    with interrupted_after(3), pytest.raises(KeyboardInterrupt):
        train(cut, progress=False)
    if method == "full":
        cache = tmp_path / "cut" / "nvme" / CACHE_DIR
        assert len(list(cache.glob("*.safetensors"))) == 1
        for path in cache.iterdir():
            path.unlink()
    resumed = train(
        load_recipe(tmp_path / "cut" / "recipe.yaml", ["training.resume_from_checkpoint=auto"]),
        progress=False,
    )
    assert resumed.first_step == 3
    again = [json.loads(line) for line in resumed.log_path.read_text().splitlines()]
    assert [r["step"] for r in again] == list(range(1, 7))
    for mine, ref in zip(again[2:], whole[2:]):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), (key, mine["step"])


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [*PAIRS[:2], {"prompt": "the red cat", "chosen": " sat"}],
            "row 3: expected a string field 'rejected'",
        ),
        ([{**p, "rejected": p["chosen"]} for p in PAIRS], "a chosen completion equal to the rejected one"),
    ],
)
def test_bad_preference_data_exits_2_with_one_line(model_dir, tmp_path, write_recipe, rows, message):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    path = write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(_rows(tmp_path, rows)), "format": "preference"},
        method=LORA,
        objective={"type": "dpo"},
    )
    result = CliRunner().invoke(app, ["train", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


UNPAIRED = [
    {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
    for p in PAIRS
    for k in ("chosen", "rejected")
]


def _trl_kto(model_dir, tmp_path, steps, lora_seed=None, learning_rate=1e-4):
    """TRL's KTOTrainer (sequential sampling, as its KL term requires), full or (``lora_seed``) with peft LoRA
    initialized as tiertune's."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    args = KTOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=learning_rate,
        max_steps=steps,
        beta=0.1,
        max_length=32,
        **TRL_AS_TIERTUNE,
        train_sampling_strategy="sequential",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = KTOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(UNPAIRED),
        processing_class=_tokenizer(model_dir),
        peft_config=None if lora_seed is None else trl_lora(),
    )
    if lora_seed is not None:
        seed_lora(trainer.model, lora_seed)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h and "kl" in h]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_kto_follows_trl(model_dir, tmp_path, write_recipe, method):
    """KTO on unpaired rows (prompt, completion, label): each row's KL sequence is its prompt and its block
    mate's completion (TRL's rotation); the reference runs in the same layer visits (LoRA) or before training
    (full, params and states on disk). Each step's loss, KL estimate, rewards and log-probabilities equal TRL's
    KTOTrainer's (relative 1e-4)."""
    steps = 4
    data = tmp_path / "unpaired.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in UNPAIRED))
    lr = 1e-3 if method == "lora" else 1e-4
    path = write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(data), "format": "unpaired_preference", "shuffle": False},
        method=LORA if method == "lora" else {"type": "full"},
        objective={"type": "kto", "beta": 0.1},
        training={
            "max_steps": steps,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": lr,
        },
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "2MiB",
            "host_budget": "2MiB",
        },
    )
    ours = [
        json.loads(line)
        for line in train(load_recipe(path), progress=False).log_path.read_text().splitlines()
    ]
    theirs = _trl_kto(model_dir, tmp_path, steps, LORA["lora"]["seed"] if method == "lora" else None, lr)
    assert len(ours) == len(theirs) == steps
    for mine, ref in zip(ours, theirs):
        for key in (
            "loss",
            "kl",
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ):
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (key, mine["step"], mine, ref)
    assert ours[-1]["rewards/margins"] > 0


def _trl_evaluate(model, ref_model, model_dir, tmp_path, objective):
    """TRL's DPOTrainer (CPOTrainer for SimPO, ORPOTrainer for ORPO) evaluating ``model`` on the held-out pairs
    in one batch (its metrics are then the means over the pairs, as tiertune's)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    kind = objective["type"]
    config, trainer_class = {
        "dpo": (DPOConfig, DPOTrainer),
        "simpo": (CPOConfig, CPOTrainer),
        "orpo": (ORPOConfig, ORPOTrainer),
    }[kind]
    extra = {"loss_type": [objective.get("loss_type", "sigmoid")]} if kind == "dpo" else {}
    if kind == "simpo":
        extra = {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5}
    args = config(
        output_dir=str(tmp_path / f"trl-eval-{kind}"),
        per_device_eval_batch_size=len(HELD_OUT),
        beta=objective["beta"],
        max_length=32,
        **extra,
        **TRL_AS_TIERTUNE,
    )
    kwargs = {"ref_model": ref_model} if kind == "dpo" and ref_model is not None else {}
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(PAIRS),
        eval_dataset=Dataset.from_list(HELD_OUT),
        processing_class=_tokenizer(model_dir),
        **kwargs,
    )
    return trainer.evaluate()


def _evaluated_again(result, held_out, ours, keys):
    """``tiertune evaluate --json`` of the run on ``held_out``: its figures ``keys`` are the run's logged ones."""
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    said = CliRunner().invoke(app, ["evaluate", str(result.output_dir), str(held_out), "--json"])
    assert said.exit_code == 0, said.output
    again = json.loads(said.output.strip().splitlines()[-1])
    for key in keys:
        assert again[key] == pytest.approx(ours[key], rel=1e-6, abs=1e-9), key


def _exported(model_dir, result, method):
    """The run's exported model in fp32: the full model, or peft's adapter merged into the base (TRL given a
    PeftModel takes its adapter for a new one to train)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if method != "lora":
        return AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, result.output_dir).merge_and_unload()


HELD_OUT = [
    {"prompt": f"the {a} cat", "chosen": f" sat on the {b} mat .", "rejected": f" sat on {c}"}
    for a, b, c in [("wet", "red", "old"), ("blue", "big", "fat"), ("old", "old", "wet")]
]


@pytest.mark.parametrize(
    ("method", "objective"),
    [
        ("lora", {"type": "dpo", "beta": 0.1}),
        ("lora", {"type": "dpo", "beta": 0.1, "loss_type": "ipo"}),
        ("full", {"type": "dpo", "beta": 0.1}),
        ("full", {"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}),
        ("full", {"type": "orpo", "beta": 0.1}),
    ],
    ids=["lora-dpo", "lora-dpo-ipo", "full-dpo", "full-simpo", "full-orpo"],
)
def test_held_out_pairs_are_evaluated_as_trl_evaluates_them(
    model_dir, tmp_path, write_recipe, method, objective
):
    """After 3 steps the run's evaluation of held-out pairs is TRL's ``evaluate()`` of the exported model (peft's
    adapter merged into the base, or the full model) beside a frozen copy of the initial one, the reference
    (tiertune's with LoRA: the base, its adapter off): eval_loss and TRL's eval_rewards/* and eval_logps/*, rel
    1e-5."""
    from transformers import AutoModelForCausalLM

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT))
    data = {"path": str(_rows(tmp_path)), "format": "preference"}
    result, ours = _evaluated_run(tmp_path, write_recipe, model_dir, data, held_out, method, objective, 2)
    if method == "lora" or objective["type"] != "dpo":  # `tiertune evaluate` of the run: its own figures
        _evaluated_again(result, held_out, ours, ("eval_loss", "eval_rewards/margins", "eval_logps/rejected"))
    model = _exported(model_dir, result, method)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # the initial weights
    theirs = _trl_evaluate(model, ref_model, model_dir, tmp_path, objective)
    keys = [
        "eval_loss",
        "eval_rewards/chosen",
        "eval_rewards/margins",
        "eval_logps/chosen",
        "eval_logps/rejected",
    ]
    if objective["type"] == "dpo":
        assert ours["eval_rewards/margins"] != 0.0  # the policy moved off its reference
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (key, ours, theirs)


def _evaluated_run(tmp_path, write_recipe, model_dir, data, held_out, method, objective, batch):
    """3 steps of ``objective`` over ``data`` (LoRA or full), batches of ``batch``, evaluating ``held_out`` after the
    third; returns the run's result and its evaluation's record."""
    path = write_recipe(
        tmp_path,
        model_dir,
        data={**data, "shuffle": False, "eval_path": str(held_out)},
        method=LORA if method == "lora" else {"type": "full"},
        objective=objective,
        training={
            "max_steps": 3,
            "per_device_train_batch_size": batch,
            "learning_rate": 1e-2 if method == "lora" else 1e-3,
            "eval_strategy": "steps",
            "eval_steps": 3,
        },
        offload={"params": "disk", "device_budget": "2MiB", "host_budget": "1MiB"},
    )
    result = train(load_recipe(path), progress=False)
    (ours,) = result.evaluations
    return result, ours


HELD_OUT_UNPAIRED = [
    {"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
    for p in HELD_OUT
    for k in ("chosen", "rejected")
]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_held_out_kto_rows_are_evaluated_as_trl_evaluates_them(model_dir, tmp_path, write_recipe, method):
    """After 3 KTO steps the run's evaluation of held-out labelled rows is TRL's ``KTOTrainer.evaluate()`` of the
    exported model beside the initial one, batches of the training's size (each batch's KL sequences its own rows'
    completions, rotated: TRL's collator): eval_loss, eval_kl and TRL's eval_rewards/* and eval_logps/*, rel 1e-5."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    data, held_out = tmp_path / "unpaired.jsonl", tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in UNPAIRED))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT_UNPAIRED))
    rows = {"path": str(data), "format": "unpaired_preference"}
    kto = {"type": "kto", "beta": 0.1}
    # batches of 3: not the loader's default KL block of 2
    result, ours = _evaluated_run(tmp_path, write_recipe, model_dir, rows, held_out, method, kto, 3)
    if (
        method == "lora"
    ):  # `tiertune evaluate` of the run: its own figures (the set read with the run's KL block)
        _evaluated_again(result, held_out, ours, ("eval_loss", "eval_kl", "eval_rewards/margins"))
    model = _exported(model_dir, result, method)
    args = KTOConfig(
        output_dir=str(tmp_path / "trl-eval-kto"),
        per_device_train_batch_size=3,
        per_device_eval_batch_size=3,
        beta=0.1,
        max_length=32,
        **TRL_AS_TIERTUNE,
        train_sampling_strategy="sequential",
    )
    theirs = KTOTrainer(
        model=model,
        ref_model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        args=args,
        train_dataset=Dataset.from_list(UNPAIRED),
        eval_dataset=Dataset.from_list(HELD_OUT_UNPAIRED),
        processing_class=_tokenizer(model_dir),
    ).evaluate()
    assert ours["eval_rewards/margins"] != 0.0  # the policy moved off its reference
    keys = ["eval_loss", "eval_kl", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins"]
    for key in [*keys, "eval_logps/chosen", "eval_logps/rejected"]:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (key, ours, theirs)
