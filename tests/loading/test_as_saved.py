"""A model known by its config.json alone (an estimate before the download) is laid out as the checkpoint
transformers would save for it (``loading.model.saved_checkpoint``): the same tensors, names, dtypes and
shapes as ``save_pretrained`` writes: an MoE's experts one tensor each, a bitsandbytes model's packed weights
and their quant state; and a ledger trainer loads it reading no value but those of the quant state."""

import dataclasses
import json
import shutil
from collections import defaultdict

import pytest
import torch

from tiertune.distributed.world import World
from tiertune.engine import EngineConfig
from tiertune.engine.loaded import load_model
from tiertune.loading.weights import AsSaved, Checkpoint
from tiertune.offload.store import ChunkStore, StoreConfig

SETTINGS = {  # name: (model.quantize, BitsAndBytesConfig arguments)
    "nf4": ("nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)),
    "fp4": ("fp4", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)),
    "int8": ("int8", dict(load_in_8bit=True)),
}


def _config_alone(tmp_path, saved) -> str:
    """A directory with ``saved``'s config.json and nothing else."""
    alone = tmp_path / "config-alone"
    alone.mkdir()
    shutil.copy(saved / "config.json", alone / "config.json")
    return str(alone)


def _loaded_checkpoint(directory: str, cfg: EngineConfig):
    """The checkpoint a ledger trainer's load reads (``engine.loaded``), and its store (to close)."""
    store = ChunkStore(
        dataclasses.replace(StoreConfig.resolve(device_budget="1GiB", host_budget="1GiB"), ledger=True)
    )
    return load_model(directory, store, cfg, World(), defaultdict(float)).checkpoint, store


def _layout(checkpoint) -> dict:
    return {name: (e.dtype, tuple(e.shape)) for name, e in checkpoint.entries.items()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_config_alone_is_laid_out_as_transformers_saves_the_model(tmp_path, family, dtype):
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    saved = tmp_path / "saved"
    AutoModelForCausalLM.from_config(tiny_config(family, 2), dtype=dtype).save_pretrained(saved)
    cfg = EngineConfig(dtype=dtype, method="lora")
    mine, store = _loaded_checkpoint(_config_alone(tmp_path, saved), cfg)
    store.close()
    assert isinstance(mine, AsSaved)
    assert _layout(mine) == _layout(Checkpoint(saved))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_bitsandbytes_config_alone_is_laid_out_as_its_saved_checkpoint(tmp_path, tiny_model_dir, name):
    """The packed weights, statistics, lookup tables and quant state bitsandbytes saves (their names, dtypes
    and shapes), and the quant state the loader reads from it says what the saved one says."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path, _ = tiny_model_dir("llama")
    quantize, args = SETTINGS[name]
    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=BitsAndBytesConfig(**args, bnb_4bit_compute_dtype=torch.float32),
        device_map="cpu",
        dtype=torch.float32,
    )
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    cfg = EngineConfig(dtype=torch.float32, method="lora", quantize=quantize)
    mine, store = _loaded_checkpoint(_config_alone(tmp_path, saved), cfg)
    store.close()
    real = Checkpoint(saved)

    def layout(checkpoint) -> dict:  # a quant state's length is its JSON's, which holds the weights' offset
        return {k: (d, () if ".quant_state." in k else s) for k, (d, s) in _layout(checkpoint).items()}

    assert layout(mine) == layout(real)
    for key in (k for k in real.entries if ".quant_state." in k):
        out = {}
        for checkpoint, tag in ((mine, "mine"), (real, "real")):
            raw = torch.empty(checkpoint.entries[key].shape, dtype=torch.uint8)
            checkpoint.read_into(key, raw)
            out[tag] = json.loads(bytes(raw.tolist()).decode())
        for field in ("quant_type", "blocksize", "shape", "nested_blocksize"):
            assert out["mine"].get(field) == out["real"].get(field), (key, field, out)


def test_a_ledger_load_reads_no_weight(tmp_path, tiny_model_dir, monkeypatch):
    """Over a ledger store, loading a checkpoint reads its headers and no tensor's values."""
    path, _ = tiny_model_dir("mixtral")
    reads = []
    monkeypatch.setattr(Checkpoint, "read_into", lambda self, name, *a, **k: reads.append(name))
    for method, quantize in (("full", "none"), ("lora", "nf4")):
        cfg = EngineConfig(dtype=torch.float32, method=method, quantize=quantize, params="host")
        _, store = _loaded_checkpoint(str(path), cfg)
        assert store.chunks and all(c.layout.capacity > 0 for c in store.chunks)
        store.close()
    assert reads == []
