"""A layer's visit running a wave's micro-batches as one batch (``engine.schedule.stacks``): their calls stack
along the batch in every family (masks with padding, rotary tables, sliding windows), the stacked layer computes
what each micro-batch's own call does, and a QLoRA step calls each quantized layer once per visit instead of
once per micro-batch with the same losses and gradient norms."""

import pytest
import torch
from parity import LORA, _batches, lora_config
from tiny import tiny_config

from tiertune.engine import StreamedTrainer
from tiertune.engine import compute as compute_module
from tiertune.engine.compute import run_layer
from tiertune.engine.stacking import draws_random, stack_calls
from tiertune.offload.store import StoreConfig

FAMILIES = [
    "llama",
    "qwen2",
    "gpt_neox",
    "mistral",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "stablelm",
    "cohere",
    "mixtral",
    "deepseek_v3",
]


def _captured(model, ids, mask):
    """Each decoder layer's (hidden states, call, output) in a forward of ``ids``."""
    seen = {}

    def pre(index):
        def hook(module, args, kwargs):
            hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
            seen[index] = (hidden, (rest, dict(kwargs)))

        return hook

    layers = model.get_decoder().layers
    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(layers))]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_calls_compute_each_micro_batch_s_own(family, padded):
    """Two micro-batches (1 and 2 rows of 9 tokens; padded: a padded row in each, so the model hands each layer
    a mask; else none, attention causal by itself) through each layer as one batch: the stacked call's output is
    each one's own (fp32, 1e-5). (A micro-batch with a mask and one without do not stack: ``stacks`` runs them
    apart.)"""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers=2), dtype=torch.float32).eval()
    ids = [torch.randint(1, 200, (1, 9)), torch.randint(1, 200, (2, 9))]
    masks = [torch.ones(1, 9, dtype=torch.long), torch.ones(2, 9, dtype=torch.long)]
    if padded:
        masks[0][0, 7:] = 0
        masks[1][1, 4:] = 0
    runs = [_captured(model, i, m) for i, m in zip(ids, masks, strict=True)]
    for index, layer in enumerate(model.get_decoder().layers):
        (h1, c1), (h2, c2) = runs[0][index], runs[1][index]
        call = stack_calls([c1, c2], [1, 2])
        assert call is not None, family
        with torch.no_grad():
            stacked = run_layer(layer, torch.cat([h1, h2]), call)
            apart = torch.cat([run_layer(layer, h1, c1), run_layer(layer, h2, c2)])
        torch.testing.assert_close(stacked, apart, rtol=1e-5, atol=1e-5)


def test_calls_that_differ_other_than_along_the_batch_do_not_stack():
    a = ((), {"position_ids": torch.arange(4)[None], "cache_position": torch.arange(4), "flag": True})
    b = ((), {"position_ids": torch.arange(4)[None], "cache_position": torch.arange(4) + 1, "flag": True})
    c = ((), {"position_ids": torch.arange(4)[None], "cache_position": torch.arange(4), "flag": False})
    assert stack_calls([a, a], [1, 1]) is not None
    assert stack_calls([a, b], [1, 1]) is None  # a 1-D tensor is not along the batch: it must be the same
    assert stack_calls([a, c], [1, 1]) is None
    assert stack_calls([a, ((), {})], [1, 1]) is None
    stacked = stack_calls([a, a], [1, 1])
    assert stacked[1]["position_ids"].shape == (2, 4) and stacked[1]["cache_position"].shape == (4,)


def test_a_layer_with_dropout_is_not_stacked():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=1), dtype=torch.float32)
    assert not draws_random(model.model.layers[0])
    for p in (0.0, 0.1):
        peft = get_peft_model(
            AutoModelForCausalLM.from_config(tiny_config("llama", layers=1)),
            LoraConfig(r=2, lora_dropout=p, target_modules=["q_proj"]),
        )
        assert draws_random(peft.base_model.model.model.layers[0]) == (p > 0)
    model.config.attention_dropout = 0.1
    attention = AutoModelForCausalLM.from_config(model.config).model.layers[0]
    assert draws_random(attention)


K, STEPS = 4, 3


@pytest.mark.parametrize("activations", ["device", "host"])
def test_a_quantized_layer_is_called_once_per_visit_for_the_wave(
    tiny_model_dir, disk_dir, monkeypatch, activations
):
    """QLoRA (NF4 base on disk, no dropout), 4 micro-batches of 2 x 12 tokens a step: stacked (the default for a
    quantized base), each layer is called once in forward and once in backward a step, one at a time 4 times
    each; the losses and gradient norms agree to 1e-5 (the sums inside one matmul are in another order)."""
    path, _ = tiny_model_dir("llama")
    lora = LORA.__class__(r=4, alpha=8, dropout=0.0, seed=0)
    batches = _batches(211, count=STEPS * K)
    runs = {}
    real = compute_module.run_layer
    for stack in (None, 0):
        cfg = lora_config(
            lora=lora,
            params="disk",
            max_steps=STEPS,
            gradient_accumulation_steps=K,
            activations=activations,
            activation_tokens=24,
            stack_tokens=stack,
        )
        calls: list[int] = []

        def counted(layer, hidden, call, calls=calls):
            calls.append(hidden.shape[0])
            return real(layer, hidden, call)

        monkeypatch.setattr(compute_module, "run_layer", counted)  # what the step computes a layer with
        store = StoreConfig.resolve(
            device_budget="8MiB",
            host_budget="2MiB",
            disk_path=str(disk_dir / str(stack)),
            chunk_size="1MiB",
            prefetch_depth=1,
        )
        trainer = StreamedTrainer(str(path), store, cfg)
        try:
            losses, norms = [], []
            for s in range(STEPS):
                losses.append(trainer.step(batches[s * K : (s + 1) * K]))
                norms.append(trainer.last_grad_norm)
            layers = len(trainer.parts.layers)
        finally:
            trainer.close()
        runs[stack] = (losses, norms, calls, layers)
    (l_s, n_s, calls_s, layers), (l_1, n_1, calls_1, _) = runs[None], runs[0]
    rows = batches[0]["input_ids"].shape[0]
    expected = []  # per visit: the padded micro-batches (a mask for their layers) stacked, the others stacked
    for s in range(STEPS):
        padded = [bool((b["attention_mask"] == 0).any()) for b in batches[s * K : (s + 1) * K]]
        kinds = list(dict.fromkeys(padded))  # in order of first appearance, as ``stacks`` opens them
        expected += [rows * padded.count(kind) for kind in kinds] * (2 * layers)
    assert calls_s == expected and len(calls_s) <= 2 * 2 * layers * STEPS
    assert calls_1 == [rows] * (2 * layers * STEPS * K)
    torch.testing.assert_close(torch.tensor(l_s), torch.tensor(l_1), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(n_s), torch.tensor(n_1), rtol=1e-5, atol=0)
