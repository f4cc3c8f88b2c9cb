"""Pre-quantized bases (a checkpoint transformers saved from a bitsandbytes 4-bit or 8-bit model): read into
chunks as they are, trained like the same weights quantized on load, and read in place when homed on disk."""

import pytest
import torch
from parity import ACCUM, LORA, STEPS, _batches

from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.errors import ConfigError, ModelError, StateError
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import Tier

SETTINGS = {  # name: (model.quantize, BitsAndBytesConfig arguments)
    "nf4": ("nf4", dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)),
    "fp4": ("fp4", dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True)),
    "int8": ("int8", dict(load_in_8bit=True)),
}


@pytest.fixture(scope="module")
def saved_quantized(tmp_path_factory):
    """``saved_quantized(src, name)``: ``src`` quantized by transformers + bitsandbytes and saved with
    ``save_pretrained`` (as a ``*-bnb-4bit`` repository is made), once per module."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    made = {}

    def make(src, name, **extra):
        key = (str(src), name, tuple(sorted(extra.items())))
        if key not in made:
            args = {**SETTINGS[name][1], "bnb_4bit_compute_dtype": torch.float32, **extra}
            model = AutoModelForCausalLM.from_pretrained(
                src, quantization_config=BitsAndBytesConfig(**args), device_map="cpu", dtype=torch.float32
            )
            made[key] = tmp_path_factory.mktemp(f"{name}-saved")
            model.save_pretrained(made[key])
        return made[key]

    return make


def _run(path, disk_dir, quantize, placement):
    cfg = EngineConfig(
        dtype=torch.float32,
        method="lora",
        quantize=quantize,
        lora=LORA,
        learning_rate=1e-2,
        max_steps=STEPS,
        params=placement,
    )
    device, host = ("160KiB", "96KiB") if placement == "disk" else ("8MiB", "8MiB")
    store = StoreConfig.resolve(
        device_budget=device, host_budget=host, disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        layer = next(s for s in trainer.states if s.group.kind == "layer")
        chunks = {
            c.name: (trainer.store.in_place(c) is not None, trainer.store.read(c)) for c in layer.weights
        }
        stats = trainer.store.stats()
    finally:
        trainer.close()
    return losses, chunks, stats


@pytest.mark.parametrize("name", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_a_prequantized_base_trains_like_the_same_weights_quantized_on_load(
    tiny_model_dir, saved_quantized, disk_dir, name, placement
):
    src, _ = tiny_model_dir("llama")
    saved = saved_quantized(src, name)
    quantize = SETTINGS[name][0]
    expected, on_load, _ = _run(src, disk_dir, quantize, placement)
    losses, read, stats = _run(saved, disk_dir, quantize, placement)
    # the same bytes in the chunks, so the same losses
    ours = {k: v for _, views in read.values() for k, v in views.items()}
    theirs = {k: v for _, views in on_load.values() for k, v in views.items()}
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    if placement == "disk":
        # the quantized weights are read from the checkpoint's files, none written to the slot file
        assert any(in_place for in_place, _ in read.values())
        in_place_bytes = sum(
            v.nbytes for in_place, views in read.values() if in_place for v in views.values()
        )
        assert in_place_bytes > 0.9 * sum(v.nbytes for _, views in read.values() for v in views.values())
        assert stats.bytes_moved["disk->host"] > 0
        # what is not read in place: the double-quantization offsets (numbers in the checkpoint's JSON)
        assert all(k.endswith(".offset") for in_place, views in read.values() if not in_place for k in views)


def test_a_prequantized_base_without_double_quantization_matches_peft_on_it(
    tiny_model_dir, saved_quantized, disk_dir
):
    """NF4 with plain fp32 scales (``bnb_4bit_use_double_quant=False``): the reference is peft on the
    checkpoint as transformers loads it."""
    from parity import plain_training
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    src, _ = tiny_model_dir("llama")
    saved = saved_quantized(src, "nf4", bnb_4bit_use_double_quant=False)
    cfg = EngineConfig(
        dtype=torch.float32,
        method="lora",
        quantize="nf4",
        lora=LORA,
        learning_rate=1e-2,
        max_steps=STEPS,
        params="disk",
    )
    store = StoreConfig.resolve(
        device_budget="160KiB", host_budget="96KiB", disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(saved), store, cfg)
    try:
        initial = trainer.adapter_state_dict()
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
    finally:
        trainer.close()
    model = AutoModelForCausalLM.from_pretrained(saved, device_map="cpu", dtype=torch.float32)
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=LORA.r,
            lora_alpha=LORA.alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        ),
    )
    model.train()
    set_peft_model_state_dict(model, initial)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    expected = plain_training(model, opt, params, cfg, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)


def test_a_prequantized_base_asks_for_its_own_quantization(tiny_model_dir, saved_quantized, disk_dir):
    src, _ = tiny_model_dir("llama")
    saved = saved_quantized(src, "nf4")
    for quantize in ("none", "int8"):
        cfg = EngineConfig(dtype=torch.float32, method="lora", quantize=quantize, lora=LORA, max_steps=1)
        with pytest.raises(ConfigError, match="set model.quantize: nf4"):
            StreamedTrainer(str(saved), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg)


def test_a_chunk_read_in_place_is_never_written(tiny_model_dir, saved_quantized, disk_dir):
    src, _ = tiny_model_dir("llama")
    saved = saved_quantized(src, "nf4")
    cfg = EngineConfig(
        dtype=torch.float32, method="lora", quantize="nf4", lora=LORA, max_steps=1, params="disk"
    )
    store = StoreConfig.resolve(
        device_budget="160KiB", host_budget="96KiB", disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(saved), store, cfg)
    try:
        chunk = next(c for c in trainer.store.chunks if trainer.store.in_place(c) is not None)
        with pytest.raises(StateError, match="read in place"), trainer.store.writing(chunk):
            pass
        trainer.store.acquire(chunk, Tier.HOST, traced=False)
        with pytest.raises(StateError, match="read in place"):
            trainer.store.release(chunk, dirty=True)
        trainer.store.release(chunk)
    finally:
        trainer.close()


_LOAD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[4])
from bench_load import peak_rss
from common import proc_status_bytes
from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.methods.lora import LoraSettings
from tiertune.offload.store import StoreConfig
import bitsandbytes, peft  # imported before the baseline, as the trainer would import them

model, disk, placement = sys.argv[1:4]
lora = LoraSettings(r=4, alpha=8, dropout=0.0, seed=0)
cfg = EngineConfig(dtype=torch.bfloat16, method="lora", quantize="nf4", lora=lora, max_steps=1, params=placement)
host = "16MiB" if placement == "disk" else "112MiB"
store = StoreConfig.resolve(device_budget="24MiB", host_budget=host, disk_path=disk, prefetch_depth=1)
baseline = proc_status_bytes("VmRSS")
trainer = StreamedTrainer(model, store, cfg)
loaded = peak_rss()
trainer.step([{"input_ids": torch.randint(0, 1000, (1, 8))}])
stepped = peak_rss()
trainer.close()
print(json.dumps({"baseline": baseline, "loaded": loaded, "stepped": stepped, "host": store.host_budget,
                  "device": store.device_budget}))
"""


