"""The built-in recipes: listed, copied, valid, and the estimates written in them still true."""

import re

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import RECIPES, app
from tiertune.config.recipe import load_recipe, recipe_notes
from tiertune.estimates.report import estimate
from tiertune.estimates.speed import GPUS
from tiertune.loading.hub import SHIPPED
from tiertune.units import format_size

CONFIGS = SHIPPED  # the real models' config.json, by model id, as tiertune ships them (no weights)
GPU_RECIPES = {
    "llama3-8b-qlora-24gb": "meta-llama/Meta-Llama-3-8B",
    "llama3-70b-qlora-nvme": "meta-llama/Meta-Llama-3-70B",
    "llama2-13b-full-nvme": "meta-llama/Llama-2-13b-hf",
    "llama2-7b-galore": "meta-llama/Llama-2-7b-hf",
    "command-r-plus-104b-qlora": "CohereForAI/c4ai-command-r-plus",
    "mixtral-8x22b-qlora-24gb": "mistralai/Mixtral-8x22B-v0.1",
    "llama3-70b-qlora-dpo-24gb": "meta-llama/Meta-Llama-3-70B",
    "llama3-8b-full-dpo": "meta-llama/Meta-Llama-3-8B",
    "llama3-70b-distill-8b-24gb": "meta-llama/Meta-Llama-3-8B",  # its teacher: Meta-Llama-3-70B
    "llama3-70b-qlora-grpo-24gb": "meta-llama/Meta-Llama-3-70B",  # its generation priced too
    # today's 100B-class releases, read as they ship (FP8, MXFP4)
    "deepseek-v3.1-lora-24gb": "deepseek-ai/DeepSeek-V3.1",
    "kimi-k2-lora-48gb": "moonshotai/Kimi-K2-Instruct",
    "glm-4.6-lora-24gb": "zai-org/GLM-4.6-FP8",
    "gpt-oss-120b-lora-24gb": "openai/gpt-oss-120b",
    # a multimodal class trained on text (its tower never read), its experts each on their routed tokens
    "llama4-scout-qlora-24gb": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "llama4-maverick-qlora-24gb": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
}


def test_recipes_are_listed_and_copied(tmp_path):
    listed = CliRunner().invoke(app, ["recipes"])
    assert listed.exit_code == 0
    for name in ["demo", *GPU_RECIPES]:
        assert name in listed.output
    assert listed.output.count("Hardware:") == 1 + len(GPU_RECIPES)
    copied = CliRunner().invoke(app, ["recipes", "llama2-7b-galore", "--to", str(tmp_path)])
    assert copied.exit_code == 0 and (tmp_path / "llama2-7b-galore.yaml").read_text().startswith("# GaLore")
    again = CliRunner().invoke(app, ["recipes", "llama2-7b-galore", "--to", str(tmp_path)])
    assert again.exit_code == 2 and "exists" in again.output
    unknown = CliRunner().invoke(app, ["recipes", "gpt5"])
    assert unknown.exit_code == 2 and "no built-in recipe 'gpt5'" in unknown.output


@pytest.mark.parametrize("name", list(GPU_RECIPES))
def test_the_estimate_written_in_each_gpu_recipe_is_what_estimate_says(name, monkeypatch):
    path = RECIPES / f"{name}.yaml"
    text = path.read_text()
    on_target_disk(monkeypatch, text)
    overrides = [f"model.path={CONFIGS / GPU_RECIPES[name]}"]
    teacher = re.search(r"teacher: \{path: ([\w./-]+)", text)
    if teacher:  # a distillation's teacher, read from its shipped config too
        overrides.append(f"objective.teacher.path={CONFIGS / teacher.group(1)}")
    recipe = load_recipe(path, tuple(overrides))
    gpu = re.search(r"tiertune estimate --gpu (\w+)", text).group(1)  # the GPU the header's figures are for
    # the plan on the recipe's GPU (as ``estimate`` on that machine gives it): on a GPU the boundaries of a
    # wave go to the host and the fused loss's products run on the tensor cores, unlike a GPU-less plan
    predicted = estimate(recipe, measure=False, gpu=gpu)
    comments = " ".join(line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#"))
    device = predicted.tiers["device"]
    assert f"device {format_size(device.peak)} of {format_size(device.budget)}" in comments
    assert f"disk_path needs {format_size(predicted.disk_needed)} free" in comments
    gpu_total = device.peak + sum(predicted.outside_store.values())
    assert f"GPU total with the above {format_size(gpu_total)}" in comments
    stated = re.search(r"(\d+)\s*GB GPU", comments)
    assert stated and gpu_total < int(stated.group(1)) * 1e9 * 0.93  # room for the CUDA context
    assert all(t.fits for n, t in predicted.tiers.items() if n != "disk")  # the disk is the target machine's
    # how fast: the compute part at the GPU's stated peak needs no measurement, so it is checked exactly
    flops = on_4090_flops(recipe)
    assert f"compute >= {flops / GPUS[gpu].peak_flops:.1f} s a step ({flops:.3g} FLOPs" in comments
    assert (
        predicted.moved_per_step["host->device"] == 0
        or format_size(predicted.moved_per_step["host->device"]) in comments
    )
    if predicted.teacher is not None:  # the teacher pass as estimate prices it
        t = predicted.teacher
        assert f"{format_size(t.weight_bytes)} of NF4 weights" in comments
        assert f"no wave reads the disk again, {format_size(t.read_bytes)})" in comments
        assert f"waves of {t.wave_rows} rows" in comments
        per_token = t.copied_bytes / t.scored_tokens / 1e3
        copies = f"each copy {format_size(t.pass_copied[-1])} to the GPU: {per_token:,.1f} kB a scored token"
        assert f"{copies}, {format_size(t.copied_bytes)} for" in comments
        assert f"({format_size(t.cache_bytes)} for" in comments
    if predicted.generation is not None:  # GRPO's sampling as estimate prices it
        g = predicted.generation
        layers = predicted.kinds["weights, quantized cache"][1]
        read, copied = g.steady_pass["disk->host"], g.steady_pass["host->device"]
        assert f"reads {format_size(read)} of the {format_size(layers)} of NF4 layers" in comments
        assert f"copies {format_size(copied)} of them to the GPU" in comments
        assert f"{g.passes} passes a generation ({format_size(g.read_bytes['disk->host'])} read)" in comments
        assert g.fits and f"the GPU holds {format_size(g.held)} of {format_size(g.has)}" in comments
        assert (
            f"the KV cache {format_size(g.kv_bytes)} ({format_size(g.kv_per_sequence)} a sequence" in comments
        )


def on_target_disk(monkeypatch, text: str) -> None:
    """``estimate`` sees the free disk the recipe's hardware line states (the overlap decision weighs the
    disk's room, as the run does on its machine), not this machine's."""
    import shutil
    from collections import namedtuple

    stated = re.search(r"NVMe drive with (\d+) GB free", text)
    free = int(stated.group(1)) * 10**9 if stated else 10**12
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(free, 0, free))


