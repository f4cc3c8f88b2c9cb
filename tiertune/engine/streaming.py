"""Streamed decoder layers: each decoder layer of the model instance is replaced by a ``StreamedLayer``.

The model's own forward still runs the parts around the layers (embeddings, the masks and rotary tables it
hands each layer, the final norm, the head): a training step calls the decoder in a *visit* that tells each
streamed layer what to do with its call (``Capture``: record it and pass the hidden states on, so the step's
schedule runs the layers itself, layer-major, ``engine.schedule``; ``Suffix``: hand the last layer's output
from the schedule to the final norm and head). Outside a step (inference, ``StreamedTrainer.logits``) a
streamed layer acquires its weights, computes and releases them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from tiertune.engine.compute import Call, Compute, run_layer

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig
    from tiertune.engine.layout import GroupState
    from tiertune.engine.loss import CausalLMLoss
    from tiertune.engine.router_aux import RouterAux
    from tiertune.engine.rows import InputRows
    from tiertune.loading.model import ModelParts
    from tiertune.methods.lora import Adapters
    from tiertune.settings import ObjectiveSettings


class Visit(Protocol):
    """What the streamed layers do with their calls while the decoder runs inside a step."""

    def layer(self, index: int, hidden: torch.Tensor, call: Call) -> torch.Tensor:
        """Layer ``index`` called with ``hidden`` and ``call``: the hidden states it returns."""
        ...


class LayerEngine(Protocol):
    """What streamed layers and the step's schedule use of the engine, by decoder layer index."""

    safe_point: Callable[[], None] | None  # called where a run may stop (no chunk half acquired)
    router_aux: RouterAux | None  # an MoE's auxiliary loss, whose gradient joins each layer's backward
    visit: Visit | None  # the decoder's pass in progress inside a step (None: layers stream through)

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

    def layer_grads(self, index: int, grads: dict[str, torch.Tensor | None], ready: Any = None) -> None:
        """Layer ``index``'s weight gradients of a wave of micro-batches, summed (its backward launched;
        ``ready``: ``Compute.mark`` after it, what the hand-off waits for)."""
        ...


class StepEngine(LayerEngine, Protocol):
    """What the step's schedule (``engine.schedule``, ``engine.pairs``) uses of the engine beside its layers:
    the model and its parts, the groups outside the layers, the loss, the objective and the adapters.
    ``StreamedTrainer`` is one; the schedule never imports it."""

    device: torch.device
    compute: Compute
    config: EngineConfig
    objective: ObjectiveSettings
    loss: CausalLMLoss
    model: nn.Module
    parts: ModelParts
    states: list[GroupState]
    adapters: Adapters | None
    handoff_lag: int  # ``EngineConfig.handoff_lag`` resolved for the device the run computes on
    input_rows: (
        InputRows | None
    )  # a trained input embedding back-propagated through its rows (``engine.rows``)

    def bound_group(
        self, state: GroupState, requires_grad: bool
    ) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """A group's weights acquired on the device and bound for the block; yields them by name."""
        ...

    def add_grads(self, state: GroupState, grads: dict[str, torch.Tensor | None]) -> None:
        """A wave's summed weight gradients of ``state``'s group (one outside the decoder layers)."""
        ...

    def embedding_parts(self) -> tuple[bool, bool]:
        """Whether this wave hands the input embedding's gradient on in two parts, and whether its update is
        split (``GradientSink.embedding_parts``)."""
        ...

    def add_outside(self, rows: InputRows, dense: torch.Tensor | None, split: bool) -> None:
        """The embedding's gradient outside the wave's ``rows`` is final (``dense``: a tied head's, or none);
        ``split``: its update starts (``GradientSink.add_outside``)."""
        ...

    def reference(self) -> AbstractContextManager[None]:
        """The model as a preference objective's reference for the block (the base, its adapters off)."""
        ...


class Stop(Exception):
    """Raised by a visit that has what it needs before the decoder's forward ends (``Capture(first_only)``)."""


class Capture:
    """The decoder's pass that records each layer's call and skips the layer (its input is passed on): the
    embeddings' output (``first``, the first layer's input) and every layer's ``calls``. With ``first_only``
    the decoder stops at the first layer (``Stop``): the embeddings recomputed for their backward."""

    def __init__(self, layers: int, first_only: bool = False) -> None:
        self.first: torch.Tensor | None = None
        self.calls: list[Call | None] = [None] * layers
        self.first_only = first_only

    def layer(self, index: int, hidden: torch.Tensor, call: Call) -> torch.Tensor:
        if index == 0:
            self.first = hidden
            if self.first_only:
                raise Stop
        self.calls[index] = call
        return hidden


class Suffix:
    """The decoder's pass after the layers have run: the last layer returns ``output`` (its output computed by
    the schedule, a leaf whose gradient the loss's backward leaves), the others pass their input on."""

    def __init__(self, last: int, output: torch.Tensor) -> None:
        self.last, self.output = last, output

    def layer(self, index: int, hidden: torch.Tensor, call: Call) -> torch.Tensor:
        return self.output if index == self.last else hidden


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` of the model instance (see the module docstring)."""

    def __init__(self, engine: LayerEngine, index: int, layer: nn.Module) -> None:
        super().__init__()
        self._engine = [engine]  # lists keep them out of the module tree: names and .to() stay the model's
        self._layer = [layer]
        self.index = index

    @property
    def layer(self) -> nn.Module:
        """The model's own decoder layer this one streams."""
        return self._layer[0]

    def train(self, mode: bool = True) -> StreamedLayer:
        """Train or evaluation mode, for the decoder layer it streams too: held out of the module tree, that
        layer (its dropout, its adapters' dropout) is reached by the model's ``train()``/``eval()`` here."""
        super().train(mode)
        self._layer[0].train(mode)
        return self

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        assert isinstance(hidden, torch.Tensor)
        engine = self._engine[0]
        if engine.visit is not None:
            return engine.visit.layer(self.index, hidden, (rest, kwargs))
        if engine.safe_point is not None:
            engine.safe_point()
        with engine.layer_weights(self.index, requires_grad=False):  # streamed through, nothing kept
            return run_layer(self._layer[0], hidden, (rest, kwargs))
