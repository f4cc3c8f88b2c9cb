"""Each rule on a run's settings is written once, where it belongs: a setting's own values in the recipe (a
recipe read from YAML and one built in Python alike), the store's sizes where the store's config resolves them,
the rules between settings in ``config.plan`` (which ``train`` and ``estimate`` both call), the budgets
against the run's memory plan in ``engine.memory``. This lists them, where each lives (its message, found once
in the package), and shows each one refusing a recipe that breaks it, naming the setting."""

from pathlib import Path

import pytest

from tiertune.errors import BudgetError, ConfigError

PACKAGE = Path(__file__).parents[1] / "tiertune"

# rule: (the module it lives in, a phrase of its message, overrides that break it, what the error names)
RULES = {
    "a setting with a fixed set of values holds one of them": (
        "config/recipe.py",
        "must be one of",
        ("method.type=qlora",),
        "method.type",
    ),
    "the learning rate is not negative": (
        "config/recipe.py",
        '"training.learning_rate", f"must be >= 0',
        ("training.learning_rate=-1",),
        "training.learning_rate",
    ),
    "a budget has a unit": (
        "offload/store.py",
        "has no unit",
        ("offload.host_budget=512",),
        "offload.host_budget",
    ),
    "the prefetch depth is not negative": (
        "offload/store.py",
        "prefetch_depth must be >= 0",
        ("offload.prefetch_depth=-1",),
        "offload.prefetch_depth",
    ),
    "a quantized base trains adapters": (
        "config/plan.py",
        "freezes the base",
        ("model.quantize=nf4", "method.type=full"),
        "method.type",
    ),
    "state on disk needs a disk path": (
        "config/plan.py",
        "is disk but offload.disk_path is not set",
        ("offload.disk_path=null", "offload.params=disk"),
        "offload.disk_path",
    ),
    "the run does not write over its model": (
        "config/plan.py",
        "the run would write over it",
        ("training.output_dir={model}",),
        "training.output_dir",
    ),
    "a delayed update is full fine-tuning's with fp32 master weights": (
        "config/plan.py",
        "offload.delay_update (a step's update during the next step",
        ("offload.delay_update=true", "method.type=lora"),
        "offload.delay_update",
    ),
    "bf16 master weights are full fine-tuning's in bf16": (
        "config/plan.py",
        "as their own master, stochastic rounding",
        ("training.master_weights=bfloat16", "model.dtype=float32"),
        "training.master_weights",
    ),
    "GaLore runs in one process": (
        "config/plan.py",
        "does not run sharded yet",
        ("method.type=galore",),
        "method.type: galore",
    ),
    "the budgets hold the run's memory plan": (
        "engine/memory.py",
        "The smallest budgets that work",
        ("offload.device_budget=64KiB",),
        "offload.device_budget",
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_lives_in_one_place(rule):
    module, phrase, _, _ = RULES[rule]
    found = [str(p.relative_to(PACKAGE)) for p in sorted(PACKAGE.rglob("*.py")) if phrase in p.read_text()]
    assert found == [module], (rule, found)


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_refuses_a_recipe_that_breaks_it_naming_the_setting(
    rule, tmp_path, cat_model, write_recipe, monkeypatch
):
    from tiertune.config.plan import resolve
    from tiertune.config.recipe import load_recipe
    from tiertune.distributed.world import World
    from tiertune.finetune.train import admit

    _, _, overrides, named = RULES[rule]
    model = cat_model(2)
    if rule == "GaLore runs in one process":  # a rank of a launch of two
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    path = write_recipe(tmp_path, model)
    with pytest.raises((ConfigError, BudgetError)) as refused:
        recipe = load_recipe(path, [o.format(model=model) for o in overrides])
        admit(resolve(recipe, World.from_env()))
    assert named in str(refused.value), (rule, str(refused.value))
