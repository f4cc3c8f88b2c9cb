"""export (a run or checkpoint as a model or adapter) and merge (an adapter folded into its base)."""

import pytest
import torch

from tiertune.errors import ConfigError
from tiertune.finetune.export import export, merge
from tiertune.finetune.train import train


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.fixture
def run(tmp_path, model_dir, write_recipe):
    """Train the tiny model 4 steps (checkpoints at 2) with ``overrides``; returns the TrainResult."""
    path = write_recipe(
        tmp_path, model_dir,
        training={"max_steps": 4, "learning_rate": "3e-3", "save_steps": 2, "report_to": "none"},
        offload={"params": "disk"},
        method={"lora": {"r": 4, "dropout": 0.0}},
    )  # fmt: skip
    return lambda *overrides: train(path, overrides, progress=False)


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[3, 4, 5, 6, 7]])).logits


def test_a_checkpoint_exports_as_the_model_of_its_step(tmp_path, run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = run()
    checkpoint = result.output_dir / "checkpoint-2"
    out, what = export(checkpoint, tmp_path / "exported")
    assert "step 2" in what
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    saved = {}  # the weight chunks (moments and master weights have the same tensor names in other files)
    for f in (checkpoint / "state").glob("*.safetensors"):
        if not f.stem.endswith((".exp_avg", ".exp_avg_sq", ".master", ".proj")):
            saved.update(load_file(f))
    state = model.state_dict()
    assert saved and all(torch.equal(state[name], value) for name, value in saved.items())
    final = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32)
    assert not torch.equal(_logits(model), _logits(final))  # step 2, not the end
    with pytest.raises(ConfigError, match="export it as hf"):
        export(checkpoint, tmp_path / "x", "peft")


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_merge_folds_the_adapter_into_its_base(tmp_path, model_dir, run, quantize):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiertune.quant import make_quantizer

    result = run("method.type=lora", f"model.quantize={quantize}")
    adapter, what = export(result.output_dir, tmp_path / "adapter")
    assert "PEFT adapter" in what and (adapter / "adapter_config.json").is_file()
    out, what = merge(result.output_dir, tmp_path / "merged", dtype="float32")
    assert ("dequantized nf4" in what) == (quantize == "nf4")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    quant = make_quantizer(quantize, torch.float32)
    kwargs = {} if quant is None else {"quantization_config": quant.config()}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu", **kwargs)
    peft_model = PeftModel.from_pretrained(base, result.output_dir)
    peft_model.train()  # bitsandbytes' CPU eval path computes in bf16; the training path is fp32 (no dropout here)
    # the merged weights are the (dequantized) base plus the adapter: the same function as base + adapter
    torch.testing.assert_close(_logits(merged), _logits(peft_model), rtol=1e-4, atol=1e-4)
    assert not any("lora" in n for n in merged.state_dict())


def _dtypes(model_dir):
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safe_open has no __iter__)


def test_merge_writes_the_base_models_dtype_unless_told_otherwise(tmp_path, run):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    result = run("method.type=lora")
    merged = CliRunner().invoke(app, ["merge", str(result.output_dir), "--out", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    assert _dtypes(tmp_path / "merged") == {"F32"}  # the base is fp32
    assert "written in float32, the base model's dtype" in " ".join(merged.output.split())
    asked = CliRunner().invoke(
        app, ["merge", str(result.output_dir), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]
    )
    assert asked.exit_code == 0, asked.output
    assert _dtypes(tmp_path / "bf16") == {"BF16"} and "written in bfloat16" in asked.output


def test_base_dtype_is_the_configs_else_the_weights(tmp_path, model_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tiertune.finetune.export import base_dtype

    assert base_dtype(model_dir)[0] == "float32"
    copy = tmp_path / "base"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (copy / "config.json").write_text(json.dumps(config))
    weights = load_file(copy / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, copy / "model.safetensors")
    assert base_dtype(copy) == ("bfloat16", "its safetensors weights")


def test_a_lora_run_and_its_merge_emit_no_future_warning(tmp_path, run):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run("method.type=lora")
        merge(result.output_dir, tmp_path / "merged")
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