@pytest.mark.parametrize("placement", ["disk", "host"])
def test_loading_a_prequantized_base_stays_within_the_host_budget(tmp_path, disk_dir, placement):
    """A 12-layer NF4 checkpoint (~105 MB, bf16 would be ~400 MB) written directly by bench_scale's writer;
    loaded in a fresh process, its peak RSS grows by at most the host budget + a fixed 64 MiB (the bf16
    weights are never built). On disk the base is read in place: the load itself reads almost nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    from bench_scale import write_nf4_checkpoint

    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    written = write_nf4_checkpoint(config, tmp_path / "model", shard_bytes=40 << 20)
    assert written["bytes_on_disk"] > 100e6
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "model"), str(disk_dir), placement, str(bench)],
        check=True,
        capture_output=True,
        text=True,
    )
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert rss["loaded"] - rss["baseline"] <= rss["host"] + 64 * mib, rss
    assert rss["stepped"] >= rss["loaded"]  # and it trains
    if placement == "disk":  # far less than the checkpoint: it stays where it is
        assert rss["loaded"] - rss["baseline"] < written["bytes_on_disk"] / 2, rss


def _moe_run(path, cache, disk):
    cfg = EngineConfig(
        dtype=torch.float32,
        method="lora",
        quantize="nf4",
        lora=LORA,
        learning_rate=1e-2,
        max_steps=STEPS,
        params="disk",
        quant_cache=str(cache),
    )
    store = StoreConfig.resolve(
        device_budget="400KiB", host_budget="200KiB", disk_path=str(disk), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        layers = [c for s in trainer.states if s.group.kind == "layer" for c in s.weights]
        written = {c.name: trainer.store.moved(c).get("host->disk", 0) for c in layers}
        homed = {c.name: trainer.store.in_place(c) is not None for c in layers}
        misses = trainer.quant_cache.misses
    finally:
        trainer.close()
    return losses, written, homed, misses


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_prequantized_moe_trains_like_quantize_on_load_with_its_experts_cached(
    tiny_model_dir, saved_quantized, tmp_path, family
):
    """transformers saves a bitsandbytes-quantized MoE with its attention 4-bit and its experts unquantized
    (one tensor per expert): tiertune reads the first as they are, quantizes the experts on load exactly as
    from the source checkpoint, and homes the layers in the quantized cache's images, never in the slot
    file."""
    src, _ = tiny_model_dir(family, layers=2)
    saved = saved_quantized(src, "nf4")
    expected, _, _, _ = _moe_run(src, tmp_path / "cache-src", tmp_path / "disk-src")
    losses, written, homed, misses = _moe_run(saved, tmp_path / "cache", tmp_path / "disk")
    assert losses == expected  # the same bytes: the same losses, exactly
    assert misses == 2 and all(homed.values()) and not any(written.values()), (homed, written)
    again, written, homed, misses = _moe_run(saved, tmp_path / "cache", tmp_path / "disk2")
    assert again == expected and misses == 0 and all(homed.values())


def test_experts_saved_quantized_one_tensor_per_expert_are_refused_clearly(
    tiny_model_dir, saved_quantized, tmp_path, disk_dir
):
    """A transformers 4 save of a bitsandbytes MoE (``experts.0.w1.weight`` packed 4-bit with its quant
    state): not read as if it were unquantized, nor failed on shapes, but refused saying what to use."""
    import shutil

    import bitsandbytes.functional as bf
    from safetensors.torch import load_file, save_file

    src, _ = tiny_model_dir("mixtral", layers=2)
    v4 = tmp_path / "v4"
    shutil.copytree(saved_quantized(src, "nf4"), v4)
    for shard in v4.glob("*.safetensors"):
        tensors = {}
        for key, value in load_file(shard).items():
            if ".experts." in key and value.is_floating_point():
                value, state = bf.quantize_4bit(value, quant_type="nf4", compress_statistics=True)
                tensors.update({f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()})
            tensors[key] = value
        save_file(tensors, shard, metadata={"format": "pt"})
    cfg = EngineConfig(dtype=torch.float32, method="lora", quantize="nf4", lora=LORA, params="host")
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    with pytest.raises(ModelError, match="quantized one tensor per expert.*unquantized checkpoint"):
        StreamedTrainer(str(v4), store, cfg)
