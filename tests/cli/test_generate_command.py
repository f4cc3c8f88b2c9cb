"""``tiertune generate`` (``finetune.generation``): a model directory's greedy completions are transformers'
``generate``'s, a LoRA run's are peft's over the same base (its adapter applied, not merged), sampling with a
seed repeats itself, and a call without prompts is told what to give."""

import pytest
import torch
from typer.testing import CliRunner

from tiertune.cli.app import app

PROMPTS = ["the red cat", "the old cat sat on the"]


def _theirs(model, tokenizer, prompts, new):
    """transformers' greedy ``generate`` of the left-padded batch, each completion decoded."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.eval().generate(
        **batch, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )[:, batch["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=True) for row in out]


def _generate(source, *extra):
    args = ["generate", str(source), *extra]
    for p in PROMPTS:
        args += ["--prompt", p]
    result = CliRunner().invoke(app, [*args, "--max-new-tokens", "8", "--quiet"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_a_models_greedy_completions_are_transformers_generate(cat_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cat_model(2, hidden=64)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    got = _generate(path, f"offload.disk_path={tmp_path / 'nvme'}", "model.dtype=float32")
    assert got == _theirs(model, tokenizer, PROMPTS, 8)


def test_a_lora_runs_completions_are_peft_over_its_base(cat_model, write_recipe, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiertune.finetune.train import train

    path = cat_model(2, hidden=64)
    recipe = write_recipe(
        tmp_path,
        path,
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        training={"max_steps": 6, "learning_rate": 3e-2, "save_steps": 0},
    )
    run = train(recipe, progress=False).output_dir
    base = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    theirs = _theirs(PeftModel.from_pretrained(base, run), tokenizer, PROMPTS, 8)
    assert _generate(run) == theirs
    plain = _theirs(
        AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32), tokenizer, PROMPTS, 8
    )
    assert theirs != plain  # the adapter changed what the model says


def test_a_full_runs_completions_are_its_exported_models(cat_model, write_recipe, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiertune.finetune.train import train

    recipe = write_recipe(tmp_path, cat_model(2, hidden=64), training={"max_steps": 3, "save_steps": 0})
    run = train(recipe, progress=False).output_dir
    model, tokenizer = AutoModelForCausalLM.from_pretrained(run), AutoTokenizer.from_pretrained(run)
    assert _generate(run) == _theirs(model, tokenizer, PROMPTS, 8)


def test_sampling_with_a_seed_repeats_itself(cat_model, tmp_path):
    path = cat_model(2, hidden=64)
    where = f"offload.disk_path={tmp_path / 'nvme'}"
    sampled = ["--temperature", "1.5", "--top-k", "20", "--top-p", "0.95"]
    first = _generate(path, where, *sampled, "--seed", "3")
    assert _generate(path, where, *sampled, "--seed", "3") == first
    assert _generate(path, where, *sampled, "--seed", "4") != first


@pytest.mark.parametrize(
    ("args", "says"),
    [([], "no prompt"), (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0")],
)
def test_bad_input_is_told_what_to_change(cat_model, args, says):
    result = CliRunner().invoke(app, ["generate", str(cat_model(2, hidden=64)), *args, "--quiet"])
    assert result.exit_code == 2 and says in result.output, result.output
