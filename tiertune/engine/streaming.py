"""Streamed decoder layers: each layer of the model instance is replaced by a ``StreamedLayer`` whose forward
acquires the layer's weights, computes without keeping activations and saves only the layer's input; its
backward acquires them again, recomputes the forward with the saved input (the RNG state restored, so dropout
matches), back-propagates, and hands the layer's finished gradients to the engine.

What a streamed layer needs of the engine is ``LayerEngine``; where the input is saved with activations on
the host is ``InputStash``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tiertune.errors import ConfigError
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier

if TYPE_CHECKING:
    from tiertune.engine.router_aux import RouterAux


class LayerEngine(Protocol):
    """What streamed layers use of the engine, by decoder layer index."""

    safe_point: Callable[[], None] | None  # called where a run may stop (no chunk half acquired)
    router_aux: RouterAux | None  # an MoE's auxiliary loss, whose gradient joins each layer's backward
    stash: InputStash | None  # where layer inputs are saved (activations on the host), else autograd's

    def layer_weights(
        self, index: int, requires_grad: bool
    ) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """Layer ``index``'s weights acquired on the device and bound for the block; yields them by name."""
        ...

    def layer_trainable(self, index: int) -> bool:
        """Whether layer ``index``'s own weights are trained (full fine-tuning)."""
        ...

    def layer_adapters(self, index: int) -> list[torch.Tensor]:
        """The trained adapter tensors (LoRA) inside layer ``index``."""
        ...

    def layer_grads(self, index: int, grads: dict[str, torch.Tensor | None]) -> None:
        """Layer ``index``'s weight gradients of a micro-batch, finished (its backward is done)."""
        ...


class InputStash:
    """With activations on the host: one chunk per decoder layer for its saved input, homed on the host and
    sized for the largest micro-batch. Forward writes it on the device and sends it down without waiting;
    backward's acquire finds it prefetched back along the trace. Seconds blocked go to ``times["io_wait"]``."""

    def __init__(self, store: ChunkStore, chunks: list[Chunk], times: dict[str, float]) -> None:
        self.store, self.chunks, self.times = store, chunks, times

    @classmethod
    def add(
        cls, store: ChunkStore, layers: int, numel: int, dtype: torch.dtype, times: dict[str, float]
    ) -> InputStash:
        """Register one input chunk of ``numel`` elements per layer in ``store``."""
        chunks = [
            store.add([("x", (numel,), dtype)], home=Tier.HOST, name=f"input.{i}")[0] for i in range(layers)
        ]
        return cls(store, chunks, times)

    def put(self, index: int, hidden: torch.Tensor) -> None:
        """Keep layer ``index``'s input for backward in its chunk."""
        chunk = self.chunks[index]
        capacity = chunk.tensors[0].numel
        if hidden.numel() > capacity or hidden.dtype != chunk.tensors[0].dtype:
            raise ConfigError(
                f"a micro-batch's hidden states ({tuple(hidden.shape)}, {hidden.dtype}) do not fit the "
                f"activation chunk ({capacity} x {chunk.tensors[0].dtype}); set activation_tokens to the "
                "largest batch x sequence length"
            )
        began = time.perf_counter()
        views = self.store.acquire(chunk, Tier.DEVICE, overwrite=True)
        self.times["io_wait"] += time.perf_counter() - began
        views["x"][: hidden.numel()].copy_(hidden.detach().reshape(-1))
        self.store.release(chunk, dirty=True)
        self.store.evict(chunk, wait=False)

    @contextmanager
    def get(self, index: int, shape: torch.Size) -> Iterator[torch.Tensor]:
        """Layer ``index``'s saved input on the device, for the duration of the block."""
        chunk = self.chunks[index]
        began = time.perf_counter()
        views = self.store.acquire(chunk, Tier.DEVICE)
        self.times["io_wait"] += time.perf_counter() - began
        try:
            yield views["x"][: math.prod(shape)].view(shape)
        finally:
            self.store.release(chunk)


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` of the model instance; streams it through ``LayerFunction``."""

    def __init__(self, engine: LayerEngine, index: int, layer: nn.Module) -> None:
        super().__init__()
        self._engine = [engine]  # lists keep them out of the module tree: names and .to() stay the model's
        self._layer = [layer]
        self.index = index

    @property
    def layer(self) -> nn.Module:
        """The model's own decoder layer this one streams."""
        return self._layer[0]

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        engine = self._engine[0]
        if engine.safe_point is not None:
            engine.safe_point()
        if not torch.is_grad_enabled():  # inference: stream the layer through, nothing saved
            with engine.layer_weights(self.index, requires_grad=False):
                out = self._layer[0](hidden, *rest, **kwargs)
            return out[0] if isinstance(out, tuple) else out
        adapters = engine.layer_adapters(self.index)
        return LayerFunction.apply(hidden, engine, self.index, self._layer[0], rest, kwargs, *adapters)


class LayerFunction(torch.autograd.Function):
    """Forward without keeping activations (the input is saved); backward recomputes, then frees."""

    @staticmethod
    def forward(ctx, hidden, engine, index, layer, args, kwargs, *adapters):
        ctx.engine, ctx.index, ctx.layer, ctx.args, ctx.kwargs = engine, index, layer, args, kwargs
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        with torch.no_grad(), engine.layer_weights(index, requires_grad=False):
            out = layer(hidden, *args, **kwargs)
        if engine.stash is not None:
            engine.stash.put(index, hidden)
            ctx.shape = hidden.shape
        else:
            ctx.save_for_backward(hidden)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def backward(ctx, grad_out):
        engine = ctx.engine
        if engine.safe_point is not None:
            engine.safe_point()
        with ExitStack() as stack:
            if engine.stash is not None:
                hidden = stack.enter_context(engine.stash.get(ctx.index, ctx.shape))
            else:
                (hidden,) = ctx.saved_tensors
            return LayerFunction._backward(ctx, hidden, ctx.needs_input_grad[0], grad_out)

    @staticmethod
    def _backward(ctx, hidden, input_grad, grad_out):
        engine, index = ctx.engine, ctx.index
        trainable = engine.layer_trainable(index)
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices), engine.layer_weights(index, trainable) as params:
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad():
                x = hidden.detach().requires_grad_(input_grad)
                out = ctx.layer(x, *ctx.args, **ctx.kwargs)
                out = out[0] if isinstance(out, tuple) else out
                trained = params if trainable else {}
                adapters = engine.layer_adapters(index)
                inputs = ([x] if input_grad else []) + list(trained.values()) + adapters
                outputs, grad_outputs = [out], [grad_out]
                if engine.router_aux is not None:  # the auxiliary loss's gradient at the router logits
                    for logits, grad in engine.router_aux.gradients(index):
                        outputs.append(logits)
                        grad_outputs.append(grad)
                grads = list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))
            grad_x = grads.pop(0) if input_grad else None
            if trainable:
                engine.layer_grads(index, dict(zip(trained, grads[: len(trained)], strict=True)))
            adapter_grads = grads[len(trained) :]  # autograd accumulates these into the adapters' .grad
        return (grad_x, None, None, None, None, None, *adapter_grads)
