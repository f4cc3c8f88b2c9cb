"""The router's auxiliary (load-balancing) loss of a mixture-of-experts model, for a model streamed layer by
layer (``RouterAux``)."""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from tiertune.errors import StateError

log = logging.getLogger("tiertune.engine")


class RouterAux:
    """The router's auxiliary (load-balancing) loss of an MoE model, as transformers defines it, for a model
    streamed layer by layer.

    transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE...) add ``router_aux_loss_coef *
    load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)`` to the loss
    when ``output_router_logits`` is set, the router logits of every layer collected by output hooks. The loss
    mixes all layers (expert loads averaged over layers, times mean router probabilities over layers), so
    here forward hooks on the routers keep each layer's logits (tokens x experts, detached) during the
    forward; after it, the model's own ``load_balancing_loss_func`` runs on them as leaves and its gradient
    at each layer's logits is kept; each layer's backward then recomputes its router logits and
    back-propagates that gradient through them with the layer's output gradient. The result is the gradient
    of transformers' loss. Models whose transformers class computes no such loss (DeepSeek-V3 balances its
    experts with a bias, without an auxiliary loss) get none.

    The step's schedule runs a wave of micro-batches through each layer (``engine.schedule``): ``micro`` says
    whose forward a layer is running, and each micro-batch's logits and gradients are kept apart.

    Several micro-batches: each one's auxiliary loss as transformers computes it for that forward, averaged
    over the step's micro-batches (with one micro-batch, transformers' model loss exactly; the Hugging Face
    Trainer instead sums them, scaling the coefficient with gradient_accumulation_steps).
    """

    def __init__(
        self,
        loss: Callable,
        coef: float,
        experts: int,
        top_k: int,
        routers: list[list[nn.Module]],
        index: int,
    ) -> None:
        self.loss, self.coef, self.experts, self.top_k = loss, coef, experts, top_k
        self._index = index  # the router output that holds the logits
        self._collecting = False
        self.micro = 0  # the micro-batch of the wave whose forward the layers are running
        # forward: detached logits per (micro-batch, layer); backward: one layer's recomputed logits
        self._seen: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
        self._live: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        for i, modules in enumerate(routers):
            for module in modules:
                module.register_forward_hook(partial(self._hook, i))

    @classmethod
    def of(cls, model: nn.Module, layers: Sequence[nn.Module]) -> RouterAux | None:
        """The auxiliary loss of ``model`` (its decoder ``layers`` not yet streamed), or None when the config
        does not ask for one (``output_router_logits``) or transformers computes none for the model."""
        config = model.config
        name = type(model).__name__
        loss = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        computes = loss is not None and recorder is not None and hasattr(model, "router_aux_loss_coef")
        if not getattr(config, "output_router_logits", False):
            if computes:
                log.info(
                    "the loss has no router auxiliary loss: %s's config has output_router_logits false", name
                )
            return None
        if not computes:
            log.info(
                "the loss has no router auxiliary loss: transformers' %s computes none "
                "(output_router_logits only returns the router logits)",
                name,
            )
            return None
        target = recorder.target_class
        routers = [[m for m in layer.modules() if isinstance(m, target)] for layer in layers]
        log.info(
            "the loss includes the router auxiliary loss: %s x transformers' load_balancing_loss_func",
            model.router_aux_loss_coef,
        )
        coef, experts, top_k = model.router_aux_loss_coef, model.num_experts, model.num_experts_per_tok
        return cls(loss, float(coef), int(experts), int(top_k), routers, recorder.index)

    def _hook(self, layer: int, module: nn.Module, args: object, output: object) -> None:
        logits = output[self._index] if isinstance(output, tuple | list) else output
        if torch.is_grad_enabled():  # a layer's backward recomputing its forward
            self._live[layer].append(logits)
        elif self._collecting:  # the wave's forward
            self._seen[(self.micro, layer)].append(logits.detach())

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No router logits collected in the block (a preference objective's reference forward: its routers
        are the base's, and the auxiliary loss is the policy's alone, as TRL adds it)."""
        collecting, self._collecting = self._collecting, False
        try:
            yield
        finally:
            self._collecting = collecting

    def start(self) -> None:
        """Collect the router logits of the wave's forward that follows."""
        self._seen.clear()
        self._live.clear()
        self._grads.clear()
        self._collecting = True

    def finish(self, micro: int, attention_mask: torch.Tensor | None, weight: float) -> float:
        """After the wave's forward: the auxiliary loss (unweighted) of micro-batch ``micro``'s router logits;
        the gradient of ``coef * weight`` times it at each layer's logits is kept for the layers' backward."""
        self._collecting = False
        layers = sorted(i for m, i in self._seen if m == micro)
        seen = [self._seen.pop((micro, i)) for i in layers]
        leaves = [t.requires_grad_() for ts in seen for t in ts]
        if not leaves:
            return 0.0
        with torch.enable_grad():
            value = self.loss(tuple(leaves), self.experts, self.top_k, attention_mask)
            grads = iter(torch.autograd.grad(value * (self.coef * weight), leaves))
        for i, ts in zip(layers, seen, strict=True):
            self._grads[(micro, i)] = [next(grads) for _ in ts]
        return float(value.detach())

    def gradients(self, micro: int, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """In layer ``layer``'s backward of micro-batch ``micro``, after its recomputed forward: (router
        logits, their gradient)."""
        grads = self._grads.pop((micro, layer), [])
        live = self._live.pop(layer, [])
        if len(live) != len(grads):
            raise StateError(f"layer {layer}: {len(grads)} router outputs in forward, {len(live)} recomputed")
        return list(zip(live, grads, strict=True))
