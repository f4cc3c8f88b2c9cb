"""Multimodal classes trained on text (Gemma 3's and Llama 4's ``ForConditionalGeneration``): the language model
streams as a decoder does, the vision tower is never read nor adapted, and the merged export is the same class with
the tower as it was."""

import re

import pytest
import torch
from parity import ACCUM, LORA, _batches, assert_adam_trained_close, lora_config, plain_training
from releases import write_rowwise_fp8
from tiny import save_llama4

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


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, cat_model):
    """tiny.py's Llama 4 ``ForConditionalGeneration`` checkpoint, with a tokenizer."""
    path = save_llama4(tmp_path_factory.mktemp("llama4"))
    for f in cat_model(2).glob("*token*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="module")
def kimi_k25(tmp_path_factory, cat_model):
    """A tiny Kimi K2.5 (MoonViT tower with its fused qkv, a projector, DeepSeek-V3's language model: latent
    attention, a dense first layer, shared and routed experts) as ``save_pretrained`` writes it, with a
    tokenizer."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    config = Kimi_K25Config(
        text_config=dict(
            model_type="deepseek_v3",
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            vocab_size=211,
        ),
        vision_config=dict(
            patch_size=8,
            pos_emb_height=4,
            pos_emb_width=4,
            pos_emb_time=2,
            num_attention_heads=2,
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
        ),
        projection_hidden_size=32,
    )
    path = tmp_path_factory.mktemp("kimi_k25")
    Kimi_K25ForConditionalGeneration(config).save_pretrained(path, max_shard_size="60KB")
    for f in cat_model(2).glob("*token*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="module")
def llama4_fp8(llama4, tmp_path_factory):
    """The tiny Llama 4 as Meta's FP8 release of Maverick ships (quant_method fbgemm_fp8: the feed-forward
    layers' linears and fused experts e4m3 with a scale per output channel, the attention kept 16-bit by its
    checkpoint names): (release dir, dir of the model of its dequantized values)."""
    root = tmp_path_factory.mktemp("llama4-fp8")
    skip = [f"language_model.model.layers.{i}.self_attn" for i in range(4)] + ["vision_model", "lm_head"]
    write_rowwise_fp8(llama4, root / "fp8", root / "values", skip)
    return root / "fp8", root / "values"


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory, cat_model):
    """A tiny Qwen3-VL (its vision encoder with deepstack mergers, a language model with interleaved 3-D rotary
    positions), a multimodal class transformers has no causal LM for, as ``save_pretrained`` writes it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=211,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            depth=1,
            num_heads=2,
            out_hidden_size=64,
            patch_size=8,
            deepstack_visual_indexes=[0],
        ),
    )
    path = tmp_path_factory.mktemp("qwen3_vl")
    Qwen3VLForConditionalGeneration(config).save_pretrained(path, max_shard_size="60KB")
    for f in cat_model(2).glob("*token*"):
        (path / f.name).write_bytes(f.read_bytes())
    return path


FAMILIES = {  # device and host budgets: streamed
    "gemma3": ("512KiB", "200KiB"),
    "kimi_k25": ("384KiB", "160KiB"),
    "llama4": ("512KiB", "256KiB"),
    "llama4_fp8": ("256KiB", "160KiB"),
    "qwen3_vl": ("256KiB", "160KiB"),
}


def _paths(family, *made):
    """The checkpoint of ``family`` to train (a fixture's of ``made``, in FAMILIES' order) and the model of its
    values (itself, or the dequantized values of a quantized release)."""
    found = dict(zip(sorted(FAMILIES), made, strict=True))[family]
    return found if isinstance(found, tuple) else (found, found)


def _checkpoint_class(path):
    """The transformers class the checkpoint's config names (what a user loads it with)."""
    import json

    import transformers

    return getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])


