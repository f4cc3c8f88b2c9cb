"""The estimate's figure for a layer's activations and temporaries (``engine.activations``: forward and
backward traced on the meta device) against the same layer run for real on the CPU, its storages counted by
the same ``LiveBytes``; and ``LiveBytes`` itself against what it must see."""

import dataclasses

import pytest
import torch

from tiertune.engine import EngineConfig
from tiertune.engine.activations import LiveBytes, layer_peak_bytes
from tiertune.settings import LoraSettings


def test_live_bytes_counts_a_storage_once_and_sees_it_freed():
    with LiveBytes() as live:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = a * 2  # 4000 more
        assert live.live == 8000 and live.peak == 8000
        del c
        assert live.live == 4000
        d = torch.empty(500, dtype=torch.float64)  # 4000
        assert live.live == 8000 and live.peak == 8000
    del a, b, d
    assert live.live == 0 and live.peak == 8000


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, 2.0)  # a tensor of its own, no view


def test_live_bytes_counts_autograds_sum_of_two_gradients_as_in_place():
    """Two gradients of one tensor: the engine adds the second into the first in place (it holds the only
    reference, no view); under a dispatch mode it would not, so ``LiveBytes`` counts the sum as in place. Held
    at the peak: the output, its gradient and the two gradients (4 x 4000 bytes), not a fifth for the sum."""
    x = torch.randn(1000, requires_grad=True)
    with LiveBytes() as live:
        y = _Doubled.apply(x) + _Doubled.apply(x)
        (gx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    assert live.peak == 4 * 4000, live.peak
    assert torch.equal(gx, torch.full((1000,), 4.0))
    del y, gx
    assert live.live == 0


def _real_peak(model, cfg, tokens: int) -> int:
    """The peak ``LiveBytes`` sees when the first layer of ``model``, prepared as the engine prepares it, runs
    forward and backward on real tensors (with the default SDPA: on a CPU its flash kernel)."""
    import copy

    from tiertune.engine.compute import Handoff
    from tiertune.engine.tiling import tile_layer
    from tiertune.kernels.ops.attention import use_segment_attention
    from tiertune.kernels.patch import patch_model
    from tiertune.loading.model import split_model
    from tiertune.methods.lora import Adapters

    model = copy.deepcopy(model)
    if cfg.method == "lora":  # as the run wraps it (dropout aside: the trace keeps none)
        Adapters(model, dataclasses.replace(cfg.lora, dropout=0.0), torch.device("cpu"))
    patch_model(model, "torch")
    assert use_segment_attention(model) is None
    layer = split_model(model).layers[0]
    tile_layer(layer, cfg.sequence_tile, model.config.model_type)
    trained = [p for n, p in layer.named_parameters() if cfg.method == "lora" and "lora_" in n]
    hidden = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(tokens)[None]
    embeddings = tuple(t.detach() for t in model.model.rotary_emb(hidden, positions))
    grad = torch.randn_like(hidden)
    with LiveBytes() as live:
        out = layer(hidden, attention_mask=None, position_embeddings=embeddings)
        seed = Handoff.apply(out[0] if isinstance(out, tuple) else out, [grad])
        del out, grad
        torch.autograd.grad(seed, [hidden, *trained])
    return live.peak


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_meta_trace_counts_what_a_real_layer_holds(method):
    """A Llama layer at 1000 tokens, the MLP in tiles of 256: the meta trace's peak is the real layer's, within
    what the CPU flash kernel's own bookkeeping and the rotary tables' views may add (5%); and it grows with the
    tokens as the real one does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    real = LlamaForCausalLM(config)
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    cfg = EngineConfig(method=method, lora=LoraSettings(r=8, alpha=16), kernels="auto", sequence_tile=256)
    traced = {n: layer_peak_bytes(meta, cfg, n) for n in (1000, 2000)}
    measured = {n: _real_peak(real, cfg, n) for n in (1000, 2000)}
    for n in traced:
        assert traced[n] > 0 and abs(traced[n] - measured[n]) <= 0.05 * measured[n], (n, traced, measured)
    growth = (traced[2000] - traced[1000], measured[2000] - measured[1000])
    assert abs(growth[0] - growth[1]) <= 0.05 * growth[1], growth
