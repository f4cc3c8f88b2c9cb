import os

import pytest
import torch

from tiertune.errors import IntegrityError
from tiertune.finetune.engine import EngineConfig, StreamedTrainer
from tiertune.finetune.lora import LoraSettings
from tiertune.offload.store import StoreConfig
from tiertune.quant.bnb4 import NF4


def _trainer(path, cache):
    cfg = EngineConfig(method="lora", quantize="nf4", lora=LoraSettings(r=4, alpha=8, dropout=0.0, seed=0),
                       quant_cache=str(cache))  # fmt: skip
    return StreamedTrainer(str(path), StoreConfig(device_budget="8MiB", host_budget="8MiB"), cfg)


def _logits(trainer):
    ids = torch.arange(24).reshape(2, 12) % trainer.model.config.vocab_size
    return trainer.logits(ids)


def test_the_second_run_reads_the_quantized_layers_instead_of_quantizing(
    tiny_model_dir, tmp_path, monkeypatch
):
    path, _ = tiny_model_dir("llama")
    first = _trainer(path, tmp_path / "cache")
    try:
        assert (first.quant_cache.hits, first.quant_cache.misses) == (0, 4)
        expected = _logits(first)
    finally:
        first.close()

    def refuse(*args, **kwargs):
        raise AssertionError("quantized again although the cache holds the layers")

    monkeypatch.setattr(NF4, "quantize_into", refuse)
    second = _trainer(path, tmp_path / "cache")
    try:
        assert (second.quant_cache.hits, second.quant_cache.misses) == (4, 0)
        assert torch.equal(_logits(second), expected)
    finally:
        second.close()


def test_a_changed_checkpoint_gets_a_new_entry_and_a_corrupt_one_is_refused(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama")
    trainer = _trainer(path, tmp_path / "cache")
    key = trainer.quant_cache.key
    trainer.close()
    # a corrupt tensor in the cache: named, never used
    data = tmp_path / "cache" / key / "model.layers.2" / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="does not match its digest"):
        _trainer(path, tmp_path / "cache")
    # the same checkpoint touched: another key, quantized afresh
    shard = next(path.glob("*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    trainer = _trainer(path, tmp_path / "cache")
    try:
        assert trainer.quant_cache.key != key and trainer.quant_cache.misses == 4
    finally:
        trainer.close()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
