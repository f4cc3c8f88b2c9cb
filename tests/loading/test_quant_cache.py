import os

import pytest
import torch

from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.errors import IntegrityError
from tiertune.methods.lora import LoraSettings
from tiertune.offload.store import StoreConfig
from tiertune.quant.bnb4 import NF4


def _trainer(path, cache, params="host", disk=None):
    cfg = EngineConfig(
        method="lora",
        quantize="nf4",
        lora=LoraSettings(r=4, alpha=8, dropout=0.0, seed=0),
        quant_cache=str(cache),
        params=params,
    )
    store = StoreConfig.resolve(
        device_budget="8MiB", host_budget="1MiB" if disk else "8MiB", disk_path=disk, block_size="64KiB"
    )
    return StreamedTrainer(str(path), store, cfg)


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
    data = tmp_path / "cache" / key / "model.layers.2.chunk"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # in the first tensor's bytes
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


def _layers(trainer):
    return [c for s in trainer.states if s.group.kind == "layer" for c in s.weights]


def test_a_frozen_base_on_disk_is_read_from_the_cache_and_never_copied_into_the_disk_tier(
    tiny_model_dir, tmp_path, monkeypatch
):
    """QLoRA with params on disk: the quantized layers are written once, into the cache, and read in place
    from there; the disk tier's slot file holds none of them, in the run that quantizes and in the next one
    (which quantizes nothing). Both compute the same logits."""
    path, _ = tiny_model_dir("llama")
    logits = []
    for run in range(2):
        trainer = _trainer(path, tmp_path / "cache", params="disk", disk=str(tmp_path / f"disk{run}"))
        try:
            layers = _layers(trainer)
            assert layers and all(trainer.store.in_place(c) is not None for c in layers)
            files = {w.file for c in layers for w in trainer.store.in_place(c).windows}
            assert files == {trainer.quant_cache.directory / f"{c.name}.chunk" for c in layers}
            assert (trainer.quant_cache.hits, trainer.quant_cache.misses) == ((0, 4) if run == 0 else (4, 0))
            for chunk in layers:  # the copies in memory dropped (nothing to write back): read from the images
                trainer.store.evict(chunk)
            logits.append(_logits(trainer))
            stats = trainer.store.stats()
            assert all(trainer.store.moved(c).get("disk->host", 0) >= c.capacity for c in layers)
            # nothing of a layer was ever written to the disk tier (its slots are reserved while a group
            # loads, then freed); what it received at most is the rest of the model
            assert all(trainer.store.moved(c).get("host->disk", 0) == 0 for c in layers)
            others = sum(c.capacity for s in trainer.states if s.group.kind != "layer" for c in s.weights)
            assert stats.bytes_moved.get("host->disk", 0) <= others
        finally:
            trainer.close()
        if run == 0:
            monkeypatch.setattr(NF4, "quantize_into", _refuse)
    assert torch.equal(logits[0], logits[1])


def _refuse(*args, **kwargs):
    raise AssertionError("quantized again although the cache holds the layers")


def test_a_damaged_image_read_in_place_is_refused_naming_it(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("llama")
    _trainer(path, tmp_path / "cache", params="disk", disk=str(tmp_path / "disk")).close()
    image = next((tmp_path / "cache").glob("*/model.layers.1.chunk"))
    raw = bytearray(image.read_bytes())
    raw[100] ^= 0xFF
    image.write_bytes(bytes(raw))
    trainer = _trainer(path, tmp_path / "cache", params="disk", disk=str(tmp_path / "disk2"))
    try:
        with pytest.raises(IntegrityError, match=r"model\.layers\.1\.chunk"):
            _logits(trainer)
    finally:
        trainer.close()
