"""What one decoder layer's recompute and backward hold at their peak: traced, not guessed.

The engine recomputes a layer from its input and back-propagates through it, one layer at a time, so one layer's
activations (what autograd saves) and temporaries (what its ops and their gradients hold for a while) are what
a long sequence adds beyond the layer boundaries and their gradients. Here the model's first decoder layer runs
forward and backward on the meta device (no memory, any length) as the engine runs it: the method's LoRA
adapters in it, tiertune's ops, segment attention and the MLP in sequence tiles. ``LiveBytes`` counts every
tensor storage the ops create while it lives (a weak reference to the storage says when it is freed) and keeps
the peak; the layer's input and its output's gradient are the engine's (the boundary and its gradient)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storages created inside this mode and still alive (``live``), and their high-water
    mark (``peak``); views count once, with their storage, and a view of what an op was given (a parameter, a
    tensor made outside) not at all.

    Where backward's engine sums two gradients of one tensor it adds the second into the first in place when it
    holds the only reference to a dense tensor that is no view; under a dispatch mode (this one) it never does.
    So such a sum counts as made in place: the output takes the operand's bytes (the first if it qualifies, else
    the second; a tensor no one else references is assumed, which is what the engine's own buffers hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes it counts for now]
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor and not torch.is_grad_enabled() and _summed_by_autograd():
            self._in_place(*args[:2])
        out = func(*args, **(kwargs or {}))
        given = [t.untyped_storage() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {id(s) for s in given}  # ``given`` holds them while their ids are compared
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                # not a view of an input (a weight)
                if storage not in self._seen and id(storage) not in inputs:
                    counted = [storage.nbytes()]
                    self._seen[storage] = counted
                    self.live += counted[0]
                    self.peak = max(self.peak, self.live)
                    self._refs.append(weakref.ref(storage, lambda _, c=counted: self._freed(c)))
        return out

    def _in_place(self, old, new) -> None:
        """The engine's ``old + new`` as it would run it: into ``old`` or else ``new``, if one qualifies."""
        for t in (old, new):
            if (
                isinstance(t, torch.Tensor)
                and not t._is_view()
                and t.is_contiguous()
                and t.shape == old.shape == new.shape
                and t.dtype == old.dtype == new.dtype
            ):
                counted = self._seen.get(t.untyped_storage())
                if counted is not None:  # its bytes pass to the sum
                    self._freed(counted)
                return

    def _freed(self, counted: list[int]) -> None:
        self.live -= counted[0]
        counted[0] = 0


