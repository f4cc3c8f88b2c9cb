"""A training step's schedule: layer-major, in waves of micro-batches (``LayerMajor``).

A step of k micro-batches runs as waves of m (m = k when their saved hidden states fit, ``Stash``). In a
wave each decoder layer is visited once in forward and once in backward, for all m micro-batches while its
weights are on the device, so the weights cross disk and PCIe k/m times a step instead of k times:

- prefix: per micro-batch, the decoder called in a ``Capture`` visit computes the embeddings and the call of
  every layer (masks, rotary tables), skipping the layers; the embeddings' output goes to boundary 0;
- forward: for layer i = 0..L-1, its weights acquired once; each micro-batch's boundary i through it (each
  micro-batch with its own random stream, so dropout is the micro-batch's however the wave is cut) into
  boundary i+1; boundary i sent home for backward;
- suffix: per micro-batch (or per stack, below), the decoder called again in a ``Suffix`` visit: the final
  norm, head and loss on boundary L, back-propagated to it (the head's gradients summed on the device, fp32);
- backward: for layer i = L-1..0, its weights acquired once; each micro-batch's forward recomputed from
  boundary i (its random stream restored) and back-propagated, the weight gradients summed on the device in
  fp32 (the order a host accumulator would add them) and handed to the engine once (``layer_grads``:
  the host's accumulators, the optimizer during backward);
- the embeddings, recomputed per micro-batch, back-propagated from boundary 0's gradient (when trained).

Within a layer's visit, the wave's micro-batches run as few batches (*stacks*, ``stacks``) as compute the
same: nothing in the layer draws random numbers, no router loss is kept per micro-batch, a stack's calls
differ only along the batch, and it holds at most ``EngineConfig.stack_limit`` tokens (by default a quantized
base's layers only). A quantized layer is then dequantized once per stack, not once per micro-batch (on a
CPU, most of a small micro-batch's time), and its gradients are summed by the matmuls themselves. The suffix
stacks the same way: the head is read once per stack, not once per micro-batch.

The groups outside the decoder layers stay bound for the wave. The bytes a step moves follow from this
order; ``engine.replay`` makes the same store calls, so ``tiertune estimate`` counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack, nullcontext, suppress
from functools import partial
from typing import TYPE_CHECKING

import torch

from tiertune.engine import several
from tiertune.engine.compute import Call
from tiertune.engine.micro import Micro, Rng, add, harvest, streams
from tiertune.engine.stacking import draws_random, first_fit, stack_calls
from tiertune.engine.stash import Stash, stash_slots
from tiertune.engine.streaming import Capture, StepEngine, Stop
from tiertune.engine.suffix import Suffixes
from tiertune.errors import StateError

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig
    from tiertune.engine.layout import GroupState


def waves(cfg: EngineConfig, micro_batches: int) -> list[range]:
    """The waves of a step of ``micro_batches``: ``wave_size`` at a time (0: all), no more than the boundary
    chunks have slots for, the last wave what is left."""
    slots = stash_slots(cfg) if cfg.activations == "host" else None
    m = min(x for x in (micro_batches, slots, cfg.wave_size or None) if x)
    return [range(lo, min(lo + m, micro_batches)) for lo in range(0, micro_batches, m)]


class LayerMajor(Suffixes):
    """The layer-major step of ``engine`` (the module docstring), its boundaries in ``stash``."""

    def __init__(self, engine: StepEngine, stash: Stash) -> None:
        self.engine, self.stash = engine, stash
        self.layers = [layer.layer for layer in engine.parts.layers]  # the model's own (streamed) layers
        self._random = [draws_random(layer) for layer in self.layers]
        # a preference objective's metrics over the step so far, each a sum and what it counts (pairs, or
        # micro-batches: ``engine.objective.pair_losses``); the engine resets them at each step's start
        self.metrics: dict[str, tuple[float, float]] = {}
        # of several adapters over one base: each one's summed loss and metrics over the step so far (reset with
        # metrics)
        self.adapter_losses: dict[str, float] = {}
        self.adapter_metrics: dict[str, dict[str, tuple[float, float]]] = {}

    def stacks(self, i: int, micro: Sequence[Micro]) -> list[list[int]]:
        """The micro-batches of a wave (indices) that layer ``i``'s visit runs together: each joins the first
        stack whose calls its own stacks with (``stack_calls``: a micro-batch with padding, whose layers get a
        mask, and one without do not) while the stack holds at most ``stack_limit`` tokens, when the layer
        draws no random numbers and no router loss is kept per micro-batch; else each runs on its own."""
        limit = self.engine.config.stack_limit
        if limit <= 0 or self._random[i] or self.engine.router_aux is not None:
            return [[j] for j in range(len(micro))]
        return first_fit(
            micro,
            limit,
            lambda head, mb: (
                several.shares(self.engine.adapters, head, mb)
                and mb.shape[1:] == head.shape[1:]
                and stack_calls([head.calls[i], mb.calls[i]], [head.shape[0], mb.shape[0]]) is not None
            ),
        )

    def _stacked(
        self, i: int, micro: Sequence[Micro], group: list[int], xs: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Call]:
        """The inputs and call of ``group``'s micro-batches at layer ``i`` as one batch."""
        if len(group) == 1:
            return xs[group[0]], micro[group[0]].calls[i]
        call = stack_calls([micro[j].calls[i] for j in group], [micro[j].shape[0] for j in group])
        assert call is not None  # ``stacks`` checked each against the first
        return torch.cat([xs[j] for j in group]), call

    def waves(self, micro_batches: int) -> list[range]:
        """The waves of a step of ``micro_batches`` (``waves``)."""
        return waves(self.engine.config, micro_batches)

    def run(
        self,
        batches: Sequence[dict[str, torch.Tensor]],
        labels: Sequence[torch.Tensor],
        n_tokens: int,
        micro_batches: int,
    ) -> tuple[float, float]:
        """One wave over ``batches`` (their ``labels``), its loss divided by the step's ``n_tokens`` target
        tokens; returns the wave's summed cross-entropy and its router auxiliary losses' sum (unweighted)."""
        engine = self.engine
        device = engine.device
        others = [s for s in engine.states if s.group.kind != "layer"]
        summed: dict[int, dict[str, torch.Tensor]] = {id(s): {} for s in others}
        # a trained untied head, which only the loss uses: released and its gradients handed on once the loss's
        # backward has made them, so its update runs behind the layers' backward (the embedding's group, and the
        # rest, which may hold what the embeddings use, wait for boundary 0's backward)
        done_early = [s for s in others if s.group.kind == "head" and s.trainable]
        # a trained embedding back-propagated through its wave's rows alone (``engine.rows``): released once its
        # last reader is done, the prefix or, tied, the loss
        rows = engine.input_rows
        # and, a step of one wave (the tensor whole here), handed on in two parts (``GradientSink.add_outside``):
        # its gradient outside the wave's rows once it is final (none untied; tied, the loss's), where a
        # speculative step's update of those rows starts (``splits``: behind the rest of the step), then the rows'
        two_parts, split = engine.embedding_parts()
        with ExitStack() as stack:
            holds = {id(s): stack.enter_context(ExitStack()) for s in others}
            bound = {
                id(s): holds[id(s)].enter_context(engine.bound_group(s, requires_grad=s.trainable))
                for s in others
            }
            names = {key: list(params) for key, params in bound.items()}
            stack.callback(setattr, engine, "visit", None)
            stack.callback(self.stash.abandon)  # nothing is open when the wave ends as it should
            # (of several adapters: each micro-batch's seed drawn from its adapter's generator)
            seeds = [int(b["stream_seed"]) for b in batches] if "stream_seed" in batches[0] else None
            micro = [
                Micro.of(b, lab, rng, device)
                for b, lab, rng in zip(batches, labels, streams(len(batches), device, seeds), strict=True)
            ]
            if rows is not None:
                rows.start([mb.ids for mb in micro])
            prefix_trained, first = self._prefix(micro)
            if rows is not None:
                rows.gather(bound[id(rows.state)][rows.name])
            # a split update writes the embedding's weights during the step: it is released once its last reader
            # is done (the prefix, or a tied head's loss); else it stays bound for the wave, as the other groups
            untied = rows if two_parts and not engine.parts.tied else None
            tied = rows if two_parts and engine.parts.tied else None
            if untied is not None:
                if split:
                    _release(untied.state, holds, bound)
                engine.add_outside(untied, None, split)
            last = self._forward(micro, first)
            # the decoder's embeddings in the suffix (passed on to the last layer, which hands back its output):
            # a released embedding's rows stand in for it (its values for these ids)
            with untied.bound() if untied is not None and split else nullcontext():
                total, aux_total = self._suffix(micro, last, n_tokens, micro_batches, bound, summed)
            if tied is not None:
                if split:
                    _release(tied.state, holds, bound)
                engine.add_outside(tied, summed[id(tied.state)].pop(tied.name, None), split)
            for state in done_early:
                self._hand_on(state, holds[id(state)], names[id(state)], summed)
            self._backward(micro, prefix_trained)
            if prefix_trained:
                self._prefix_backward(micro, bound, summed)
            for state in others:
                if state not in done_early:
                    self._hand_on(state, holds[id(state)], names[id(state)], summed)
        return total, aux_total

    def _hand_on(self, state: GroupState, hold: ExitStack, names: list[str], summed: dict) -> None:
        """Release a group bound for the wave (the optimizer writes its weights) and hand its wave's gradients
        to the engine (the embedding's rows added into its dense part, ``InputRows.into``)."""
        hold.close()
        if not state.trainable:
            return
        grads = {n: summed[id(state)].get(n) for n in names}
        rows = self.engine.input_rows
        if rows is not None and rows.state is state:
            grads[rows.name] = rows.into(grads[rows.name])
        self.engine.add_grads(state, grads)

    # ------------------------------------------------------------------ the passes

    def _decoder(self, mb: Micro) -> None:
        engine = self.engine
        engine.compute.decoder(engine.model, engine.parts.layers, mb.ids, mb.extra, engine.loss.model_kwargs)

    def _prefix(self, micro: list[Micro]) -> tuple[bool, list[torch.Tensor]]:
        """Each micro-batch's embeddings into boundary 0 (returned, held) and its layers' calls; and whether
        the embeddings' output carries a gradient (a trained embedding, or adapters in it)."""
        engine = self.engine
        trained = False
        outputs: list[torch.Tensor] = []
        for mb in micro:
            if engine.safe_point is not None:
                engine.safe_point()
            several.route(engine.adapters, mb)
            visit = engine.visit = Capture(len(self.layers))
            with mb.start.running(engine.device):
                self._decoder(mb)
                mb.rng = Rng.now(engine.device)
            if visit.first is None or any(c is None for c in visit.calls):
                raise StateError("the model's decoder did not call each of its layers once")
            mb.calls = visit.calls  # type: ignore[assignment]
            mb.shape = visit.first.shape
            trained = trained or visit.first.requires_grad
            outputs.append(visit.first.detach())
            # the reference's (the base, adapters off) beside the policy's: its embeddings, the policy's unless
            # adapters change them (a full fine-tune's reference log-probabilities come with the batch)
            if self.refers(mb):
                mb.ref = outputs[-1] if not visit.first.requires_grad else self._reference_embeddings(mb)
        first = self.stash.open(0, [mb.shape for mb in micro], write=True)
        for x, out in zip(first, outputs, strict=True):
            x.copy_(out)
        return trained, first

    def _forward(self, micro: list[Micro], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Layers 0..L-1, each visited once for every micro-batch of the wave, from boundary 0 (``xs``, held);
        returns boundary L, held."""
        engine = self.engine
        shapes = [mb.shape for mb in micro]
        aux = engine.router_aux
        if aux is not None:
            aux.start()
        for i, layer in enumerate(self.layers):
            if engine.safe_point is not None:
                engine.safe_point()
            self.stash.settle()
            with torch.no_grad(), engine.layer_weights(i, requires_grad=False):
                ys = self.stash.open(i + 1, shapes, write=True)
                for group in self.stacks(i, micro):
                    head = micro[group[0]]
                    several.route(engine.adapters, head, micro, group)
                    if aux is not None:
                        aux.micro = group[0]
                    x, call = self._stacked(i, micro, group, xs)
                    with head.rng.running(engine.device):  # a stack draws nothing: one stream will do
                        for j in group:
                            micro[j].before.append(head.rng)
                        out = engine.compute.layer(layer, x, call)
                        if len(group) == 1:
                            head.rng = Rng.now(engine.device)
                    for j, part in zip(group, out.split([micro[j].shape[0] for j in group]), strict=True):
                        ys[j].copy_(part)
                    del out, x
                    # the same weights, read once: the reference's hidden states move on too
                    refs = [j for j in group if micro[j].ref is not None]
                    if refs:
                        self._reference_layer(i, micro, refs)
            self.stash.close(i, keep=True)
            xs = ys
        return xs

    def _backward(self, micro: list[Micro], prefix_trained: bool) -> None:
        """Layers L-1..0, each visited once: recomputed and back-propagated for every micro-batch. A layer's
        summed gradients are handed to the engine after the next layer's backward is launched when
        ``handoff_lag`` says so (on a GPU the hand-off then overlaps that backward), else right away."""
        engine = self.engine
        shapes = [mb.shape for mb in micro]
        lag = engine.handoff_lag
        pending: list[tuple[int, dict[str, torch.Tensor | None], object]] = []
        for i in reversed(range(len(self.layers))):
            if engine.safe_point is not None:
                engine.safe_point()
            trainable = engine.layer_trainable(i)
            adapters = engine.layer_adapters(i)
            input_grad = i > 0 or prefix_trained
            summed: dict[str, torch.Tensor] = {}
            self.stash.settle()
            xs = self.stash.open(i, shapes, write=False)
            with engine.layer_weights(i, trainable) as params:
                trained = params if trainable else {}
                for group in self.stacks(i, micro):
                    head = micro[group[0]]
                    several.route(engine.adapters, head, micro, group)
                    with head.before[i].running(engine.device), torch.enable_grad():
                        x, call = self._stacked(i, micro, group, xs)
                        x = x.detach().requires_grad_(input_grad)
                        inputs = ([x] if input_grad else []) + list(trained.values()) + adapters
                        # the auxiliary loss's gradient at the router logits (which the recompute records)
                        aux = (
                            partial(engine.router_aux.gradients, group[0], i)
                            if engine.router_aux is not None
                            else None
                        )
                        # the gradient handed over in a list (``Handoff``): once the layer's ops have used it,
                        # nothing here references it while backward runs
                        holder = [head.grad if len(group) == 1 else torch.cat([micro[j].grad for j in group])]
                        for j in group:
                            micro[j].grad = None
                        grads = engine.compute.layer_backward(self.layers[i], x, call, holder, inputs, aux)
                    gx = grads.pop(0) if input_grad else None
                    parts = (
                        gx.split([micro[j].shape[0] for j in group])
                        if gx is not None
                        else [None] * len(group)
                    )
                    for j, part in zip(group, parts, strict=True):
                        micro[j].grad = part
                    for name, g in zip(trained, grads[: len(trained)], strict=True):
                        add(summed, name, g)
                    for p, g in zip(adapters, grads[len(trained) :], strict=True):
                        if g is not None:  # as autograd accumulates a leaf's gradient
                            p.grad = g if p.grad is None else p.grad.add_(g)
                    del x, grads
            self.stash.close(i, keep=False)
            if trainable:
                # handed on later: the point its copy waits for (handed on now, the copy follows on the stream)
                ready = engine.compute.mark(engine.device) if lag else None
                pending.append((i, {n: summed.get(n) for n in trained}, ready))
            while len(pending) > lag:
                engine.layer_grads(*pending.pop(0))
            del summed
        for held in pending:
            engine.layer_grads(*held)

    def _prefix_backward(self, micro: list[Micro], bound: dict, summed: dict) -> None:
        """The embeddings of each micro-batch recomputed and back-propagated from boundary 0's gradient."""
        engine = self.engine
        rows = engine.input_rows
        with rows.bound() if rows is not None else nullcontext():
            for mb in micro:
                several.route(engine.adapters, mb)
                visit = engine.visit = Capture(len(self.layers), first_only=True)
                with mb.start.running(engine.device), suppress(Stop):
                    self._decoder(mb)
                engine.visit = None
                if visit.first is not None and visit.first.requires_grad and mb.grad is not None:
                    torch.autograd.backward(visit.first, mb.grad)
                    harvest(bound, summed)
                    if rows is not None:
                        rows.harvest()
                mb.grad = None


def _release(state: GroupState, holds: dict, bound: dict) -> None:
    """Release a group bound for the wave before its gradients are handed on (its last reader is done)."""
    holds[id(state)].close()
    bound.pop(id(state), None)


__all__ = ["LayerMajor", "streams", "waves"]
