"""Multimodal classes trained on text (Gemma 3's ``ForConditionalGeneration``): the language model streams as a
decoder does, the vision tower is never read nor adapted, and the merged export is the same class with the tower
as it was."""

import pytest
import torch
from parity import ACCUM, LORA, _batches, assert_adam_trained_close, lora_config, plain_training

from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.offload.store import StoreConfig

STEPS = 4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A tiny Gemma 3 (SigLIP tower, projector, a language model with sliding and full attention, soft-capped
    logits) as ``save_pretrained`` writes its ``ForConditionalGeneration``."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=211,
            sliding_window=4,
            final_logit_softcapping=1.0,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=4,
    )
    path = tmp_path_factory.mktemp("gemma3")
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="60KB")
    return path


def test_text_lora_on_gemma3_follows_peft_and_never_reads_the_tower(gemma3, disk_dir):
    """Gemma3ForConditionalGeneration with text: LoRA on its language model (all-linear names none of the tower's
    modules, although the tower has its own q_proj) trains as peft over transformers' model does (rel 1e-4), the
    base homed on disk; no chunk holds a tower weight, and the adapter's keys are peft's names of the decoder's
    modules."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from tiertune.loading.model import tower_parameters
    from tiertune.methods.lora import language_targets

    cfg = lora_config(quantize="none", warmup_steps=1, max_steps=STEPS, params="disk")
    store = StoreConfig.resolve(
        device_budget="512KiB", host_budget="200KiB", disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(gemma3), store, cfg)
    try:
        tower = set(tower_parameters(trainer.model))
        chunked = {s.name for c in trainer.store.chunks for s in c.tensors}
        initial = trainer.adapter_state_dict()
        batches = _batches(211)
        moved, losses = [], []
        for s in range(STEPS):
            before = trainer.store.stats().bytes_moved.get("disk->host", 0)
            losses.append(trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]))
            moved.append(trainer.store.stats().bytes_moved.get("disk->host", 0) - before)
        trained = trainer.adapter_state_dict()
        trainer.save_adapter(disk_dir / "adapter")
        base_bytes = sum(c.capacity for c in trainer.store.chunks if ".layers." in c.name)
    finally:
        trainer.close()
    assert tower and any("vision_tower" in n for n in tower) and not tower & chunked  # the tower: no chunk
    assert min(moved[1:]) > 0 and max(moved[1:]) <= 2 * base_bytes * 1.1
    assert (
        trained and all(".language_model." in k for k in trained) and not any("vision" in k for k in trained)
    )

    model = AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32, device_map="cpu")
    model.config.use_cache = False
    model.config.get_text_config(decoder=True).use_cache = False
    targets = language_targets(model, "all-linear")
    config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=targets)
    reference = get_peft_model(model, config)
    reference.train()
    set_peft_model_state_dict(reference, initial)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    expected = plain_training(reference, opt, params, cfg, batches, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    theirs = get_peft_model_state_dict(reference)
    assert set(trained) == set(theirs)
    for name, value in theirs.items():
        assert_adam_trained_close(trained[name], value, name)


def test_the_merged_export_of_text_lora_on_gemma3_is_the_same_class_with_its_tower_unchanged(
    gemma3, tmp_path
):
    """``tiertune merge`` of an adapter trained on Gemma 3's language model: the merged model loads in transformers
    as Gemma3ForConditionalGeneration, its vision tower and projector bit-identical to the base's, its adapted
    weights changed."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tiertune.export.commands import merge

    cfg = EngineConfig(
        dtype=torch.float32, method="lora", lora=LORA, learning_rate=1e-2, max_steps=1, params="host"
    )
    trainer = StreamedTrainer(str(gemma3), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg)
    try:
        trainer.step(_batches(211)[:ACCUM])
        trainer.save_adapter(tmp_path / "adapter")
    finally:
        trainer.close()
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the merged model's tokenizer
        (tmp_path / "adapter" / f).write_bytes((gemma3 / f).read_bytes()) if (gemma3 / f).exists() else None
    out, _ = merge(tmp_path / "adapter", tmp_path / "merged", base=str(gemma3), dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    base = {k: v for f in sorted(gemma3.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    tower = [k for k in base if "vision_tower" in k or "multi_modal_projector" in k]
    assert tower and all(torch.equal(written[k], base[k]) for k in tower)
    q = next(k for k in base if k.endswith("layers.0.self_attn.q_proj.weight") and "vision" not in k)
    assert not torch.equal(written[q], base[q])  # the adapter merged into the language model
