"""The passes a preference objective adds to the layer-major step (``engine.schedule``; ``engine.objective``
has the formulas): the reference beside the policy in each forward visit (the base, adapters off: LoRA), the
paired suffix (the tokens' losses without autograd, the objective, its derivative as the head's per-token
weights), and the pass before training that computes a full fine-tune's reference log-probabilities."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext, suppress
from typing import TYPE_CHECKING, Any

import torch

from tiertune.engine import several
from tiertune.engine.micro import Micro, harvest
from tiertune.engine.objective import add_metric
from tiertune.engine.streaming import Capture, StepEngine, Stop, Suffix
from tiertune.engine.teacher import teacher_of
from tiertune.errors import StateError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

if TYPE_CHECKING:
    from tiertune.engine.stash import Stash
    from tiertune.settings import ObjectiveSettings


class PairedPasses:
    """``LayerMajor``'s preference passes (it inherits them): they use its layers, stash, ``metrics``,
    ``_stacked`` (a group's inputs and call as one batch) and ``_decoder`` (the model's decoder on a
    micro-batch, inside a visit)."""

    engine: StepEngine
    stash: Stash
    layers: list[torch.nn.Module]
    metrics: dict[str, tuple[float, float]]
    adapter_losses: dict[str, float]
    objective_of: Callable[[Micro], ObjectiveSettings]
    metrics_of: Callable[[Micro], dict[str, tuple[float, float]]]

    def sequence_logps(
        self,
        batches: Sequence[dict[str, torch.Tensor]],
        head: Callable[[Any, Micro, torch.Tensor], Any] | None = None,
    ) -> list[Any]:
        """Each batch's rows' log-probabilities of their targets (summed over each row's ``labels``, shifted),
        by the model as it is now, without autograd: each layer visited once for all ``batches`` (their
        boundaries held on the device), the head fused (``CausalLMLoss.token_losses``); or what ``head(engine,
        micro-batch, its last layer's output)`` makes of each (a distillation's teacher: ``engine.teacher``).
        The global random generators are left as they were: a run draws the same streams with or without this
        pass."""
        engine = self.engine
        device = engine.device
        others = [s for s in engine.states if s.group.kind != "layer"]
        devices = [device] if device.type == "cuda" else []
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.no_grad())
            if engine.router_aux is not None:  # the pass is no step's: its router logits are no loss's
                stack.enter_context(engine.router_aux.paused())
            for state in others:
                stack.enter_context(engine.bound_group(state, requires_grad=False))
            stack.callback(setattr, engine, "visit", None)
            micro = []
            xs: list[torch.Tensor] = []
            for b in batches:
                labels = b.get("labels", b["input_ids"])
                mb = Micro(
                    b["input_ids"].to(device),
                    {k: b[k].to(device) for k in ("attention_mask", "position_ids") if k in b},
                    labels[:, 1:].to(device),
                    None,
                    None,
                    # a distillation's held-out figures (``finetune.evaluation``)
                    teacher=teacher_of(b, device),
                )  # type: ignore[arg-type]
                visit = engine.visit = Capture(len(self.layers))
                self._decoder(mb)
                if visit.first is None or any(c is None for c in visit.calls):
                    raise StateError("the model's decoder did not call each of its layers once")
                mb.calls = visit.calls  # type: ignore[assignment]
                micro.append(mb)
                xs.append(visit.first)
            for i, layer in enumerate(self.layers):
                if engine.safe_point is not None:
                    engine.safe_point()
                with engine.layer_weights(i, requires_grad=False):
                    for j, mb in enumerate(micro):
                        xs[j] = engine.compute.layer(layer, xs[j], mb.calls[i])
            out = []
            for j, mb in enumerate(micro):
                engine.visit = Suffix(len(self.layers) - 1, xs[j])
                if head is not None:
                    out.append(head(engine, mb, xs[j]))
                    continue
                out.append(
                    -engine.compute.token_losses(engine.loss, xs[j], mb.ids, mb.extra, mb.target).sum(1)
                )
        return out

    def _reference_embeddings(self, mb: Micro) -> torch.Tensor:
        """``mb``'s embeddings by the reference (the base, adapters off), its random streams untouched."""
        engine = self.engine
        visit = engine.visit = Capture(len(self.layers), first_only=True)
        with engine.reference(), mb.start.running(engine.device), suppress(Stop):
            self._decoder(mb)
        assert visit.first is not None  # the policy's capture of the same call found it
        return visit.first

    def _reference_layer(self, i: int, micro: Sequence[Micro], group: list[int]) -> None:
        """Layer ``i`` (its weights bound) on the reference's hidden states of ``group``'s micro-batches: the
        base's output, adapters off, without autograd and without drawing from any random stream."""
        engine = self.engine
        x, call = self._stacked(i, micro, group, [mb.ref for mb in micro])  # type: ignore[misc]
        devices = [engine.device] if engine.device.type == "cuda" else []
        paused = engine.router_aux.paused() if engine.router_aux is not None else nullcontext()
        with engine.reference(), torch.random.fork_rng(devices=devices), paused:
            out = engine.compute.layer(self.layers[i], x, call)
        del x
        for j, part in zip(group, out.split([micro[j].shape[0] for j in group]), strict=True):
            micro[j].ref = part

    def _paired_suffix(
        self,
        micro: list[Micro],
        among: Sequence[int],
        outs: list[torch.Tensor],
        n_pairs: int,
        micro_batches: int,
        bound: dict,
        summed: dict,
    ) -> tuple[float, float]:
        """Per micro-batch of pairs ``among`` (indices into ``micro``): its preference objective
        (``engine.objective``'s formulas) from its sequences' log-probabilities (the reference's from its own
        hidden states, computed first), back-propagated to the last layer's output through the head as a
        weighted cross-entropy; its loss divided by the step's ``n_pairs`` (of several adapters: its adapter's,
        ``Micro.tokens``). Returns the summed loss and router auxiliary losses."""
        engine = self.engine
        last = len(self.layers)
        aux = engine.router_aux
        total = aux_total = 0.0
        for j in among:
            mb = micro[j]
            objective = self.objective_of(mb)
            several.route(engine.adapters, mb)
            ref_logps = mb.ref_logps
            if mb.ref is not None:
                engine.visit = Suffix(last - 1, mb.ref)
                with engine.reference():
                    ref_logps = -engine.compute.token_losses(
                        engine.loss, mb.ref, mb.ids, mb.extra, mb.target
                    ).sum(1)
                mb.ref = None
            leaf = outs[j].detach().requires_grad_()
            engine.visit = Suffix(last - 1, leaf)
            if aux is not None:
                aux_total += aux.finish(j, mb.extra.get("attention_mask"), 1.0 / micro_batches)
            target = whole_target(mb) if objective.whole_sequences else mb.target
            token_losses = engine.compute.token_losses(
                engine.loss, leaf, mb.ids, mb.extra, target
            ).requires_grad_()
            losses, metrics = engine.compute.pair_losses(
                objective,
                token_losses,
                mb.target != IGNORE_INDEX,
                ref_logps,
                target != IGNORE_INDEX,
                mb.desirable,
            )
            loss_sum = losses.sum()
            (slope,) = torch.autograd.grad(loss_sum, token_losses)  # d loss / d each token's loss
            weight = (slope / (mb.tokens or n_pairs)).reshape(-1)
            engine.compute.loss(engine.loss, leaf, mb.ids, mb.extra, target, weight).backward()
            value = engine.compute.value(loss_sum.detach())
            total += value
            if mb.adapter is not None:
                self.adapter_losses[mb.adapter] = self.adapter_losses.get(mb.adapter, 0.0) + value
            into = self.metrics_of(mb)
            for name, (summed_value, count) in metrics.items():
                add_metric(into, name, summed_value, count)
            if leaf.grad is None:
                raise StateError("the loss does not depend on the last decoder layer's output")
            mb.grad = leaf.grad
            harvest(bound, summed)
        return total, aux_total


def whole_target(mb: Micro) -> torch.Tensor:
    """Every next token of ``mb``'s rows as a target (the prompts' too), padding aside: ORPO's cross-entropy."""
    target = mb.ids[:, 1:]
    mask = mb.extra.get("attention_mask")
    return target if mask is None else target.masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)


__all__ = ["PairedPasses", "whole_target"]