def on_4090_flops(recipe) -> float:
    """The FLOPs of a step of ``recipe`` on a GPU (``estimate``'s step_flops of the model's skeleton)."""
    import torch

    from tiertune.estimates.speed import step_flops
    from tiertune.loading.model import build_skeleton, split_model

    with torch.device("meta"):
        model = build_skeleton(recipe.model.path)
    t, objective = recipe.training, recipe.objective
    micro = (
        t.per_device_train_batch_size * recipe.data.max_seq_len * (1 + objective.paired)
    )  # a pair: two rows
    return step_flops(
        model,
        list(split_model(model).layers),
        micro,
        t.gradient_accumulation_steps,
        recipe.data.max_seq_len,
        recipe.method.type != "lora",
        objective.reference,
        objective.paired,
    ).total


@pytest.mark.parametrize("command", ["env", "train", "estimate", "recipes", "export", "merge", "demo"])
def test_every_command_has_help_with_an_example(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "Example: tiertune " in result.output


def test_export_and_merge_errors_exit_2(tmp_path):
    for args, message in [
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist"),
        (["merge", str(tmp_path), "--out", str(tmp_path / "o")], "is not a PEFT adapter directory"),
    ]:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_recipe_header_reads_as_a_description_and_its_entries():
    description, entries = recipe_notes(RECIPES / "llama3-8b-qlora-24gb.yaml")
    assert description == (
        "Llama-3-8B QLoRA on one 24 GB GPU: the NF4 base stays on the GPU, LoRA r 16 on every linear layer."
    )
    assert (
        entries[0]
        == "Hardware: one 24 GB GPU (RTX 3090/4090), 32 GB RAM. Set data.path (and offload.disk_path) first."
    )
    peaks = next(e for e in entries if e.startswith("peaks:"))
    assert peaks.endswith("disk_path needs 0 B free.")  # its continuation line joined


def test_the_list_shows_whole_descriptions_hardware_and_estimate_wrapped_to_the_terminal():
    listed = CliRunner().invoke(app, ["recipes"], env={"COLUMNS": "80"})
    assert listed.exit_code == 0, listed.output
    assert all(len(line) <= 80 for line in listed.output.splitlines())
    flat = " ".join(listed.output.split())
    for name in ["demo", *GPU_RECIPES]:
        description, entries = recipe_notes(RECIPES / f"{name}.yaml")
        hardware = next(e for e in entries if e.startswith("Hardware:"))
        assert description.endswith(".") and description in flat, name  # the whole paragraph, not one line
        assert hardware in flat
        section = flat[flat.index(description) :].split("Hardware:", 2)[1]  # up to the next recipe's
        if name in GPU_RECIPES:  # what `estimate` predicts, as the recipe states it
            for key in ("estimate (", "peaks:"):
                assert next(e for e in entries if e.startswith(key)) in flat
            assert "disk_path needs" in section and "GPU total with the above" in section
            assert "how fast on an" in section and "tokens/s" in section
        else:  # the demo's header holds no estimate: none is made up
            assert "peaks:" not in section and "step time" not in section


def test_a_recipe_is_printed_and_written_to_a_file_only_with_to(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    printed = CliRunner().invoke(app, ["recipes", "demo"])
    assert printed.exit_code == 0, printed.output
    assert printed.stdout == (RECIPES / "demo.yaml").read_text()  # `tiertune recipes demo > my.yaml`
    assert list(tmp_path.iterdir()) == []  # nothing written to the current directory
    copied = CliRunner().invoke(app, ["recipes", "demo", "--to", "my.yaml"])
    assert copied.exit_code == 0 and (tmp_path / "my.yaml").read_text() == (RECIPES / "demo.yaml").read_text()
    again = CliRunner().invoke(app, ["recipes", "demo", "--to", "my.yaml"])
    assert again.exit_code == 2 and "exists" in again.output
