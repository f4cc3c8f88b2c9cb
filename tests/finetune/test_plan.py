"""The run's memory plan (``engine.memory``): a run either trains to the end or is refused before the model is
loaded, naming the smallest budgets that work; ``estimate`` gives the same answer; the store never has more
chunks of a size class in use on a tier than the plan reserved slots for."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import watching
from watching import check_in_use

from tiertune.config.recipe import load_recipe
from tiertune.errors import BudgetError
from tiertune.estimates.report import estimate
from tiertune.finetune.train import train
from tiertune.offload.tiers import Tier, slot_class

MiB = 1 << 20
# SmolLM2-135M-Instruct's shapes (its tied 49152 x 576 embedding is 108 MiB in fp32), two decoder layers
SMOL = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    num_hidden_layers=2,
)


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiertune.cli.demo import make_tokenizer

    directory = tmp_path_factory.mktemp("smol-shaped")
    texts = [
        f"the {a} cat sat on the {b} mat ."
        for a in ("red", "big", "old", "fat")
        for b in ("blue", "flat", "wet")
    ]
    tok = make_tokenizer(texts, directory)  # the texts write_recipe's data holds
    config = LlamaConfig(
        **SMOL, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


@pytest.fixture
def watch(monkeypatch):
    """What a run did (``watching.watch``)."""
    return watching.watch(monkeypatch.setattr)


def _smallest(message: str) -> dict[str, str]:
    named = re.search(
        r"smallest budgets that work: offload\.device_budget: (\d+MiB), offload\.host_budget: (\d+MiB)",
        message,
    )
    assert named, message
    return {"device": named.group(1), "host": named.group(2)}


def smol_recipe(tmp_path, smol_dir, write_recipe, device: str, host: str):
    path = write_recipe(
        tmp_path,
        smol_dir,
        training={"max_steps": 2, "per_device_train_batch_size": 2},
        offload={"params": "disk", "optimizer_states": "disk", "device_budget": device, "host_budget": host},
    )
    return load_recipe(path)


@pytest.mark.parametrize("device, host", [("128MiB", "256MiB"), ("128MiB", "512MiB"), ("128MiB", "1GiB")])
def test_the_tied_embedding_full_fine_tune_trains_or_is_refused_before_loading(
    tmp_path, smol_dir, write_recipe, watch, device, host
):
    # the budgets a user tried on SmolLM2-135M (states on disk): estimate said yes to all three, and each run
    # died minutes in (the host short of one optimizer unit's working set, then a fragmented arena, then the
    # device tier); now a run either trains to the end or stops before loading, naming budgets that work
    recipe = smol_recipe(tmp_path, smol_dir, write_recipe, device, host)
    est = estimate(recipe, measure=False)
    try:
        result = train(recipe, progress=False)
    except BudgetError as exc:
        assert not est.fits and not watch["loaded"]
        assert not (tmp_path / "run").exists()  # nothing of a run was made
        smallest = _smallest(str(exc))
        for tier in (Tier.DEVICE, Tier.HOST):  # estimate names the same needs
            assert smallest[tier.value] == f"{-(-est.plan.needed(tier) // MiB)}MiB"
            assert est.tiers[tier.value].needed == est.plan.needed(tier)
        return
    assert est.fits and watch["loaded"]
    steps = [json.loads(line).get("step") for line in result.log_path.read_text().splitlines()]
    assert 2 in steps
    check_in_use(watch)


def test_the_smallest_budgets_a_refusal_names_train_to_the_end(tmp_path, smol_dir, write_recipe, watch):
    recipe = smol_recipe(tmp_path, smol_dir, write_recipe, "128MiB", "256MiB")
    with pytest.raises(BudgetError) as refused:
        train(recipe, progress=False)
    smallest = _smallest(str(refused.value))
    recipe = smol_recipe(tmp_path, smol_dir, write_recipe, smallest["device"], smallest["host"])
    assert estimate(recipe, measure=False).fits
    result = train(recipe, progress=False)
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert records[-1]["step"] == 2
    check_in_use(watch)


def test_random_layouts_either_finish_or_are_refused_up_front(tmp_path, cat_model, write_recipe, watch):
    # random models, methods, homes and budgets around what the plan needs: every run that starts finishes
    rng = random.Random(27)
    outcomes = []
    for trial in range(24):
        model = cat_model(rng.choice([2, 3]), hidden=rng.choice([64, 128]))
        method = rng.choice(["full", "full", "lora"])
        overrides = [
            f"method.type={method}",
            f"model.dtype={rng.choice(['float32', 'bfloat16'])}",
            f"offload.params={rng.choice(['device', 'host', 'disk'])}",
            f"offload.optimizer_states={rng.choice(['device', 'host', 'disk'])}",
            f"offload.activations={rng.choice(['device', 'host'])}",
            f"training.max_grad_norm={rng.choice([0, 1.0])}",
            f"training.gradient_accumulation_steps={rng.choice([1, 2])}",
        ]
        (tmp_path / str(trial)).mkdir()
        path = write_recipe(tmp_path / str(trial), model, training={"max_steps": 2})
        roomy = estimate(
            load_recipe(path, [*overrides, "offload.device_budget=1GiB", "offload.host_budget=1GiB"]),
            measure=False,
        )
        budgets = {
            t: int(roomy.plan.needed(t) * rng.choice([0.8, 1.0, 1.0, 1.5])) for t in (Tier.DEVICE, Tier.HOST)
        }
        recipe = load_recipe(
            path,
            [
                *overrides,
                f"offload.device_budget={budgets[Tier.DEVICE]}B",
                f"offload.host_budget={budgets[Tier.HOST]}B",
            ],
        )
        est = estimate(recipe, measure=False)
        watch["loaded"] = False
        try:
            train(recipe, progress=False)
        except BudgetError as exc:
            assert not est.fits and not watch["loaded"], (overrides, budgets, exc)
            outcomes.append("refused")
            continue
        assert est.fits, (overrides, budgets)
        outcomes.append("trained")
    assert outcomes.count("trained") >= 8 and outcomes.count("refused") >= 3, outcomes
    check_in_use(watch)


def test_size_classes_give_each_chunk_the_smallest_slot_that_holds_it():
    from tiertune.engine.memory import size_classes

    sizes = size_classes([4096, 4096 * 5, 4096 * 6, 4096 * 100, 4096 * 124])
    # 5 and 6 pages share a class (within 1.25x), as do 100 and 124 pages
    assert sizes == [4096, 4096 * 6, 4096 * 124]
    assert slot_class(sizes, 4096 * 5) == 4096 * 6
    assert slot_class(sizes, 4096 * 7) == 4096 * 124
    assert slot_class(sizes, 4096 * 125) is None
