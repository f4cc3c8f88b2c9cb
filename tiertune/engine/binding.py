"""Binding: chunk tensors made a model instance's parameters for the time a chunk is acquired, and the
skeleton's meta placeholders put back after, so no module keeps a reference to released chunk memory."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tiertune.quant import Quantizer, is_quantized, shipped
from tiertune.quant import experts as quant_experts


@dataclass
class Slot:
    """Where one parameter is bound in the model instance (a tied weight has several slots)."""

    module: nn.Module
    attr: str


class Binder:
    """Binds chunk tensors, by parameter name, as ``model``'s parameters: a plain weight as an
    ``nn.Parameter`` over the chunk's memory, a quantized one as ``quant`` builds it (its statistics are bound
    with it), an MoE expert weight stored one matrix per expert
    as ``quant.experts`` (4-bit) or ``quant.shipped`` binds it."""

    def __init__(self, model: nn.Module, quant: Quantizer | None) -> None:
        self.quant = quant
        self.meta = dict(model.named_parameters())  # the skeleton's placeholders, put back by unbind
        by_id = {id(p): n for n, p in self.meta.items()}
        self.slots: dict[str, list[Slot]] = {}
        for module in model.modules():
            for attr, param in module.named_parameters(recurse=False):
                self.slots.setdefault(by_id[id(param)], []).append(Slot(module, attr))
        self.quantized = {n for n, p in self.meta.items() if is_quantized(p)}
        self.quantized_experts = {n for n, p in self.meta.items() if quant_experts.is_quantized_experts(p)}
        self.parametrized: set[str] = set()

    def parametrize(self, targets: Iterable[tuple[nn.Module, str]]) -> None:
        """Mark the weights peft adapts through a parametrization (MoE routers and unquantized experts: the
        ``(module, attr)`` pairs of ``targets``). Registering it calls ``set_`` on the bound weight, which bumps
        the version counter that all views of a chunk share; autograd would then refuse the layer's other
        weights saved for backward. They are bound as tensors of their own (``alias``)."""
        wanted = {(id(module), attr) for module, attr in targets}
        self.parametrized = {
            n for n, slots in self.slots.items() if any((id(t.module), t.attr) in wanted for t in slots)
        }

    def bind(self, views: dict[str, torch.Tensor], requires_grad: bool) -> dict[str, torch.Tensor]:
        """Make chunk tensors (``views``, by name) the model's parameters; returns the bound leaf tensors."""
        bound = {}
        for name, view in views.items():
            if name not in self.slots:  # a quantized weight's statistics: bound with the weight
                continue
            if name in self.quantized:
                param = self.quant.parameter(name, self.meta[name].shape, views)  # type: ignore[union-attr]
            elif name in self.quantized_experts:
                shape = self.meta[name].shape
                if shipped.is_shipped_format(self.quant):  # each expert as shipped
                    param = shipped.bind_experts(self.quant, name, shape, views)
                else:
                    transposed = bool(getattr(self.meta[name], "transposed", False))
                    param = quant_experts.bind(self.quant, name, shape, views, transposed)  # type: ignore[arg-type]
            elif name in self.parametrized:
                param = nn.Parameter(alias(view), requires_grad=requires_grad)
            else:
                param = nn.Parameter(view, requires_grad=requires_grad)
            for slot in self.slots[name]:
                slot.module._parameters[slot.attr] = param
            bound[name] = param
        return bound

    def unbind(self, names: Sequence[str]) -> None:
        """Put meta placeholders back, so no module keeps a reference to released chunk memory."""
        for name in names:
            for slot in self.slots[name]:
                slot.module._parameters[slot.attr] = self.meta[name]


def alias(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s memory that is not a view of the chunk: its version counter is its own."""
    out = view.new_empty(0)
    out.set_(view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    return out
