"""Mixtures of experts with LoRA and QLoRA: the fused expert weights stored 4-bit (one NF4 matrix per expert),
adapters on experts and routers as peft puts them, and the router's auxiliary loss as transformers defines it."""

import json
import shutil

import pytest
import torch
from parity import ACCUM, _batches, assert_adam_trained_close, fused_adamw, lora_config, peft_lora

from tiertune.engine import StreamedTrainer
from tiertune.methods.lora import LoraSettings
from tiertune.offload.store import StoreConfig

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]
STEPS = 4
# all-linear (attention, shared experts, dense MLPs) with the routed experts and the routers, which peft adapts
# as parameters (without dropout)
LORA = LoraSettings(r=4, alpha=8, dropout=0.0, seed=0, target_modules=["all-linear", "experts", "routers"])


def _config(quantize, **kw):
    """test_lora's settings, on disk, with this module's adapters and steps."""
    return lora_config(
        **{"quantize": quantize, "lora": LORA, "warmup_steps": 1, "max_steps": STEPS, "params": "disk", **kw}
    )


def _nf4_round_trip(weight):
    """Each expert's 2-D weight quantized on its own as bitsandbytes quantizes a linear weight (NF4, double
    quantization, 64-element blocks) and dequantized: the values the 4-bit experts compute with, and the bytes."""
    import bitsandbytes.functional as F

    values, codes = torch.empty_like(weight), []
    for e in range(weight.shape[0]):
        packed, state = F.quantize_4bit(
            weight[e].contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        values[e] = F.dequantize_4bit(packed, state)
        codes.append((packed, state.absmax, state.state2.absmax, state.offset))
    return values, codes


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def _base(path, quantize):
    """transformers' model in memory: with ``nf4``, transformers + bitsandbytes' NF4 load (its linear layers
    Linear4bit; it leaves the fused experts in full precision), the experts then set to the dequantized values
    of their own NF4 bytes, so that it computes with the weights the engine does. Returns the model and the
    expert bytes."""
    from transformers import AutoModelForCausalLM

    from tiertune.quant import make_quantizer

    quant = make_quantizer(quantize, torch.float32)
    kwargs = {} if quant is None else {"quantization_config": quant.config()}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu", **kwargs)
    base.config.use_cache = False
    codes = {}
    if quant is not None:
        names = {id(m): n for n, m in base.named_modules()}
        for module in _experts_modules(base):
            for attr in ("gate_up_proj", "down_proj"):
                weight = getattr(module, attr)
                assert weight.dtype == torch.float32  # transformers + bitsandbytes left it unquantized
                values, codes[f"{names[id(module)]}.{attr}"] = _nf4_round_trip(weight.detach())
                with torch.no_grad():
                    weight.copy_(values)
    return base, codes


def _reference(path, quantize):
    """peft in memory on ``_base``: parity's ``peft_lora`` with the routed experts and the routers (the fused
    expert weights and the routers' as parameters, rank r each). Returns it and the expert bytes."""
    from peft import get_peft_model

    base, codes = _base(path, quantize)
    return get_peft_model(base, peft_lora(base, LORA, experts=True)), codes


def _plain_loop(model, cfg, batches, with_labels=False):
    """STEPS steps of the plain loop (as tests/engine/test_engine.py's, here over STEPS): AdamW with decay
    on matrices, clip_grad_norm_, transformers' scheduler. ``with_labels``: the model's own loss (one
    micro-batch a step), else the token-weighted cross-entropy over ACCUM micro-batches. Returns the losses."""
    from transformers import get_scheduler

    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = fused_adamw(params, cfg)
    sched = get_scheduler(
        cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps
    )
    per_step = 1 if with_labels else ACCUM
    losses = []
    for step in range(STEPS):
        mbs = batches[step * per_step : (step + 1) * per_step]
        if with_labels:
            (mb,) = mbs
            loss = model(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["labels"]
            ).loss
            loss.backward()
            total = float(loss.detach())
        else:
            n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
            total = 0.0
            for mb in mbs:
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    mb["labels"][:, 1:].reshape(-1),
                    reduction="sum",
                )
                (loss / n).backward()
                total += float(loss.detach()) / n
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _train(path, disk_dir, cfg, save_to=None):
    """STEPS steps of the engine with the frozen base on disk and a host budget of a few layers; returns the
    initial and trained adapters, the batches, the losses and the trainer (closed)."""
    store = StoreConfig.resolve(
        device_budget="4MiB", host_budget="1MiB", disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        initial = trainer.adapter_state_dict()
        batches = _batches(trainer.model.config.vocab_size)
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        trained = trainer.adapter_state_dict()
        trainer.expert_bytes = {
            n: v
            for c in trainer.states
            if c.group.kind == "layer"
            for w in c.weights
            for n, v in trainer.store.read(w).items()
            if ".experts." in n
        }
        if save_to is not None:
            trainer.save_adapter(save_to)
            ids, mask = batches[0]["input_ids"], batches[0]["attention_mask"]
            trainer.saved_logits = trainer.logits(ids, mask)
        stats = trainer.store.stats()
    finally:
        trainer.close()
    assert stats.bytes_moved["disk->host"] > 0  # the base streamed from disk
    return initial, trained, batches, losses, trainer


def _compare(reference, initial, trained, losses, batches, cfg):
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    set_peft_model_state_dict(reference, initial)  # the same initial adapters as tiertune's
    expected = _plain_loop(reference, cfg, batches)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    theirs = get_peft_model_state_dict(reference)
    assert set(trained) == set(theirs)
    for name, value in theirs.items():  # Adam's near-zero gradient entries: see parity
        assert_adam_trained_close(trained[name], value, name)
    weight_diff = max(float((trained[n] - v).abs().max() / v.abs().max()) for n, v in theirs.items())
    print(
        f"max relative loss difference {loss_diff:.2e}, adapters' largest difference / largest entry "
        f"{weight_diff:.2e}"
    )
    return loss_diff


def _adapted(adapter):
    """Which kinds of weights an adapter adapts: attention, experts (gate_up_proj, down_proj), router."""
    kinds = set()
    for key in adapter:
        if ".experts." in key:
            kinds.add("experts")
        elif ".mlp.gate." in key:
            kinds.add("router")
        elif ".self_attn." in key:
            kinds.add("attention")
        elif ".shared_experts." in key or ".mlp." in key:
            kinds.add("dense mlp")
    return kinds


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_with_4bit_experts_matches_peft_and_bitsandbytes(tiny_model_dir, disk_dir, tmp_path, family):
    """QLoRA of an MoE: every expert's weight is NF4 (bitsandbytes' bytes of that expert's matrix), and the
    adapters on attention, experts and routers train as peft + bitsandbytes in memory on the same weights;
    the saved adapter loads with peft and gives the same logits."""
    from peft import PeftModel

    path, _ = tiny_model_dir(family)
    cfg = _config("nf4")
    initial, trained, batches, losses, trainer = _train(path, disk_dir, cfg, save_to=tmp_path / "adapter")
    reference, codes = _reference(path, "nf4")
    # the experts are stored 4-bit: each expert's NF4 bytes, absmax, nested absmax and offset, as bitsandbytes
    assert codes and trainer.adapters.quantized_experts
    for name, experts in codes.items():
        stored = trainer.expert_bytes
        assert stored[name].dtype == torch.uint8 and stored[name].shape[0] == len(experts)
        for e, (packed, absmax, absmax2, offset) in enumerate(experts):
            assert torch.equal(stored[name][e], packed)
            assert torch.equal(stored[f"{name}.absmax"][e], absmax)
            assert torch.equal(stored[f"{name}.absmax2"][e], absmax2)
            assert torch.equal(stored[f"{name}.offset"][e], offset)
    assert _adapted(trained) >= {"attention", "experts", "router"}
    _compare(reference, initial, trained, losses, batches, cfg)

    base, _ = _base(path, "nf4")  # a fresh base: the same dequantized experts
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    loaded.train()  # eval mode would take bitsandbytes' bf16 CPU inference kernel
    with torch.no_grad():
        theirs = loaded(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"]).logits
    assert float((trainer.saved_logits - theirs).abs().max()) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_moe_matches_peft(tiny_model_dir, disk_dir, family):
    """LoRA on an unquantized MoE base: peft's adapters on attention, experts and routers (peft's
    parametrization of the bound expert and router weights) train as peft does in memory."""
    path, _ = tiny_model_dir(family)
    cfg = _config("none")
    initial, trained, batches, losses, _ = _train(path, disk_dir, cfg)
    assert _adapted(trained) >= {"attention", "experts", "router"}
    if family == "deepseek_v3":  # its dense first layer and shared experts too
        assert "dense mlp" in _adapted(trained)
    reference, _ = _reference(path, "none")
    _compare(reference, initial, trained, losses, batches, cfg)


def test_all_linear_on_moe_adapts_attention_shared_experts_and_dense_mlps(tiny_model_dir, disk_dir, tmp_path):
    """``all-linear``, the default, on DeepSeek-V3: its attention, its dense first layer's MLP and its shared
    experts' projections, as modules; no routed expert, no router (peft's remapping would have adapted the routed
    experts in place of the shared ones); with dropout, which only parameters' adapters lack. ``experts`` in the
    list adds the routed experts' weights. The saved adapter loads in peft 0.21 over transformers' model, every
    tensor in place."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from tiertune.loading.model import build_skeleton
    from tiertune.methods.lora import lora_targets

    path, _ = tiny_model_dir("deepseek_v3")
    cfg = _config("none", lora=LoraSettings(r=4, alpha=8, dropout=0.05, seed=0))
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        adapter = trainer.adapter_state_dict()
        trainer.save_adapter(tmp_path / "adapter")
    finally:
        trainer.close()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), tmp_path / "adapter")
    theirs = get_peft_model_state_dict(loaded)
    assert set(theirs) == set(adapter) and all(torch.equal(theirs[k], adapter[k]) for k in adapter)
    modules, parameters = lora_targets(
        build_skeleton(path), LoraSettings(target_modules=["all-linear", "experts"])
    )
    assert _adapted(adapter) == {"attention", "dense mlp"}
    assert any(".layers.0.mlp.gate_proj." in k for k in adapter)  # the dense first layer
    assert any(".shared_experts.down_proj." in k for k in adapter)
    assert not any(".experts." in k and ".shared_experts." not in k for k in adapter)
    assert "mlp.shared_experts.gate_proj" in modules and parameters == [
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    ]


def test_experts_lora_needs_no_dropout(tiny_model_dir, disk_dir):
    from tiertune.errors import ConfigError

    path, _ = tiny_model_dir("mixtral")
    cfg = _config(
        "nf4", lora=LoraSettings(r=4, alpha=8, dropout=0.05, target_modules=["all-linear", "experts"])
    )
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    with pytest.raises(ConfigError, match="set method.lora.dropout: 0"):
        StreamedTrainer(str(path), store, cfg).close()


def _with_router_aux(path, tmp_path, coef):
    """A copy of the model at ``path`` whose config asks for the router's auxiliary loss."""
    out = tmp_path / "aux-model"
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=coef)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_router_aux_loss_is_transformers_loss(tiny_model_dir, disk_dir, tmp_path, family):
    """With output_router_logits, the loss is transformers' model loss (cross-entropy + router_aux_loss_coef x
    load balancing loss), and full fine-tuning with it (one micro-batch a step) matches the plain loop on that
    loss: the same losses and weights, routers included."""
    from transformers import AutoModelForCausalLM

    path = _with_router_aux(tiny_model_dir(family)[0], tmp_path, coef=0.5)
    cfg = _config("none", method="full", kernels="none", learning_rate=3e-3, max_grad_norm=0.5)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    batches = _batches(reference.config.vocab_size)
    expected = _plain_loop(reference, cfg, batches, with_labels=True)
    store = StoreConfig.resolve(
        device_budget="8MiB", host_budget="2MiB", disk_path=str(disk_dir), chunk_size="1MiB"
    )
    states = dict(params="disk", optimizer_states="disk", gradients="disk")
    trainer = StreamedTrainer(
        str(path),
        store,
        _config("none", method="full", kernels="none", learning_rate=3e-3, max_grad_norm=0.5, **states),
    )
    try:
        assert trainer.router_aux is not None
        losses, aux = [], []
        for s in range(STEPS):
            losses.append(trainer.step(batches[s : s + 1]))
            aux.append(trainer.last_router_aux_loss)
        weights = trainer.state_dict()
    finally:
        trainer.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert min(aux) > 0.5  # the load balancing loss is about 1 x the coefficient: not lost in the tolerance
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_deepseek_v3_has_no_router_aux_loss(tiny_model_dir, tmp_path, disk_dir):
    """DeepSeek-V3 balances its experts with a bias, and transformers computes no auxiliary loss for it:
    neither does the engine, whatever output_router_logits says; the loss stays transformers' loss."""
    from transformers import AutoModelForCausalLM

    path = _with_router_aux(tiny_model_dir("deepseek_v3")[0], tmp_path, coef=0.5)
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(path), store, _config("none", method="full", kernels="none"))
    batch = _batches(211)[:1]
    try:
        assert trainer.router_aux is None
        loss = trainer.step(batch)
        assert trainer.last_router_aux_loss is None
    finally:
        trainer.close()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.train()
    expected = reference(**{k: batch[0][k] for k in ("input_ids", "attention_mask", "labels")}).loss
    assert loss == pytest.approx(float(expected), rel=1e-5)


