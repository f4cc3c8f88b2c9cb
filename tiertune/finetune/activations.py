"""What one decoder layer keeps for backward while the engine back-propagates through it: traced, not guessed.

The engine recomputes a layer from its input and back-propagates through it, one layer at a time, so the
activations of one layer's autograd graph are what a long sequence adds beyond the layer boundaries. Here the
model's first decoder layer runs on the meta device (no memory, any length) as the engine runs it: the
method's LoRA adapters in it, tiertune's ops, segment attention and the MLP in sequence tiles, and every tensor
autograd saves is counted once (``torch.autograd.graph.saved_tensors_hooks``), parameters aside."""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn


class _FlashShaped(torch.autograd.Function):
    """Attention as a flash kernel saves it (queries, keys, values, output, fp32 log-sum-exp): on the meta device
    SDPA decomposes into the math path, which would count the sequence x sequence scores."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace only counts
        raise NotImplementedError


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashShaped.apply(q, k, v)


def layer_saved_bytes(model: nn.Module, cfg, tokens: int) -> int:
    """Bytes autograd saves in the first decoder layer of ``model`` (a meta-device skeleton, not quantized)
    for one micro-batch of ``tokens`` tokens, as ``cfg`` (an ``EngineConfig``) runs it. Raises what the trace
    raises (an architecture whose ops have no meta kernels)."""
    from tiertune.engine.tiling import tile_mlp
    from tiertune.kernels.ops.attention import use_segment_attention
    from tiertune.kernels.patch import patch_model
    from tiertune.loading.model import split_model

    with torch.device("meta"):
        model = copy.deepcopy(model)
        if cfg.method == "lora":
            from peft import LoraConfig, inject_adapter_in_model

            # no dropout: tiertune's LoRA op draws its mask again from a seed in backward (it saves none), and a
            # meta tensor has no generator to draw it
            lora = cfg.lora
            targets = lora.target_modules
            with warnings.catch_warnings():  # peft's notes on patterns this one layer's modules do not match
                warnings.simplefilter("ignore")
                inject_adapter_in_model(
                    LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=targets),
                    model,
                )
    if cfg.kernels != "none":
        patch_model(model, "torch")
        use_segment_attention(model)
    parts = split_model(model)
    layer = parts.layers[0]
    tile_mlp(layer, cfg.sequence_tile)
    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and not isinstance(t, nn.Parameter):
            seen[id(t)] = t.numel() * t.element_size()
        return t

    rotary = next((m for n, m in model.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
                   and ".layers." not in f".{n}."), None)  # fmt: skip
    hidden = torch.zeros(1, tokens, model.config.hidden_size, device="meta", dtype=cfg.dtype, requires_grad=True)
    positions = torch.arange(tokens, device="meta")[None]
    kwargs = {"attention_mask": None}  # one document: segment attention needs no positions to cut it
    if rotary is not None:
        kwargs["position_embeddings"] = rotary(hidden, positions)
    layer.train()
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(hidden, **kwargs)
    finally:
        F.scaled_dot_product_attention = sdpa
    return sum(seen.values())
