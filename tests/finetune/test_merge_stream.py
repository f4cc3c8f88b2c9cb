"""The streamed merge (``tiertune merge``) against peft's ``merge_and_unload``, tensor for tensor."""

import json
from pathlib import Path

import pytest
import torch

from tiertune.export.commands import _merge_in_memory, merge
from tiertune.export.merging import plan_merge


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same(merged: torch.Tensor, reference: torch.Tensor, name: str) -> None:
    """The same merged weight up to the rounding of its last bit: the adapter's product is summed in an order
    that depends on the matrix shapes the CPU's BLAS sees (a block of rows here, the whole weight in peft), so
    an element may round the other way (by the last bit of the tensor's largest values, at most twice). A
    linear weight's product has the shapes peft's has (all its input columns): at least 99% of its elements
    are identical. An embedding's is cut by rows of the vocabulary, and peft loads a 16-bit model's embedding
    factors rounded to that dtype: only the bound holds."""
    assert merged.dtype == reference.dtype and merged.shape == reference.shape, name
    off = (merged.float() - reference.float()).abs()
    bound = 2 * torch.finfo(reference.dtype).eps * reference.float().abs().max().item()
    assert off.max().item() <= bound, f"{name}: {off.max().item()} off (bound {bound})"
    if "embed" not in name:
        assert (off == 0).float().mean().item() >= 0.99, f"{name}: {(off > 0).sum().item()} elements differ"


def _adapter(base: Path, out: Path, seed: int = 0, **config) -> Path:
    """A PEFT adapter of ``base`` with random (non-zero) factors, saved in ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    settings = dict(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM") | config
    peft_model = get_peft_model(model, LoraConfig(**settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:  # factors, magnitudes, biases, saved modules: all changed from their init
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(out)
    config_file = out / "adapter_config.json"
    saved = json.loads(config_file.read_text())
    saved["base_model_name_or_path"] = str(base)
    config_file.write_text(json.dumps(saved))
    return out


def _qwen(directory: Path, like: Path) -> Path:
    """A small random Qwen2 (biases on q, k and v) with the tokenizer of model directory ``like``."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(like)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for f in like.glob("tokenizer*"):
        shutil.copy2(f, directory / f.name)
    return directory


CASES = {
    "plain": {},
    "rslora+patterns": dict(use_rslora=True, rank_pattern={"q_proj": 8}, alpha_pattern={"down_proj": 3}),
    "dora": dict(use_dora=True),
    "saved-head+embedding": dict(
        target_modules=["q_proj", "v_proj", "embed_tokens"], modules_to_save=["lm_head"]
    ),
    "lora-bias": dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_merge_equals_peft_merge_and_unload(tmp_path, cat_model, case, dtype):
    base = cat_model(2)
    if case == "lora-bias":  # lora_B's bias needs a base layer with a bias: Qwen2's q/k/v
        base = _qwen(tmp_path / "qwen", base)
    adapter = _adapter(base, tmp_path / "adapter", **CASES[case])
    torch_dtype = getattr(torch, dtype)
    plan = plan_merge(adapter, base, "none", torch_dtype)
    assert not isinstance(plan, str), plan
    out, what = merge(adapter, tmp_path / "streamed", dtype=dtype)
    assert "in memory" not in what
    _merge_in_memory(adapter, tmp_path / "peft", str(base), torch_dtype, "none")
    streamed, reference = _tensors(out), _tensors(tmp_path / "peft")
    assert streamed.keys() == reference.keys()
    changed = 0
    for name, tensor in reference.items():
        assert streamed[name].dtype == tensor.dtype, name
        _same(streamed[name], tensor, name)
        changed += not torch.equal(tensor, _tensors(base)[name].to(tensor.dtype))
    assert changed >= len(set(plan.deltas) | set(plan.replaced))  # the adapter changed what it adapts
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # a model transformers loads as it is


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_a_quantized_runs_merge_adds_the_adapter_to_the_dequantized_base(tmp_path, cat_model, quantize):
    base = cat_model(2)
    adapter = _adapter(base, tmp_path / "adapter")
    plan = plan_merge(adapter, base, quantize, torch.float32)
    assert not isinstance(plan, str) and len(plan.quantized) == 2 * 7  # every linear of the 2 layers
    out = tmp_path / "streamed"
    from tiertune.export.merging import write_merged

    out.mkdir()
    write_merged(plan, base, adapter, torch.float32, out)
    _merge_in_memory(adapter, tmp_path / "peft", str(base), torch.float32, quantize)
    streamed, reference = _tensors(out), _tensors(tmp_path / "peft")
    original = _tensors(base)
    for name, tensor in reference.items():
        _same(streamed[name], tensor, name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(streamed[q], original[q])  # dequantized, and adapted


def test_a_base_saved_by_bitsandbytes_is_dequantized_as_saved(tmp_path, cat_model):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = cat_model(2)
    saved = tmp_path / "bnb-4bit"
    quantized = AutoModelForCausalLM.from_pretrained(
        base,
        dtype=torch.float32,
        device_map="cpu",
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        ),
    )
    quantized.save_pretrained(saved)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (saved / f).write_bytes((base / f).read_bytes())
    adapter = _adapter(base, tmp_path / "adapter")
    plan = plan_merge(adapter, saved, "none", torch.float32)
    assert not isinstance(plan, str) and plan.saved and set(plan.saved) == set(plan.quantized)
    out, what = merge(adapter, tmp_path / "streamed", base=str(saved), dtype="float32")
    assert "dequantized nf4" in what and "in memory" not in what
    _merge_in_memory(adapter, tmp_path / "peft", str(saved), torch.float32, "none")
    streamed, reference = _tensors(out), _tensors(tmp_path / "peft")
    assert streamed.keys() == reference.keys()  # no quantization statistics left
    for name, tensor in reference.items():
        _same(streamed[name], tensor, name)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_the_merge_is_sharded_as_the_base_and_reads_rows_in_blocks(tmp_path, tiny_model_dir, monkeypatch):
    import tiertune.export.merging as merging

    base, _ = tiny_model_dir("qwen2", 2)
    files = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(files) > 1
    from tiertune.cli.demo import make_tokenizer

    make_tokenizer(["a b c"], base)
    adapter = _adapter(base, tmp_path / "adapter", target_modules=["q_proj", "down_proj", "embed_tokens"])
    monkeypatch.setattr(merging, "SLICE_BYTES", 4 * 64 * 7)  # 7 rows of 64 at a time: uneven blocks
    out, _ = merge(adapter, tmp_path / "streamed", dtype="float32")
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    original = json.loads((base / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == original["weight_map"]
    _merge_in_memory(adapter, tmp_path / "peft", str(base), torch.float32, "none")
    streamed, reference = _tensors(out), _tensors(tmp_path / "peft")
    for name, tensor in reference.items():
        _same(streamed[name], tensor, name)


def test_what_the_stream_does_not_cover_is_merged_by_peft_and_said(tmp_path, cat_model):
    base = cat_model(2)
    adapter = _adapter(base, tmp_path / "adapter")
    streamed, _ = merge(adapter, tmp_path / "streamed", dtype="float32")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | {"fan_in_fan_out": True}))
    assert plan_merge(adapter, base, "none", torch.float32) == "fan_in_fan_out layers (GPT-2's Conv1D)"
    out, what = merge(adapter, tmp_path / "peft", dtype="float32")
    assert "merged by peft in memory" in what and "fan_in_fan_out" in what
    # peft sets fan_in_fan_out back to False for nn.Linear layers: the same merge
    reference = _tensors(out)
    for name, tensor in _tensors(streamed).items():
        _same(tensor, reference[name], name)