def test_merge_adds_the_adapter_to_the_4bit_experts(tiny_model_dir, disk_dir, tmp_path, write_recipe):
    """``tiertune merge`` of a QLoRA adapter of an MoE: transformers loads the experts unquantized, so they are
    set to what their 4-bit storage gives before the adapter is added; the merged model computes what the
    engine computed."""
    from transformers import AutoModelForCausalLM

    from tiertune.cli.demo import make_tokenizer
    from tiertune.export.commands import merge

    path, _ = tiny_model_dir("qwen3_moe")
    adapter = tmp_path / "adapter"
    _, _, batches, _, trainer = _train(path, disk_dir, _config("nf4"), save_to=adapter)
    # the run's recipe (merge reads model.quantize from it) and a tokenizer (merge writes the base's)
    shutil.copy(write_recipe(tmp_path, path, model={"quantize": "nf4"}), adapter / "recipe.yaml")
    make_tokenizer(["a b c"], adapter)
    out, what = merge(adapter, tmp_path / "merged", dtype="float32")
    assert "dequantized nf4" in what
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = merged(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"]).logits
    torch.testing.assert_close(logits, trainer.saved_logits, rtol=1e-4, atol=1e-4)


def test_dpo_on_an_moe_adds_the_policys_router_loss_only(tiny_model_dir, disk_dir, tmp_path):
    """LoRA DPO on an MoE whose config asks for the router's auxiliary loss: the reference's forward (the base,
    adapters off, in the same layer visits) adds no router logits; step 1's loss is ln 2 plus the coefficient x
    transformers' load balancing loss of the policy on the pairs (the policy is the base then)."""
    import math

    from transformers import AutoModelForCausalLM

    from tiertune.settings import ObjectiveSettings

    path = _with_router_aux(tiny_model_dir("mixtral")[0], tmp_path, coef=0.5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (4, 12), generator=gen)
    ids[2:, :6] = ids[:2, :6]  # two pairs, each sharing its prompt
    labels = ids.clone()
    labels[:, :6] = -100
    batch = {"input_ids": ids, "labels": labels, "pairs": torch.tensor(2)}
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected_aux = 0.5 * float(base(input_ids=ids, output_router_logits=True).aux_loss)
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    cfg = _config(
        "none",
        kernels="none",
        lora=LoraSettings(r=4, alpha=8, dropout=0.0),
        objective=ObjectiveSettings(type="dpo"),
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        loss = trainer.step([batch])
        aux = trainer.last_router_aux_loss
        assert trainer.last_metrics["rewards/margins"] == 0.0
        trainer.step([batch])  # the warm-up's first step had a learning rate of 0
        trainer.step([batch])
        assert trainer.last_metrics["rewards/margins"] != 0.0  # the adapters, experts' included, moved it
    finally:
        trainer.close()
    assert aux == pytest.approx(expected_aux, rel=1e-5) and aux > 0.1
    assert loss - aux == pytest.approx(math.log(2), rel=1e-6)
