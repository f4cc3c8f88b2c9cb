"""The estimate's figure for a layer's saved activations (``finetune.activations``, traced on the meta device)
against the same layer run for real on the CPU, counted the same way."""

import pytest
import torch

from tiertune.engine import EngineConfig
from tiertune.finetune.activations import layer_saved_bytes
from tiertune.settings import LoraSettings


def _real_saved(model, cfg, tokens: int) -> int:
    """Bytes autograd saves when the first layer of ``model``, prepared as the engine prepares it, runs on real
    tensors (with the default SDPA, which on a CPU is its flash kernel for a causal call without a mask)."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    from tiertune.engine.tiling import tile_mlp
    from tiertune.kernels.ops.attention import use_segment_attention
    from tiertune.kernels.patch import patch_model
    from tiertune.loading.model import split_model

    model = copy.deepcopy(model)
    if cfg.method == "lora":
        inject_adapter_in_model(LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                           target_modules=cfg.lora.target_modules), model)  # fmt: skip
    patch_model(model, "torch")
    assert use_segment_attention(model) is None
    layer = split_model(model).layers[0]
    tile_mlp(layer, cfg.sequence_tile)
    params = {id(p) for p in model.parameters()}
    seen = {}

    def pack(t):
        if id(t) not in params and not isinstance(t, torch.nn.Parameter):
            seen[id(t)] = t.numel() * t.element_size()
        return t

    hidden = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rotary = model.model.rotary_emb
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, attention_mask=None, position_embeddings=rotary(hidden, positions))
    return sum(seen.values())


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_meta_trace_counts_what_a_real_layer_saves(method):
    """A Llama layer at 1000 tokens, the MLP in tiles of 256: the meta trace's bytes are the real layer's,
    within what a flash kernel's own bookkeeping may add (1%)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    cfg = EngineConfig(method=method, lora=LoraSettings(r=8, alpha=16), kernels="auto", sequence_tile=256)
    traced = layer_saved_bytes(meta, cfg, 1000)
    measured = _real_saved(real, cfg, 1000)
    assert traced > 0 and abs(traced - measured) <= 0.01 * measured, (traced, measured)
