"""QLoRA on the streamed NF4 base against peft + bitsandbytes trained in memory the plain way."""

import pytest
import torch
from parity import ACCUM, LORA, STEPS, _batches, assert_adam_trained_close, plain_training
from parity import lora_config as _config

from tiertune.engine import StreamedTrainer
from tiertune.methods.lora import LoraSettings
from tiertune.offload.store import StoreConfig
from tiertune.quant import make_quantizer


def _peft_model(path, cfg):
    """transformers + bitsandbytes NF4 (double quant, fp32 compute) + peft LoRA, with peft's own init."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    quant = make_quantizer(cfg.quantize, torch.float32)
    kwargs = {} if quant is None else {"quantization_config": quant.config()}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu", **kwargs)
    base.config.use_cache = False
    lora = LoraConfig(
        r=LORA.r,
        lora_alpha=LORA.alpha,
        lora_dropout=LORA.dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        use_dora=cfg.lora.use_dora,
    )
    return get_peft_model(base, lora)


def _reference(path, cfg, initial_adapter, batches):
    """The plain QLoRA run from ``initial_adapter``: torch AdamW and the loop of the HF Trainer."""
    from peft import set_peft_model_state_dict

    model = _peft_model(path, cfg)
    model.train()  # as the HF Trainer does (eval mode would take bitsandbytes' bf16 CPU inference kernel)
    set_peft_model_state_dict(model, initial_adapter)  # the same initial adapter as tiertune's
    params = [p for p in model.parameters() if p.requires_grad]
    # weight decay on the adapter matrices, not on DoRA's magnitude vectors (pulling a row's norm to zero)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True
    )
    return model, plain_training(model, opt, params, cfg, batches)


def _train(path, disk_dir, cfg, placement, save_to=None):
    """STEPS steps of the engine; returns the initial and trained adapters, batches, losses and store stats
    (on disk, budgets of a few layers: the base streams from disk every step)."""
    device, host = ("160KiB", "96KiB") if placement == "disk" else ("8MiB", "8MiB")
    store = StoreConfig.resolve(
        device_budget=device, host_budget=host, disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        initial = trainer.adapter_state_dict()
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        stats = trainer.store.stats()
        trained = trainer.adapter_state_dict()
        if save_to is not None:
            trainer.save_adapter(save_to)
    finally:
        trainer.close()
    assert stats.divergences == 0  # init passes and the adapters' optimizer stayed out of the trace
    return initial, trained, batches, losses, stats


def _assert_matches_the_plain_run(path, cfg, initial, trained, batches, losses):
    """The same losses (1e-4 relative) and adapter weights as peft + bitsandbytes trained the plain way."""
    from peft import get_peft_model_state_dict

    reference, expected = _reference(path, cfg, initial, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    assert all(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)  # every adapter learned
    ref = get_peft_model_state_dict(reference)
    assert set(trained) == set(ref)
    for name, value in ref.items():  # Adam's near-zero gradient entries: see parity
        assert_adam_trained_close(trained[name], value, name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_qlora_matches_peft_and_bitsandbytes(tiny_model_dir, disk_dir, family, placement):
    path, _ = tiny_model_dir(family)
    cfg = _config(params=placement)
    initial, trained, batches, losses, stats = _train(path, disk_dir, cfg, placement)
    _assert_matches_the_plain_run(path, cfg, initial, trained, batches, losses)
    if placement == "disk":
        assert stats.bytes_moved["disk->host"] > 0
    assert not stats.bytes_moved.get("host->disk") or placement == "disk"  # a frozen base is never written


@pytest.mark.parametrize(("quantize", "placement"), [("nf4", "host"), ("nf4", "disk"), ("none", "host")])
def test_dora_matches_peft(tiny_model_dir, disk_dir, tmp_path, quantize, placement):
    """DoRA (peft's ``use_dora``): magnitudes initialized from the streamed base, trained like the rest;
    the saved adapter is a DoRA adapter peft loads."""
    from peft import PeftConfig, get_peft_model_state_dict

    path, _ = tiny_model_dir("llama")
    lora = LoraSettings(r=4, alpha=8, dropout=0.0, seed=0, use_dora=True)
    cfg = _config(params=placement, quantize=quantize, lora=lora)
    initial, trained, batches, losses, _ = _train(path, disk_dir, cfg, placement, save_to=tmp_path / "dora")
    magnitudes = [k for k in initial if "lora_magnitude_vector" in k]
    assert len(magnitudes) == 4 * 7  # every linear layer of the 4 decoder layers
    # they start as the base weights' row norms: peft's own init on the plain model agrees
    own = get_peft_model_state_dict(_peft_model(path, cfg))
    for name in magnitudes:
        torch.testing.assert_close(initial[name], own[name], rtol=1e-6, atol=0)
    _assert_matches_the_plain_run(path, cfg, initial, trained, batches, losses)
    assert PeftConfig.from_pretrained(tmp_path / "dora").use_dora


def test_saved_adapter_loads_with_peft_and_reproduces_the_logits(tiny_model_dir, disk_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiertune.quant.bnb4 import NF4

    path, _ = tiny_model_dir("qwen2")
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(path), store, _config(params="disk", max_steps=3))
    batches = _batches(trainer.model.config.vocab_size)
    try:
        for s in range(3):
            trainer.step(batches[s * ACCUM : (s + 1) * ACCUM])
        out = trainer.save_adapter(tmp_path / "adapter")
        ids, mask = batches[0]["input_ids"], batches[0]["attention_mask"]
        ours = trainer.logits(ids, mask)
        assert trainer.store.stats().divergences == 0  # inference stayed out of the trace
    finally:
        trainer.close()
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=NF4().config(), dtype=torch.float32, device_map="cpu"
    )
    model = PeftModel.from_pretrained(base, out)
    model.train()  # eval mode would pick bitsandbytes' bf16 CPU inference kernel
    with torch.no_grad():
        theirs = model(input_ids=ids, attention_mask=mask).logits
    assert float((ours - theirs).abs().max()) <= 1e-5


def test_an_nf4_layer_moves_at_most_0_3_of_its_bf16_bytes(disk_dir, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=211,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    moved = {}
    for quantize in ("nf4", "none"):
        cfg = _config(dtype=torch.bfloat16, quantize=quantize, max_steps=2)
        # two layers fit on the device: each layer comes from the host on every pass
        store = StoreConfig.resolve(
            device_budget="3MiB", host_budget="16MiB", disk_path=str(disk_dir), prefetch_depth=1
        )
        trainer = StreamedTrainer(str(tmp_path / "model"), store, cfg)
        try:
            for _ in range(2):
                trainer.step(_batches(211)[:ACCUM])
            layers = [s.weights[0] for s in trainer.states if s.group.kind == "layer"]
            moved[quantize] = [trainer.store.moved(c).get("host->device", 0) for c in layers]
        finally:
            trainer.close()
    for nf4, bf16 in zip(moved["nf4"], moved["none"], strict=True):
        assert bf16 > 0 and nf4 <= 0.3 * bf16, moved


@pytest.mark.parametrize("quantize", ["int8", "none"])
def test_lora_on_an_int8_or_unquantized_base_matches_peft(tiny_model_dir, disk_dir, quantize):
    path, _ = tiny_model_dir("llama")
    cfg = _config(params="host", quantize=quantize)
    trainer = StreamedTrainer(str(path), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg)
    try:
        initial = trainer.adapter_state_dict()
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        trained = trainer.adapter_state_dict()
    finally:
        trainer.close()
    reference, expected = _reference(path, cfg, initial, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    from peft import get_peft_model_state_dict

    for name, value in get_peft_model_state_dict(reference).items():
        torch.testing.assert_close(trained[name], value.detach(), rtol=1e-4, atol=1e-6)


def test_a_saved_adapter_names_its_base_by_absolute_path(tiny_model_dir, disk_dir, tmp_path, monkeypatch):
    import json

    from peft import AutoPeftModelForCausalLM

    from tiertune.methods.lora import peft_wrapping

    path, _ = tiny_model_dir("llama")
    monkeypatch.chdir(path.parent)  # the model given as a path relative to where the run starts
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(path.name, store, _config(quantize="none", max_steps=1))
    try:
        out = trainer.save_adapter(tmp_path / "adapter")
    finally:
        trainer.close()
    monkeypatch.chdir(tmp_path)  # elsewhere
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(path.resolve())
    with peft_wrapping():  # peft's deprecated read, as in tiertune
        AutoPeftModelForCausalLM.from_pretrained(out)  # finds its base from any directory


def test_a_cpu_without_native_bf16_computes_the_4bit_layers_in_fp32(tiny_model_dir, monkeypatch):
    """On a CPU without native bf16 matrix products (AVX2: torch falls back to a scalar loop), a bf16 QLoRA
    dequantizes its 4-bit weights to fp32 and multiplies in fp32; the activations stay bf16 between layers.
    The loss is the bf16 run's to bf16 precision."""
    import bitsandbytes as bnb

    from tiertune.kernels.ops import backend

    path, _ = tiny_model_dir("llama")
    losses = {}
    for native in (True, False):
        monkeypatch.setattr(backend, "native_matmul", lambda dtype, native=native: native)
        cfg = _config(dtype=torch.bfloat16, quantize="nf4", max_steps=2)
        trainer = StreamedTrainer(
            str(path), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg
        )
        try:
            compute = torch.bfloat16 if native else torch.float32
            assert trainer.quant.compute_dtype == compute
            decoder = [m for layer in trainer.parts.layers for m in layer._layer[0].modules()]
            layers = [m for m in decoder if isinstance(m, bnb.nn.Linear4bit)]
            assert layers and all(m.compute_dtype == compute for m in layers)
            losses[native] = [trainer.step(_batches(211)[s * ACCUM : (s + 1) * ACCUM]) for s in range(2)]
        finally:
            trainer.close()
    torch.testing.assert_close(torch.tensor(losses[False]), torch.tensor(losses[True]), rtol=2e-2, atol=0)


def test_wrapping_a_deepseek_v3_says_nothing_of_peft_s_own_expert_patterns():
    """peft adds rank and alpha patterns for fused experts (``gate_up_proj``) itself and warns, at every
    wrapping, that they matched nothing on an MoE whose experts are modules of their own: not the user's to
    act on (``estimate`` printed it six times). Other warnings still reach the user."""
    import warnings

    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from tiertune.methods.lora import Adapters
    from tiertune.settings import LoraSettings

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        adapters = Adapters(model, LoraSettings(dropout=0.0), torch.device("meta"))
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    said = [str(w.message) for w in seen]
    assert not [m for m in said if "did not match any targeted module" in m], said
    assert "a warning of the user's own" in said
    assert adapters.tuner_layers  # the layers were wrapped