class _TextPath(torch.nn.Module):
    """transformers' forward of a multimodal class for text: its language model's (the class's own forward hands
    text to it unchanged; transformers 5.24's Llama 4 class fails after it, reading ``image_outputs`` from the
    language model's output)."""

    def __init__(self, peft_model):
        super().__init__()
        self.peft_model = peft_model
        self.model = peft_model.base_model.model

    def forward(self, input_ids, attention_mask):
        if type(self.model).__name__ == "Llama4ForConditionalGeneration":
            return self.model.language_model(input_ids=input_ids, attention_mask=attention_mask)
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_lora_follows_peft_and_never_reads_the_tower(
    family, gemma3, kimi_k25, llama4, llama4_fp8, qwen3_vl, disk_dir
):
    """A multimodal class trained on text: LoRA on its language model (all-linear names none of the tower's
    modules, although the tower has its own q_proj; on Llama 4's MoE layers: attention and the shared expert,
    not the router) trains as peft over transformers' model of the checkpoint's class does (rel 1e-4), the base
    homed on disk and read at most twice a step; no chunk holds a tower weight, and the adapter's keys are peft's
    names of the decoder's modules in that class. Llama 4's FP8 release is read as it ships (its feed-forward
    codes and scales in place) and follows peft over the model of its dequantized values."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from tiertune.loading.model import tower_parameters
    from tiertune.quant.shipped import ShippedExperts, ShippedLinear

    path, values = _paths(family, gemma3, kimi_k25, llama4, llama4_fp8, qwen3_vl)
    device, host = FAMILIES[family]
    cfg = lora_config(quantize="none", warmup_steps=1, max_steps=STEPS, params="disk")
    store = StoreConfig.resolve(
        device_budget=device, host_budget=host, disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        assert type(trainer.model).__name__ == _checkpoint_class(path).__name__
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
        base_bytes = sum(c.capacity for c in trainer.store.chunks if ".layers." in c.name)
        layers = [streamed.layer for streamed in trainer.parts.layers]
        shipped = {
            "linear": [n for lay in layers for n, m in lay.named_modules() if isinstance(m, ShippedLinear)],
            "experts": [
                n for lay in layers for n, p in lay.named_parameters() if isinstance(p, ShippedExperts)
            ],
        }
    finally:
        trainer.close()
    assert tower and not any(".language_model." in f".{n}" for n in tower) and not tower & chunked  # no chunk
    assert min(moved[1:]) > 0 and max(moved[1:]) <= 2 * base_bytes * 1.1
    assert (
        trained
        and all(".language_model." in k for k in trained)
        and not any("vision" in k or "visual" in k for k in trained)
    )
    if family.startswith("llama4"):
        assert any(".shared_expert." in k for k in trained) and not any(".router." in k for k in trained)
    if family == "llama4_fp8":  # read as shipped: the feed-forward layers' codes and the experts', in place
        assert (
            shipped["linear"] and shipped["experts"] and not any("self_attn" in n for n in shipped["linear"])
        )

    model = _checkpoint_class(values).from_pretrained(values, dtype=torch.float32, device_map="cpu")
    model.config.use_cache = False
    model.config.get_text_config(decoder=True).use_cache = False
    decoder = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and ".language_model." in f".{n}"
        and not n.endswith("router")
        and "lm_head" not in n
    ]
    config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=decoder)
    reference = get_peft_model(model, config)
    reference.train()
    set_peft_model_state_dict(reference, initial)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    expected = plain_training(_TextPath(reference), opt, params, cfg, batches, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    theirs = get_peft_model_state_dict(reference)
    assert set(trained) == set(theirs)
    for name, value in theirs.items():
        assert_adam_trained_close(trained[name], value, name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_merged_export_of_text_lora_is_the_same_class_with_its_tower_unchanged(
    family, gemma3, kimi_k25, llama4, llama4_fp8, qwen3_vl, tmp_path
):
    """``tiertune merge`` of an adapter trained on a multimodal class's language model: the merged model loads in
    transformers as the checkpoint's class, its vision tower and projector bit-identical to the base's, its
    adapted weights changed. Over Llama 4's FP8 release the merge writes the model of its values: the same
    tensors (no scales left), the experts' the dequantized values exactly."""
    from safetensors.torch import load_file

    from tiertune.export.commands import merge

    path, values = _paths(family, gemma3, kimi_k25, llama4, llama4_fp8, qwen3_vl)
    cfg = EngineConfig(
        dtype=torch.float32, method="lora", lora=LORA, learning_rate=1e-2, max_steps=1, params="host"
    )
    trainer = StreamedTrainer(str(path), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg)
    try:
        trainer.step(_batches(211)[:ACCUM])
        trainer.save_adapter(tmp_path / "adapter")
    finally:
        trainer.close()
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the merged model's tokenizer
        (tmp_path / "adapter" / f).write_bytes((path / f).read_bytes()) if (path / f).exists() else None
    out, what = merge(tmp_path / "adapter", tmp_path / "merged", base=str(path), dtype="float32")
    assert "in memory" not in what, what
    merged = _checkpoint_class(out).from_pretrained(out, dtype=torch.float32)
    assert type(merged) is _checkpoint_class(path)
    base = {k: v for f in sorted(values.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert written.keys() == base.keys()
    tower = [k for k in base if "language_model" not in k and "lm_head" not in k]
    assert tower and all(torch.equal(written[k], base[k]) for k in tower)
    query = re.compile(
        r"language_model\.(.*\.)?(layers|blocks)\.0\.self_attn\.q_(b_)?proj\.weight$"
    )  # MLA: q_b_proj
    q = next(k for k in base if query.search(k))
    assert not torch.equal(written[q], base[q])  # the adapter merged into the language model
    experts = [k for k in base if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert all(torch.equal(written[k], base[k]) for k in experts)  # not adapted: the values as they were


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_experts_run_on_their_routed_tokens_as_transformers_runs_them_on_all(top_k):
    """Llama 4's MoE block with each expert on the tokens routed to it (``engine.routing``) is transformers'
    block, which runs every expert on every token: the same output, router logits and gradients (fp32)."""
    import copy

    from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    from tiertune.engine.routing import route_experts

    torch.manual_seed(0)
    config = Llama4TextConfig(
        hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=top_k
    )
    dense = Llama4TextMoe(config)
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.2)
    routed = copy.deepcopy(dense)
    holder = torch.nn.ModuleList([routed])
    assert route_experts(holder) == 1
    x = torch.randn(3, 7, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (out1, logits1), (out2, logits2) = dense(x1), routed(x2)
    torch.testing.assert_close(out2, out1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits2, logits1)
    grad = torch.randn_like(out1)
    out1.backward(grad)
    out2.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    for (name, p1), p2 in zip(dense.named_parameters(), routed.parameters(), strict=True):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-6, msg=name)