def _summed_by_autograd() -> bool:
    """Whether the op being dispatched was called by backward's engine itself (no Python frame between it and
    the engine's entry): how the engine sums two gradients of one tensor."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_engine_run_backward":
            return True
        if (
            f"{os.sep}torch{os.sep}" not in frame.f_code.co_filename
            and frame.f_code.co_name != "__torch_dispatch__"
        ):
            return False  # Python code of its own (an autograd Function's backward) called it
        frame = frame.f_back
    return False


class _FlashShaped(torch.autograd.Function):
    """Attention as a GPU's flash kernel saves it (queries, keys, values, output, fp32 log-sum-exp) and as its
    backward works (below): on the meta device SDPA decomposes into the math path, which would count the
    sequence x sequence scores."""

    @staticmethod
    def forward(ctx, q, k, v, gpu):
        ctx.gpu = gpu
        batch, heads, length, _ = q.shape
        # a GPU's kernels write (batch, length, heads, dim), which the layer's transpose back finds contiguous; a
        # CPU's flash kernel (batch, heads, length, dim), which it copies
        out = (
            q.new_empty(batch, length, heads, v.shape[-1]).transpose(1, 2)
            if gpu
            else q.new_empty(batch, heads, length, v.shape[-1])
        )
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        # on a GPU, FlashAttention-2's backward (PyTorch's flash kernel): beside the three gradients, an fp32
        # accumulator of the queries' and, for grouped KV heads, the keys' and values' gradients at the queries'
        # head count (a CPU's flash kernel works in per-thread blocks)
        work = [torch.empty_like(q, dtype=torch.float32)] if ctx.gpu else []
        if ctx.gpu and k.shape[1] != q.shape[1]:
            work += [torch.empty_like(q), torch.empty_like(q)]
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del work
        return *grads, None


def layer_peak_bytes(model: nn.Module, cfg, tokens: int, gpu: bool = False) -> int:
    """The most bytes of activations and temporaries the first decoder layer of ``model`` (a meta-device
    skeleton, not quantized) holds at once while it runs forward and backward for one micro-batch of ``tokens``
    tokens, as ``cfg`` (an ``EngineConfig``) runs it on a GPU (``gpu``: its attention kernels' workspace) or a
    CPU; its input and its output's gradient aside. Raises what the
    trace raises (an architecture whose ops have no meta kernels). A full fine-tune's weight gradients aside:
    the plan counts them as their own item."""
    from tiertune.engine.compute import Handoff
    from tiertune.engine.prepare import prepare_model
    from tiertune.engine.tiling import tile_layer
    from tiertune.kernels.ops.attention import use_segment_attention
    from tiertune.structure import find_decoder_layers, text_decoder

    # the decoder's layers, found on the whole model: in the one-layer copy a tower's list may be larger
    layers_name, layers = find_decoder_layers(model)
    with torch.device("meta"):
        model = _with_first_layer(model, layers)
    # as the run prepares it (``engine.prepare``): its adapters (peft's wrapping, DoRA, 4-bit experts, fp32) but
    # without dropout (tiertune's LoRA op draws its mask again from a seed in backward, and a meta tensor has no
    # generator to draw it), tiertune's ops as their torch references
    kernels = "none" if cfg.kernels == "none" else "torch"
    lora = dataclasses.replace(cfg.lora, dropout=0.0)
    prepare_model(model, dataclasses.replace(cfg, lora=lora, kernels=kernels), torch.device("meta"))
    if cfg.kernels != "none":
        use_segment_attention(model)
    layer = model.get_submodule(layers_name)[0]
    tile_layer(layer, cfg.sequence_tile, model.config.get_text_config(decoder=True).model_type)
    # the adapters' gradients are a layer's temporaries too; a full fine-tune's weight gradients are the plan's
    # own item (``a layer's gradient, summed over a wave``)
    trained = [p for n, p in layer.named_parameters() if cfg.method == "lora" and "lora_" in n]
    rotary = next(  # the text decoder's (a multimodal class has its tower's too)
        (
            m
            for n, m in text_decoder(model).named_modules()
            if type(m).__name__.endswith("RotaryEmbedding") and ".layers." not in f".{n}."
        ),
        None,
    )
    width = model.config.get_text_config(decoder=True).hidden_size
    hidden = torch.zeros(1, tokens, width, device="meta", dtype=cfg.dtype, requires_grad=True)
    positions = torch.arange(tokens, device="meta")[None]
    kwargs = {"attention_mask": None}  # one document: segment attention needs no positions to cut it
    if rotary is not None:
        kwargs["position_embeddings"] = rotary(hidden, positions)
    grad = torch.zeros(1, tokens, width, device="meta", dtype=cfg.dtype)
    layer.train()
    sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = functools.partial(_sdpa, gpu=gpu)
    try:
        with torch.enable_grad(), LiveBytes() as live:
            out = layer(hidden, **kwargs)
            seed = Handoff.apply(out[0] if isinstance(out, tuple) else out, [grad])
            del out, grad  # as the engine's backward: neither stays referenced while backward runs
            torch.autograd.grad(seed, [hidden, *trained], allow_unused=True)
    finally:
        F.scaled_dot_product_attention = sdpa
    return live.peak


def _with_first_layer(model: nn.Module, layers: nn.ModuleList) -> nn.Module:
    """A copy of ``model`` (a meta skeleton) whose decoder ``layers`` keep their first alone: what the trace runs,
    without copying (and adapting) every layer of a model of a hundred."""
    kept = layers._modules
    layers._modules = {"0": layers[0]}
    try:
        return copy.deepcopy(model)
    finally:
        layers._modules = kept


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, gpu=False):
    return _FlashShaped.apply(q, k, v, gpu)


def outside_bytes(
    model: nn.Module, cfg, wave: int, on_gpu: bool, notes: list[str], stash_chunks: bool
) -> dict[str, int]:
    """The device bytes a step of ``cfg`` holds outside the store, by what holds them, for ``model`` (a meta
    skeleton, not quantized) whose waves run ``wave`` micro-batches (``on_gpu``: computed on a GPU;
    ``stash_chunks``: the layer boundaries are chunks of the store, else on the device): one layer's
    activations and temporaries (traced), the boundaries on the device, the reference's, the boundary
    gradients, a trained layer's gradient summed over a wave, and the logits (or the loss fused with the head).
    What a reader should know is appended to ``notes``."""
    from tiertune.kernels.architectures import FUSED_LOSS
    from tiertune.kernels.ops.linear_ce import working_bytes
    from tiertune.loading.model import split_model

    layers = split_model(model).layers
    text = model.config.get_text_config(decoder=True)
    hidden, vocab, size = text.hidden_size, text.vocab_size, cfg.dtype.itemsize
    micro, k = cfg.activation_tokens, cfg.gradient_accumulation_steps
    trained = cfg.trains_base
    act = micro * hidden * size
    out: dict[str, int] = {}
    if not stash_chunks:  # ``stash.DeviceStash``
        out["hidden states at the layer boundaries"] = act * wave * (len(layers) + 1)
    stack = min(cfg.stack_limit, k * micro) if cfg.stack_limit > 0 else 0
    try:  # for the most tokens a layer's visit runs at once: a micro-batch, or a stack of them
        saved = layer_peak_bytes(model, cfg, max(micro, stack), gpu=on_gpu)
    except Exception as exc:  # an op without a meta kernel: the figure is left out, and said
        notes.append(
            f"a layer's activations and temporaries are not counted (tracing it on the meta device failed: {exc})"
        )
        saved = 0
    if saved:
        out["a layer's activations and temporaries (recompute and backward)"] = saved
    # ``schedule``: the reference's boundary per micro-batch, and a layer's visit's (LoRA: the base, adapters off,
    # in the same visits; a full fine-tune: its reference's own pass, before training or beside the policy)
    if cfg.objective.reference:
        out[f"the reference's hidden states ({cfg.objective.type.upper()})"] = act * (wave + 1)
    out["boundary gradients of a wave"] = act * wave  # backward carries each micro-batch's at a boundary
    if trained:
        largest = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
        # and the one before it, while its hand-off overlaps this one's backward (``handoff_lag``)
        lag = cfg.lag(torch.device("cuda" if on_gpu else "cpu"))
        key = (
            "a layer's gradient, summed over a wave (fp32)"
            if not lag
            else "two layers' gradients, summed over a wave (fp32; one in its hand-off)"
        )
        out[key] = largest * 4 * (1 + lag)
    if cfg.kernels != "none" and model.config.get_text_config(decoder=True).model_type in FUSED_LOSS:
        # the loss fused with the head: its chunk of fp32 logits and what goes with it (the op's own figure),
        # and the head's fp32 gradient when the head is trained. On a GPU in bf16/fp16 the op's products run on
        # the tensor cores (larger chunks); a torch without them takes less, so the figure is an upper bound.
        mixed = on_gpu and cfg.dtype in (torch.bfloat16, torch.float16)
        capped = bool(
            getattr(model.config, "final_logit_softcapping", None)
        )  # the class's own (``CausalLMLoss``)
        loss = working_bytes(micro, vocab, hidden, cfg.dtype, mixed, capped)
        out["loss chunk (fused with the head)"] = loss + (vocab * hidden * 4 if trained else 0)
    else:  # the logits of a micro-batch, their fp32 copy for the loss and its gradient
        out["logits and their gradient"] = micro * vocab * (size + 8)
    return out
