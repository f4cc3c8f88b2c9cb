import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.errors import ConfigError, DataError
from tiertune.finetune.train import train


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(3)


@pytest.fixture
def recipe_file(tmp_path, model_dir, write_recipe):
    return write_recipe(
        tmp_path,
        model_dir,
        data={"shuffle": False},
        training={
            "max_steps": 6,
            "gradient_accumulation_steps": 2,
            "learning_rate": "3e-3",
            "lr_scheduler_type": "cosine",
            "warmup_steps": 1,
        },
        offload={
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
    )


def test_train_writes_the_log_and_a_model_transformers_loads(recipe_file, tmp_path):
    from transformers import AutoModelForCausalLM

    result = train(recipe_file, progress=False)
    assert result.steps == 6 and result.losses[-1] < result.losses[0]
    lines = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for r in lines:
        assert {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_bytes"} <= set(r)
        assert r["peak_bytes"]["disk"] > 0 and r["tokens_per_second"] > 0
    assert lines[0]["learning_rate"] == 0.0 and lines[1]["learning_rate"] == pytest.approx(
        3e-3
    )  # warmup 1, cosine
    assert lines[-1]["bytes_moved"]["host->disk"] > 0
    out = result.output_dir
    assert (
        (out / "config.json").exists()
        and (out / "model.safetensors").exists()
        and (out / "tokenizer.json").exists()
    )
    assert not list(out.glob(".export-*"))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    batch = torch.tensor([[3, 4, 5, 6]])
    logits = model(batch).logits
    assert torch.isfinite(logits).all()


def test_cli_train_and_dry_run(recipe_file):
    runner = CliRunner()
    dry = runner.invoke(app, ["train", str(recipe_file), "--dry-run", "training.learning_rate=1e-4"])
    assert dry.exit_code == 0, dry.output
    assert "learning_rate: 0.0001" in dry.output and "params=disk" in dry.output
    run = runner.invoke(app, ["train", str(recipe_file), "training.max_steps=2"])
    assert run.exit_code == 0, run.output
    assert "done: 2 steps" in run.output


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.learnig_rate=1e-4", "did you mean `training.learning_rate`"),
        ("training.learning_rate=-1", "must be >= 0"),
        ("training.max_steps=abc", "must be int"),
        ("model.quantize=nf5", "must be one of none, nf4, fp4, int8"),
        ("offload.host_budget=lots", "cannot read 'lots' as a size"),
        ("modle.path=x", "did you mean `model`"),
        ("training", "must look like section.key=value"),
        ("data.max_seq_len=1", "data.max_seq_len must be >= 2"),
        ("data.packing=true", None),
        ("data.format=alpaca", None),
        ("offload.activations=disk", "offload.activations must be one of auto, device, host"),
        ("offload.activations=host", None),
        ("method.type=galore", None),
        ("method.galore.rank=0", "method.galore.rank must be >= 1"),
        ("method.galore.update_proj_gap=0", "method.galore.update_proj_gap must be >= 1"),
        ("method.galore.scale=-1", "method.galore.scale must be > 0"),
        ("model.path=/nonexistent/model", "is not a Hugging Face model directory (no config.json there)"),
        ("model.quantize=nf4", "model.quantize: nf4 freezes the base; use method.type: lora"),
        (("model.quantize=int8", "method.type=galore"), "or model.quantize: none for method.type: galore"),
        ("method.lora.r=0", "method.lora.r must be >= 1"),
        (("method.type=lora", "method.lora.use_dora=true"), None),
        ("method.lora.use_dora=maybe", "method.lora.use_dora must be bool"),
        ("method.lora.target_parameters=[mlp.experts.down_proj]", None),
        ("method.lora.target_parameters=mlp.experts.down_proj", None),
        ("method.lora.target_parameters=[1, 2]", "method.lora.target_parameters must be a list of names"),
        (
            "offload.overlap_optimizer=maybe",
            "offload.overlap_optimizer must be one of auto, true, false; got 'maybe'",
        ),
        ("offload.overlap_optimizer=false", None),
        ("training.optim=adamw_bnb_8bit", None),
        ("training.optim=sgd", "training.optim must be one of adamw_torch, adamw_bnb_8bit; got 'sgd'"),
        ("offload.params=disk", None),  # valid: disk_path is set in the fixture
    ],
)
def test_malformed_recipes_give_a_clear_error_and_exit_2(recipe_file, override, message):
    from tiertune.config.plan import plan

    overrides = override if isinstance(override, tuple) else (override,)
    if message is None:
        plan(load_recipe(recipe_file, overrides))
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(load_recipe(recipe_file, overrides))
    result = CliRunner().invoke(
        app, ["train", str(recipe_file), *overrides, "--dry-run"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_bad_yaml_and_missing_files(tmp_path, recipe_file):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_recipe(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(DataError, match="does not exist"):
        train(load_recipe(recipe_file, ("data.path=/nonexistent.jsonl",)), progress=False)


def test_a_row_without_text_is_named_or_skipped(tmp_path, recipe_file):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "the red cat sat"}\n{"prompt": "no text here"}\n')
    with pytest.raises(DataError, match=r"rows.jsonl, row 2: expected a string field 'text'"):
        train(load_recipe(recipe_file, (f"data.path={data}",)), progress=False)
    result = train(
        load_recipe(recipe_file, (f"data.path={data}", "data.skip_bad_rows=true", "training.max_steps=1")),
        progress=False,
    )
    assert result.steps == 1


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_export_is_exactly_the_trained_weights(tiny_model_dir, tmp_path, family, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.finetune.train import export_hf
    from tiertune.offload.store import StoreConfig

    path, _ = tiny_model_dir(family)  # llama: tied embeddings; gpt_neox: untied head saved as embed_out
    store = StoreConfig.resolve(
        device_budget="4MiB", host_budget="4MiB", disk_path=str(tmp_path / "nvme"), chunk_size=1 << 40
    )
    trainer = StreamedTrainer(
        str(path),
        store,
        EngineConfig(learning_rate=1e-2, max_steps=2, params="disk", optimizer_states="disk"),
    )
    try:
        batch = [{"input_ids": torch.randint(0, 211, (2, 8), generator=torch.Generator().manual_seed(1))}]
        trainer.step(batch)
        trainer.step(batch)
        weights = trainer.state_dict()
        export_hf(trainer, AutoTokenizer.from_pretrained(model_dir), tmp_path / "out")
    finally:
        trainer.close()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    params = dict(loaded.named_parameters())
    assert set(params) == set(weights)
    for name, value in weights.items():
        assert torch.equal(params[name].detach(), value), name


def test_multi_process_launch_plans_shards_or_says_what_it_cannot_do(recipe_file, monkeypatch):
    from tiertune.config.plan import plan

    monkeypatch.setenv("WORLD_SIZE", "2")
    store, _ = plan(load_recipe(recipe_file, ("training.save_steps=2",)))  # sharded checkpoints are written
    assert store.num_shards == 2
    with pytest.raises(ConfigError, match="launched as 2 processes, but method.type: galore"):
        plan(load_recipe(recipe_file, ("method.type=galore",)))


def test_qlora_recipe_writes_an_adapter_that_peft_loads(recipe_file, model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    overrides = ("model.quantize=nf4", "method.type=lora", "method.lora.r=4", "method.lora.dropout=0.1")
    result = train(recipe_file, overrides, progress=False)
    out = result.output_dir
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()  # no full model: the base is the input model
    records = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(math.isfinite(r["loss"]) for r in records)
    from tiertune.quant.bnb4 import NF4

    base = AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=NF4().config(), device_map="cpu"
    )
    model = PeftModel.from_pretrained(base, out)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().max()) > 0 for p in lora_b)  # trained, not the zero init


def test_galore_recipe_trains_every_weight_and_exports_the_model(recipe_file, model_dir):
    from transformers import AutoModelForCausalLM

    overrides = ("method.type=galore", "method.galore.rank=4", "method.galore.update_proj_gap=2")
    result = train(recipe_file, overrides, progress=False)
    records = [
        json.loads(line) for line in (result.output_dir / "trainer_log.jsonl").read_text().splitlines()
    ]
    assert len(records) == 6 and all(math.isfinite(r["loss"]) for r in records)
    trained = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    changed = [n for n in initial if not torch.equal(trained[n], initial[n])]
    assert len(changed) == len(initial)  # projected and full-rank weights alike


@pytest.mark.parametrize("overrides", [("data.packing=true",), ("data.format=alpaca",)])
def test_packed_and_alpaca_data_train(recipe_file, tmp_path, overrides):
    if "data.format=alpaca" in overrides:
        rows = [{"instruction": "the red cat", "input": "", "output": "sat on the mat"}] * 8
        data = tmp_path / "alpaca.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        overrides = (*overrides, f"data.path={data}")
    result = train(recipe_file, (*overrides, "training.max_steps=3"), progress=False)
    records = [
        json.loads(line) for line in (result.output_dir / "trainer_log.jsonl").read_text().splitlines()
    ]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


def test_the_banner_says_what_is_trained_and_where_each_state_lives(recipe_file, capsys):
    train(recipe_file, ("training.max_steps=1",), progress=True)
    out = capsys.readouterr().out
    assert "tiertune: full, " in out and "parameters trained (100.00%)" in out
    assert "effective batch 8 sequences (4 x 2 accumulated)" in out
    assert "weights" in out and "on disk" in out and "budgets: device (cpu) 4.00 MiB, host 1.00 MiB" in out
    assert "kernels: torch (glu x3, rms_norm x7, rope x3, fused loss, segment attention)" in out


def test_steps_are_reported_to_tensorboard_and_wandb(recipe_file, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(recipe_file, ("training.max_steps=3", "training.report_to=tensorboard"), progress=False)
    events = EventAccumulator(str(result.output_dir / "runs"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx(result.losses) and "memory/peak_disk_bytes" in events.Tags()["scalars"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "wandb-run"
    train(
        recipe_file,
        ("training.max_steps=2", "training.report_to=wandb", f"training.output_dir={out}"),
        progress=False,
    )
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.parametrize(
    "overrides",
    [(), ("model.quantize=nf4", "method.type=lora", "method.lora.r=4", "method.lora.dropout=0")],
    ids=["full", "qlora"],
)
@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_the_kernels_train_with_the_loss_sequence_of_the_torch_references(
    recipe_file, kernels, overrides, caplog
):
    """``kernels: auto`` (the torch references on a CPU) and ``kernels: triton`` (Triton's interpreter, fp32)
    against ``kernels: torch``: the same losses step by step; the Triton run did patch the layers."""
    import importlib.util
    import logging

    if kernels == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")  # on a CPU it runs in its interpreter (tests/conftest.py)
    caplog.set_level(logging.DEBUG, logger="tiertune")
    # two steps of one micro-batch: a step after an update, at a third of the interpreter's time of 3 x 2
    common = (
        *overrides,
        "training.max_steps=2",
        "training.gradient_accumulation_steps=1",
        "offload.overlap_optimizer=false",
    )
    ref = train(
        recipe_file,
        (*common, "kernels=torch", "training.output_dir=" + str(recipe_file.parent / "ref")),
        progress=False,
    )
    caplog.clear()
    ours = train(recipe_file, (*common, f"kernels={kernels}"), progress=False)
    backend = "torch" if kernels == "auto" else "triton"
    assert f"kernels ({backend}): glu x3" in caplog.text
    assert f"fused linear + cross-entropy ({backend}" in caplog.text
    assert ours.losses == pytest.approx(ref.losses, rel=1e-5)
    assert len(ours.losses) == 2
