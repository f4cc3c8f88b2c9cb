"""The step's one seam between what it holds and what it computes (``Compute``).

The engine's parts (the schedule, the gradient hand-off, the optimizer, the loader) make the store's calls
themselves: which chunk is acquired where, written, released, exchanged. What they compute on the tensors
those calls give, and every value a decision reads back into Python (a loss, a gradient norm), goes
through ``Compute``. There are two substrates:

- ``Compute``: the real one. Autograd, the model's own modules, the optimizer's arithmetic.
- ``Ledger``: no arithmetic. Over a ledger store (``StoreConfig.ledger``: chunks of no bytes, on the meta
  device) the same parts make the same store calls in the same order; a layer's output is its input's
  shape and its backward hands its output's gradient to its input (no autograd runs through it: the
  weights' gradients are none, which the hand-off takes as zeros), the loss a scalar with a gradient to
  the last layer's output, the optimizer's update nothing, and
  each value read is what the replayed step is given (``Ledger.clipped``: which steps are clipped). So
  ``tiertune estimate`` runs the engine's own step, not a copy of it (``engine.replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from tiertune.engine.objective import pair_losses
from tiertune.structure import text_decoder

if TYPE_CHECKING:
    from tiertune.engine.loss import CausalLMLoss
    from tiertune.engine.trace import Trace
    from tiertune.settings import ObjectiveSettings

T = TypeVar("T")

Call = tuple[tuple, dict]
"""What a decoder layer is called with besides its hidden states: positional and keyword arguments (the
attention mask, the rotary tables, position ids...), which the model computes before its first layer."""


def run_layer(layer: nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
    """``layer``'s output hidden states for ``hidden`` and ``call`` (the first of a tuple it returns)."""
    args, kwargs = call
    out = layer(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class Compute:
    """The real substrate: every call computes (see the module docstring)."""

    ledger = False
    # a ledger's record of the step (``engine.trace``), for the estimate's timeline
    trace: Trace | None = None

    def __init__(self) -> None:
        self._side: dict[int, torch.cuda.Stream] = {}  # per CUDA device, the stream ``after`` runs blocks on

    def note(self, *op: object) -> None:
        """Record ``op`` in the trace, if one is kept (``engine.trace``; a real run keeps none)."""
        if self.trace is not None:
            self.trace.op(*op)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``: arithmetic whose result the store's calls do not depend on (an optimizer
        update into chunks already acquired, weights read into a chunk being written)."""
        return fn(*args, **kwargs)

    def value(self, t: torch.Tensor) -> float:
        """A scalar read into Python (a loss, a metric)."""
        return float(t)

    def mark(self, device: torch.device) -> Any:
        """The point the work launched on ``device`` so far has reached (a CUDA event recorded on the current
        stream; None on a CPU, whose work is done when its call returns), for ``after``."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def after(self, mark: Any) -> AbstractContextManager[None]:
        """A block whose device work runs once the work before ``mark`` is done and not behind what was
        launched since (on CUDA: on a stream of its own that waits for the event; a copy to the host there
        returns when the copy is done, without waiting for the compute stream's later kernels)."""
        if mark is None:
            return nullcontext()
        device = torch.cuda.current_device()
        if device not in self._side:
            self._side[device] = torch.cuda.Stream()
        stream = self._side[device]
        stream.wait_event(mark)
        return torch.cuda.stream(stream)

    def norm(self, t: torch.Tensor, step: int) -> torch.Tensor:
        """``t``'s L2 norm as ``clip_grad_norm_`` takes it (an fp32 scalar tensor); ``step``: the step it is
        taken in, counted from 1."""
        return torch.linalg.vector_norm(t)

    def decoder(
        self, model: nn.Module, layers: Sequence[nn.Module], ids: torch.Tensor, extra: dict, kwargs: dict
    ) -> None:
        """The model's decoder on a micro-batch's ``ids`` (and ``extra`` inputs: masks, positions) inside the
        engine's visit (``Capture``: it records each of ``layers``' calls and the embeddings' output, and may
        stop at the first layer)."""
        text_decoder(model)(input_ids=ids, **extra, **kwargs)

    def layer(self, layer: nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
        """A decoder layer's output for ``hidden`` and ``call`` (``streaming.run_layer``)."""
        return run_layer(layer, hidden, call)

    def layer_backward(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        call: Call,
        holder: list[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        more: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> list[torch.Tensor | None]:
        """The layer recomputed on ``hidden`` and back-propagated with its output's gradient (taken from
        ``holder``, so that nothing else keeps it while backward runs) and the (output, gradient) pairs that
        ``more()`` gives after the recompute (the router's logits): the gradients of ``inputs``, None where
        one is unused."""
        out = self.layer(layer, hidden, call)
        # neither the output nor its gradient stays referenced here while backward runs
        outputs: list = [Handoff.apply(out, holder)]
        grad_outputs: list = [None]
        del out
        for output, grad in more() if more is not None else ():
            outputs.append(output)
            grad_outputs.append(grad)
        if not inputs:
            return []
        return list(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True))

    def loss(
        self,
        loss: CausalLMLoss,
        last: torch.Tensor,
        ids: torch.Tensor,
        extra: dict,
        target: torch.Tensor,
        token_weight: torch.Tensor | None = None,
        rows_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The summed cross-entropy of ``target`` through the model's suffix on ``last``, the last layer's
        output (``CausalLMLoss``; the model reads ``last`` through the engine's ``Suffix`` visit)."""
        if token_weight is None and rows_out is None:
            return loss(ids, extra, target)
        return loss(ids, extra, target, token_weight=token_weight, rows_out=rows_out)

    def token_losses(
        self, loss: CausalLMLoss, last: torch.Tensor, ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> torch.Tensor:
        """Each target token's cross-entropy, without autograd (``CausalLMLoss.token_losses``)."""
        return loss.token_losses(ids, extra, target)

    def token_losses_and_entropies(
        self, loss: CausalLMLoss, last: torch.Tensor, ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target token's cross-entropy and entropy, without autograd
        (``CausalLMLoss.token_losses_and_entropies``)."""
        return loss.token_losses_and_entropies(ids, extra, target)

    def pair_losses(
        self, settings: ObjectiveSettings, token_losses: torch.Tensor, *args: Any
    ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        """A preference objective's losses and metrics (``objective.pair_losses``)."""
        return pair_losses(settings, token_losses, *args)

    def distill(
        self, loss: CausalLMLoss, last: torch.Tensor, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A distillation's summed loss, cross-entropy and divergence (``CausalLMLoss.distill``)."""
        return loss.distill(*args)

    def grpo_loss(self, logps: torch.Tensor, *args: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """GRPO's loss of a micro-batch of completions and its metrics (``engine.grpo.grpo_loss``)."""
        from tiertune.engine.grpo import grpo_loss

        return grpo_loss(logps, *args)


class Ledger(Compute):
    """The ledger substrate: shapes, no arithmetic (see the module docstring). ``clipped[k]``: whether step
    k + 1's gradient norm is above ``max_grad_norm`` (a step past the list is not clipped)."""

    ledger = True

    def __init__(self, clipped: Sequence[bool], max_grad_norm: float) -> None:
        super().__init__()
        self.clipped = tuple(clipped)
        self.max_grad_norm = max_grad_norm

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        if self.trace is not None:
            self.trace.op("run", *_sized(fn, args))
        return None

    def value(self, t: torch.Tensor) -> float:
        return 0.0 if t.is_meta else float(t)

    def norm(self, t: torch.Tensor, step: int) -> torch.Tensor:
        # each tensor's norm above the clipping norm on a clipped step (so is the total), else zero
        self.note("run", "read", t.numel(), t.numel() * t.element_size())
        clipped = step <= len(self.clipped) and self.clipped[step - 1]
        return torch.tensor(2.0 * self.max_grad_norm if clipped else 0.0)

    def decoder(
        self, model: nn.Module, layers: Sequence[nn.Module], ids: torch.Tensor, extra: dict, kwargs: dict
    ) -> None:
        # what the model's decoder hands its layers: the embeddings' output (through the bound embedding, so
        # its gradient reaches it when it is trained), then each layer called in turn
        hidden = model.get_input_embeddings()(ids)
        for layer in layers:  # the visit captures each call (no compute: not traced)
            hidden = layer(hidden)

    def layer(self, layer: nn.Module, hidden: torch.Tensor, call: Call) -> torch.Tensor:
        # its input's shape (a new empty tensor: arithmetic on the meta device, and empty_like, run torch's
        # Python reference kernels, which were the replay's largest cost), and a gradient path to it when autograd records
        self.note("layer", hidden.shape[:-1].numel(), "forward")
        if not torch.is_grad_enabled():
            return hidden.new_empty(hidden.shape)
        return (
            _Through.apply(hidden)
            if hidden.requires_grad
            else hidden.new_empty(hidden.shape).requires_grad_()
        )

    def layer_backward(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,
        call: Call,
        holder: list[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        more: Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    ) -> list[torch.Tensor | None]:
        # the layer is its input's shape: its input's gradient is its output's, the weights' none
        self.note("layer", hidden.shape[:-1].numel(), "backward")
        grad = holder.pop()
        return [grad if k == 0 and t is hidden else None for k, t in enumerate(inputs)]

    def loss(
        self,
        loss: CausalLMLoss,
        last: torch.Tensor,
        ids: torch.Tensor,
        extra: dict,
        target: torch.Tensor,
        token_weight: torch.Tensor | None = None,
        rows_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.note("head", last.shape[:-1].numel(), "loss")
        return last.sum() * 0.0

    def token_losses(
        self, loss: CausalLMLoss, last: torch.Tensor, ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> torch.Tensor:
        self.note("head", last.shape[:-1].numel(), "logps")
        return torch.zeros(target.shape, device=target.device)

    def token_losses_and_entropies(
        self, loss: CausalLMLoss, last: torch.Tensor, ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.note("head", last.shape[:-1].numel(), "logps")
        zeros = torch.zeros(target.shape, device=target.device)
        return zeros, zeros.clone()

    def pair_losses(
        self, settings: ObjectiveSettings, token_losses: torch.Tensor, *args: Any
    ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
        return token_losses.sum(1) * 0.0, {}

    def grpo_loss(self, logps: torch.Tensor, *args: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return logps.sum() * 0.0, {}

    def distill(
        self, loss: CausalLMLoss, last: torch.Tensor, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.note("head", last.shape[:-1].numel(), "distill")
        zero = last.sum() * 0.0
        return zero, zero.detach(), zero.detach()


ADAMW = {"_adamw": 1, "_adamw_views": 0, "adam_move": 0, "adamw_stochastic": 0}
"""The optimizer's arithmetic ``Ledger.run`` prices by elements: the function's name, and which argument holds
the tensors it updates (a dict or list of them); anything else it runs is priced by the bytes it writes."""


def _sized(fn: Callable, args: tuple) -> tuple[str, int, int]:
    """``("adamw", elements, bytes)`` of the tensors the optimizer's arithmetic updates, else ``("copy",
    elements, bytes)`` of what ``fn`` writes: the tensor it is a method of (``acc.copy_``), or its first
    argument (``_copy(into, source, ...)``)."""
    name = getattr(fn, "__name__", "")
    owner = getattr(fn, "__self__", None)
    if name in ADAMW:
        kind, tensors = "adamw", list(_tensors(args[ADAMW[name]]))
    else:
        kind, tensors = "copy", list(_tensors(owner if isinstance(owner, torch.Tensor) else args[:1]))
    return kind, sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


def _tensors(x: object) -> Iterable[torch.Tensor]:
    """The tensors in ``x``: itself, or inside its lists, tuples and dict values."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


class Handoff(torch.autograd.Function):
    """A scalar on ``out``'s graph whose backward hands ``out`` the gradient in ``holder`` (taken from it):
    back-propagating from the scalar is back-propagating ``out`` with that gradient, but neither ``out`` (not
    saved) nor the gradient (autograd's only reference once taken) outlives its use."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, holder: list[torch.Tensor]) -> torch.Tensor:
        ctx.holder = holder
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        return ctx.holder.pop(), None


class _Through(torch.autograd.Function):
    """A ledger's layer under autograd: an empty tensor of its input's shape whose gradient is its input's."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty(hidden.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


__all__ = ["Compute", "Handoff", "Ledger"]
